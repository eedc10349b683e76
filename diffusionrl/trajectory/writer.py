"""Each step's trajectory as one Parquet file, written off the training thread.

``TrajectoryWriter`` is a loop callback: ``on_step`` hands the step's ``Trajectory`` to one writer
thread through a bounded queue (a full queue makes training wait: at most ``depth`` steps are
unwritten), which writes ``step-XXXXXX.parquet`` with ``trajectory.store.write_step`` (atomically,
every page checksummed; PNG encoding and Parquet writing release the GIL, so they overlap the next
rollout). At every checkpoint and at the end of the run it waits until everything queued is
written, re-raises the first write error, and verifies each file written since the last check
(readable footer, one row per sample, its step and schema version), so a checkpoint never goes out
ahead of the trajectories of the steps it covers. On a resumed run's first step it reads the files an
earlier attempt left (``verify_earlier_files``), so a damaged one is never carried on to registration.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from diffusionrl.run import Callback

_STOP = object()


class TrajectoryWriteError(RuntimeError):
    """A step file could not be written, or did not read back as written."""


class TrajectoryWriter(Callback):
    def __init__(self, directory: str | Path, run_id: str, latents: bool, images: bool = True, depth: int = 2):
        self.directory = Path(directory)
        self.run_id, self.latents, self.images = run_id, latents, images
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._written: list[tuple[Path, int, int]] = []  # (path, step, rows) not yet verified
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._checked_earlier = False

    def verify_earlier_files(self) -> None:
        """Read every step file already in the folder (an earlier attempt's) whole, page checksums
        included: a damaged one stops the run at its first step (``CorruptParquetFile``, one line), before
        it could be registered or uploaded with the run's trajectories."""
        from .store import list_step_files, read_parquet

        self._checked_earlier = True
        for path in list_step_files(self.directory):
            read_parquet(path)

    # -- loop callbacks --------------------------------------------------------------------------
    def on_step(self, loop, step, batch, metrics) -> None:
        self._raise_error()
        if not self._checked_earlier:
            self.verify_earlier_files()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="trajectory-writer", daemon=True)
            self._thread.start()
        self._queue.put((step, batch))

    def on_checkpoint(self, loop, path) -> None:
        self.flush()

    def on_end(self, loop) -> None:
        self.close()

    # -- flushing ----------------------------------------------------------------------------------
    def flush(self) -> list[Path]:
        """Wait until every queued step is written; verify the files written since the last flush
        (returned). Raises ``TrajectoryWriteError`` on a failed write or a file that reads back wrong."""
        if self._thread is not None:
            self._queue.join()
        self._raise_error()
        with self._lock:
            written, self._written = self._written, []
        for path, step, rows in written:
            verify_step_file(path, step, rows)
        return [p for p, _, _ in written]

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._thread is not None:
                self._queue.put(_STOP)
                self._thread.join()
                self._thread = None

    def _raise_error(self) -> None:
        if self._error is not None:
            raise TrajectoryWriteError(
                f"writing trajectories to {self.directory} failed: {self._error}"
            ) from self._error

    def _work(self) -> None:
        from .store import write_step

        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                step, batch = item
                if self._error is None:  # after a failure, later steps are not written
                    path = write_step(self.directory, batch, run_id=self.run_id, step=step, images=self.images,
                                      latents=self.latents)
                    with self._lock:
                        self._written.append((path, step, batch.batch_size))
            except BaseException as exc:  # surfaced on the training thread at the next call
                self._error = exc
            finally:
                self._queue.task_done()


def verify_step_file(path: Path, step: int, rows: int) -> None:
    """``path`` reads back as the step file of ``step`` with ``rows`` samples (its Parquet footer,
    the schema version and the step column's statistics)."""
    import pyarrow.parquet as pq

    from .store import SCHEMA_VERSION

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:
        raise TrajectoryWriteError(f"{path}: does not read back as Parquet ({exc})") from exc
    arrow_schema = meta.schema.to_arrow_schema()
    version = int((arrow_schema.metadata or {}).get(b"diffusionrl.schema_version", b"0"))
    if meta.num_rows != rows or version != SCHEMA_VERSION:
        raise TrajectoryWriteError(f"{path}: {meta.num_rows} rows of schema {version}, expected {rows} of "
                                   f"{SCHEMA_VERSION} (step {step})")
    col = arrow_schema.get_field_index("step")
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(col).statistics if col >= 0 else None
        if stats is None or not stats.has_min_max or not stats.min == stats.max == step:
            raise TrajectoryWriteError(f"{path}: its step column does not say step {step}")
