"""``MetricLogger``: the training loop's per-step metrics (and sample images) streamed to a run."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diffusionrl.run import Callback

from .artifacts import image_row
from .heartbeat import Heartbeat
from .runs import PARENT_TAG, log_picture
from .store import client, with_retries

log = logging.getLogger(__name__)


REQUEST_TIMEOUT_S = 10.0  # one MLflow request of the logger, at most (MLflow's own default: 120 s)
RETRY_AFTER_S = 30.0  # after a failed flush, the next try waits this long (doubled after each failure) ...
MAX_RETRY_AFTER_S = 300.0  # ... up to this


@contextlib.contextmanager
def bounded_requests(timeout_s: float) -> Iterator[None]:
    """Inside: MLflow's HTTP requests time out after ``timeout_s`` and are not retried by MLflow itself (its
    defaults: 7 retries with exponential backoff and a 120 s timeout, a minute or more per call to a store that is
    down); the caller retries, within its own budget. MLflow reads both variables at every request."""
    import os

    names = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(timeout_s)))}
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class MetricLogger(Callback):
    """Training-loop callback that streams per-step metrics (and sample images) to a run.

    Metrics are buffered and flushed with ``log_batch`` after a step once ``flush_every_s`` seconds
    have passed since the last flush (0: after every step), at every checkpoint and at the end. Each MLflow
    request is bounded (``bounded_requests``: ``request_timeout_s``, no retries of MLflow's own) and a failing
    call is retried ``attempts`` times with backoff; when a flush still fails the store counts as down: its
    metrics stay buffered, and no call is made (no step waits on it) until ``retry_after_s`` has passed, doubled
    after each failed try up to ``max_retry_after_s``, when one single-attempt try probes it. So an MLflow outage
    never stops the training, nor slows its steps, nor loses metrics (``metrics.jsonl`` in the run folder has
    every step regardless); once the store answers, the buffer is sent. Steps already in the run (a resumed
    attempt) are not logged twice, and the steps a resumed run has in its ``metrics.jsonl`` (``loop.history``)
    but the store has not (the previous attempt ended during an outage) are replayed into it. A store that is
    down when the logger starts is asked again what it holds once it answers. After a successful flush the run
    and its workflow run get a heartbeat, at most every ``heartbeat_every`` seconds (default
    ``$DIFFUSIONRL_HEARTBEAT_S``; ``tracking.heartbeat``).
    """

    def __init__(self, uri: str, run_id: str, images_every: int = 0, attempts: int = 5, base_delay_s: float = 0.5,
                 heartbeat_every: float | None = None, flush_every_s: float = 0.0,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, retry_after_s: float = RETRY_AFTER_S,
                 max_retry_after_s: float = MAX_RETRY_AFTER_S):
        self.uri = uri
        self.flush_every_s = flush_every_s
        self.last_flush = time.monotonic()
        self.run_id = run_id
        self.images_every = images_every
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self.buffer: list[Any] = []
        self.failed_flushes = 0
        self.down_until: float | None = None  # while the store is down: when to try it again (monotonic)
        self.wait_s = retry_after_s  # the wait after the next failed try
        self.replayed = False  # the steps a resumed run had but the store had not were buffered
        self.loop = None  # the loop last seen (its history: what a replay sends)
        self.parent = ""
        self.logged_upto: int | None = None  # the last step the store has; None: not known yet (it was down)
        self.heartbeat_every = heartbeat_every
        self.heartbeat = Heartbeat(uri, [run_id], heartbeat_every)
        self._lookup()

    def _lookup(self) -> bool:
        """Ask the store the last step it holds (``logged_upto``) and the workflow run (heartbeats go to both);
        False when it does not answer (asked again at the next flush). One bounded call to a store that is down."""
        c = client(self.uri)
        try:
            with bounded_requests(self.request_timeout_s):
                parent = c.get_run(self.run_id).data.tags.get(PARENT_TAG, "")
                try:
                    history = c.get_metric_history(self.run_id, "perf/step_time")
                except Exception:
                    history = []
        except Exception as exc:
            self._failed(exc, "looking up the run")
            return False
        self.logged_upto = max((m.step for m in history), default=0)
        self.buffer = [m for m in self.buffer if m.step > self.logged_upto]  # buffered before it was known
        if parent and parent != self.parent:
            self.parent = parent
            self.heartbeat = Heartbeat(self.uri, [self.run_id, parent], self.heartbeat_every)
        return True

    def on_step(self, loop, step: int, traj, metrics: dict[str, float]) -> None:
        if self.logged_upto is not None and step <= self.logged_upto:
            return
        self.loop = loop
        self._replay(step)
        self.buffer += self._metrics(metrics, step)
        if time.monotonic() - self.last_flush >= self.flush_every_s:
            self._flush_and_beat()
        images = getattr(traj, "images", None)  # image trajectories have them, text traces do not
        if self.images_every and step % self.images_every == 0 and images is not None:
            if self.down():
                log.warning("sample images of step %d not logged: MLflow is down (they are in the run folder)", step)
                return
            row = image_row(images)
            if row.ndim == 4:  # videos: an animated GIF per step (MLflow's step images are single images)
                def send():
                    log_picture(self.uri, self.run_id, row, f"rollout/samples/step-{step:06d}.gif")
            else:
                def send():
                    client(self.uri).log_image(self.run_id, row, key="rollout/samples", step=step)
            try:
                with bounded_requests(self.request_timeout_s):
                    with_retries(send, self.attempts, f"log_image step {step}", self.base_delay_s)
            except Exception as exc:  # an image is not worth a training run
                log.warning("sample images of step %d not logged: %s (they are in the run folder)", step, exc)

    @staticmethod
    def _metrics(row: dict[str, float], step: int, now: int | None = None) -> list:
        from mlflow.entities import Metric

        now = int(time.time() * 1000) if now is None else now
        return [Metric(k, float(v), now, step) for k, v in row.items()
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(float(v))]

    def _replay(self, step: int) -> None:
        """Once the store's last step is known: the loop's rows (``metrics.jsonl``, read back by a resumed run)
        of the steps after it and before ``step``, buffered ahead of the live ones."""
        if self.replayed or self.logged_upto is None or self.loop is None:
            return
        self.replayed = True
        rows = [r for r in getattr(self.loop, "history", []) if self.logged_upto < int(r.get("step", 0)) < step]
        if rows:
            log.info("replaying %d steps of %s into MLflow run %s (steps %d-%d: not logged by the attempt before)",
                     len(rows), Path(self.loop.out_dir) / "metrics.jsonl", self.run_id, int(rows[0]["step"]),
                     int(rows[-1]["step"]))
            replay = [m for r in rows for m in self._metrics(r, int(r["step"]))]
            self.buffer = replay + self.buffer

    def down(self) -> bool:
        """The store failed the last try and its next one is not due yet."""
        return self.down_until is not None and time.monotonic() < self.down_until

    def _failed(self, exc: Exception, what: str) -> None:
        self.failed_flushes += 1
        self.down_until = time.monotonic() + self.wait_s
        log.warning("MLflow %s unreachable while %s (%s: %s); %d metrics kept, next try in %.0f s (training goes "
                    "on)",
                    self.uri, what, type(exc).__name__, exc, len(self.buffer), self.wait_s)
        self.wait_s = min(2 * self.wait_s, self.max_retry_after_s)

    def _flush_and_beat(self) -> None:
        self.last_flush = time.monotonic()
        if self.flush():  # the store answers: say this execution is alive
            with bounded_requests(self.request_timeout_s):
                self.heartbeat()

    def on_checkpoint(self, loop, path) -> None:
        self._flush_and_beat()

    def flush(self, force: bool = False) -> bool:
        """Send the buffer; False when the store is down (nothing is tried before ``down_until`` unless
        ``force``; a try after a failure is a single attempt)."""
        if self.down() and not force:
            return False
        was_down = self.down_until is not None
        if self.logged_upto is None:
            if not self._lookup():
                return False
            self._replay(self._next_step())
        c = client(self.uri)
        sent = 0
        while self.buffer:
            chunk = self.buffer[:1000]
            try:
                with bounded_requests(self.request_timeout_s):
                    with_retries(functools.partial(c.log_batch, self.run_id, metrics=chunk),
                                 1 if was_down else self.attempts, "MLflow log_batch", self.base_delay_s)
            except Exception as exc:  # keep the metrics, try again later
                self._failed(exc, "logging metrics")
                return False
            del self.buffer[: len(chunk)]
            sent += len(chunk)
        if was_down:
            log.info("MLflow %s answers again: %d buffered metrics sent", self.uri, sent)
        self.down_until, self.wait_s = None, self.retry_after_s
        return True

    def _next_step(self) -> int:
        """The step after the last one buffered (what a replay stops before)."""
        steps = [m.step for m in self.buffer]
        return min(steps) if steps else (self.loop.step + 1 if self.loop is not None else 0)

    def on_end(self, loop) -> None:
        if not self.flush(force=True):
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
