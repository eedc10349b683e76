"""``MetricLogger``: the training loop's per-step metrics (and sample images) streamed to a run."""

from __future__ import annotations

import functools
import logging
import math
import time
from pathlib import Path
from typing import Any

from diffusionrl.run import Callback

from .artifacts import image_row
from .heartbeat import Heartbeat
from .runs import PARENT_TAG, log_picture
from .store import client, with_retries

log = logging.getLogger(__name__)


class MetricLogger(Callback):
    """Training-loop callback that streams per-step metrics (and sample images) to a run.

    Metrics are buffered and flushed with ``log_batch`` after a step once ``flush_every_s`` seconds
    have passed since the last flush (0: after every step), at every checkpoint and at the end; a failing store is
    retried with backoff, and what still fails stays buffered for the next flush, so an MLflow
    outage never stops or loses the training (``metrics.jsonl`` in the run folder has every step
    regardless). Steps already in the run (a resumed attempt) are not logged twice. After a
    successful flush the run and its workflow run get a heartbeat, at most every
    ``heartbeat_every`` seconds (default ``$DIFFUSIONRL_HEARTBEAT_S``; ``tracking.heartbeat``).
    """

    def __init__(self, uri: str, run_id: str, images_every: int = 0, attempts: int = 5, base_delay_s: float = 0.5,
                 heartbeat_every: float | None = None, flush_every_s: float = 0.0):
        self.uri = uri
        self.flush_every_s = flush_every_s
        self.last_flush = time.monotonic()
        self.run_id = run_id
        self.images_every = images_every
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self.buffer: list[Any] = []
        self.failed_flushes = 0
        self.logged_upto, parent = self._lookup()
        self.heartbeat = Heartbeat(uri, [run_id, parent], heartbeat_every)

    def _lookup(self) -> tuple[int, str]:
        """(the last step already logged, the workflow run); unknown is (0, ""): nothing logged yet,
        heartbeats for this run only. One call to a store that is down, not two."""
        c = client(self.uri)
        try:
            parent = c.get_run(self.run_id).data.tags.get(PARENT_TAG, "")
        except Exception:
            return 0, ""
        try:
            return max((m.step for m in c.get_metric_history(self.run_id, "perf/step_time")), default=0), parent
        except Exception:
            return 0, parent

    def on_step(self, loop, step: int, traj, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_upto:
            return
        now = int(time.time() * 1000)
        self.buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()
                        if isinstance(v, (int, float)) and math.isfinite(float(v))]
        if time.monotonic() - self.last_flush >= self.flush_every_s:
            self._flush_and_beat()
        images = getattr(traj, "images", None)  # image trajectories have them, text traces do not
        if self.images_every and step % self.images_every == 0 and images is not None:
            row = image_row(images)
            if row.ndim == 4:  # videos: an animated GIF per step (MLflow's step images are single images)
                def send():
                    log_picture(self.uri, self.run_id, row, f"rollout/samples/step-{step:06d}.gif")
            else:
                def send():
                    client(self.uri).log_image(self.run_id, row, key="rollout/samples", step=step)
            try:
                with_retries(send, self.attempts, f"log_image step {step}", self.base_delay_s)
            except Exception as exc:  # an image is not worth a training run
                log.warning("sample images of step %d not logged: %s (they are in the run folder)", step, exc)

    def _flush_and_beat(self) -> None:
        self.last_flush = time.monotonic()
        if self.flush():  # the store answers: say this execution is alive
            self.heartbeat()

    def on_checkpoint(self, loop, path) -> None:
        self._flush_and_beat()

    def flush(self) -> bool:
        c = client(self.uri)
        while self.buffer:
            chunk = self.buffer[:1000]
            try:
                with_retries(functools.partial(c.log_batch, self.run_id, metrics=chunk), self.attempts,
                             "MLflow log_batch", self.base_delay_s)
            except Exception as exc:  # keep the metrics, try again next step
                self.failed_flushes += 1
                log.warning("MLflow unreachable (%s); %d metrics kept for the next flush", exc, len(self.buffer))
                return False
            del self.buffer[: len(chunk)]
        return True

    def on_end(self, loop) -> None:
        if not self.flush():
            log.error("%d metrics could not reach MLflow run %s; they are in %s", len(self.buffer), self.run_id,
                      Path(loop.out_dir) / "metrics.jsonl")


def log_metrics_file(run, stage_id: str, path: Path, attempts: int) -> None:
    """Every numeric column of a ``metrics.jsonl`` (one JSON object per step, ``step`` key) as
    metrics of ``stage_id``, in batches of 1000."""
    import json

    from mlflow.entities import Metric

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    metrics = [Metric(k, float(v), 0, int(r.get("step", i + 1)))
               for i, r in enumerate(rows) for k, v in r.items() if k != "step" and isinstance(v, (int, float))]
    c = client(run.uri)
    for i in range(0, len(metrics), 1000):
        with_retries(lambda chunk=metrics[i:i + 1000]: c.log_batch(stage_id, metrics=chunk), attempts,
                     "MLflow log_batch")
