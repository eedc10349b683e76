"""Heartbeats, so that the MLflow runs of a killed execution do not stay ``RUNNING`` forever.

A live execution keeps a ``heartbeat`` tag (unix seconds) on its runs fresh: the workflow run when
it is created, the workflow and stage runs whenever a stage opens (``runs.stage_run``) and, while
training, at most every ``$DIFFUSIONRL_HEARTBEAT_S`` seconds (default 60) from ``MetricLogger``. A
killed pod (OOM, node loss, ``kubectl delete``) runs no failure handler, so nothing closes its runs;
the next execution's ``start_workflow_run`` does (``fail_stale_runs``): every ``RUNNING`` run of
this code (``diffusionrl.stage`` tag) of another execution whose execution has shown no sign of
life for ``$DIFFUSIONRL_HEARTBEAT_TTL_S`` seconds (default 1800; its newest heartbeat, or its start
time for runs without one) becomes ``FAILED`` with a ``failure`` tag ``no heartbeat since ...``.

The TTL must exceed the longest quiet stretch of a live execution (a pod waiting for a GPU node, a
stage without training steps). Should a live execution still be taken for dead, its next heartbeat
sets its runs back to ``RUNNING`` (tag ``revived``): a false alarm heals, a dead run stays failed.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import UTC, datetime

from .store import client

log = logging.getLogger(__name__)

HEARTBEAT_TAG = "heartbeat"
FAILURE_TAG = "failure"
EVERY_ENV = "DIFFUSIONRL_HEARTBEAT_S"
TTL_ENV = "DIFFUSIONRL_HEARTBEAT_TTL_S"
DEFAULT_EVERY_S = 60.0
DEFAULT_TTL_S = 1800.0
STALE = "no heartbeat since"
STAGE_TAG = "diffusionrl.stage"  # the tag of every run this code makes (runs.STAGE_TAG)
EXECUTION_TAG = "flyte_execution_id"


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${env}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"${env}={raw!r} must be >= 0 seconds")
    return value


def every_s() -> float:
    return _seconds(EVERY_ENV, DEFAULT_EVERY_S)


def ttl_s() -> float:
    return _seconds(TTL_ENV, DEFAULT_TTL_S)


def stamp(now: float | None = None) -> str:
    return str(int(time.time() if now is None else now))


def utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def beat(uri: str, run_ids, now: float | None = None) -> None:
    """Set the heartbeat of ``run_ids`` to now; a run that was marked failed for a missing heartbeat
    while it was alive is set back to ``RUNNING``. Store errors propagate (see ``Heartbeat``)."""
    c = client(uri)
    value = stamp(now)
    for run_id in run_ids:
        run = c.get_run(run_id)
        c.set_tag(run_id, HEARTBEAT_TAG, value)
        failure = run.data.tags.get(FAILURE_TAG, "")
        if failure.startswith(STALE) and run.info.status in ("FAILED", "RUNNING"):  # RUNNING: a reopened stage
            if run.info.status == "FAILED":
                c.update_run(run_id, status="RUNNING")
            c.set_tag(run_id, "revived", f"{utc(int(value))}: alive after being marked '{failure[:300]}'")
            c.delete_tag(run_id, FAILURE_TAG)
            log.warning("MLflow run %s was marked failed (%s) but is alive: set back to RUNNING", run_id, failure)


class Heartbeat:
    """``beat`` at most every ``every`` seconds (default ``$DIFFUSIONRL_HEARTBEAT_S``); never raises."""

    def __init__(self, uri: str, run_ids, every: float | None = None):
        self.uri = uri
        self.run_ids = [r for r in run_ids if r]
        self.every = every_s() if every is None else every
        self.last = float("-inf")

    def __call__(self, force: bool = False) -> bool:
        """True when a heartbeat was sent now."""
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return False
        try:
            beat(self.uri, self.run_ids)
        except Exception as exc:  # a heartbeat is not worth a training run; the next one may get through
            log.warning("MLflow heartbeat of %s not sent: %s", self.run_ids, exc)
            return False
        self.last = now
        return True


def _last_sign_of_life(run) -> float:
    """Unix seconds: the run's heartbeat, else its start."""
    value = run.data.tags.get(HEARTBEAT_TAG, "")
    try:
        return float(value)
    except ValueError:
        return run.info.start_time / 1000.0


def fail_stale_runs(uri: str, experiment_id: str, execution_id: str, ttl: float | None = None,
                    now: float | None = None) -> list[str]:
    """Mark ``RUNNING`` runs of other executions in ``experiment_id`` that show no sign of life for
    ``ttl`` seconds as ``FAILED`` with a ``failure`` tag; returns their run ids.

    Runs are judged by execution (``flyte_execution_id``, else alone): an execution is alive while
    any of its running runs has a fresh heartbeat (or, without one, a recent start). Only runs this
    code made (``diffusionrl.stage`` tag) are touched."""
    ttl = ttl_s() if ttl is None else ttl
    now = time.time() if now is None else now
    c = client(uri)
    running, token = [], None
    while True:
        page = c.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000,
                             page_token=token)
        running += [r for r in page if STAGE_TAG in r.data.tags]
        token = page.token
        if not token:
            break
    executions: dict[str, list] = {}
    for r in running:
        executions.setdefault(r.data.tags.get(EXECUTION_TAG) or f"run {r.info.run_id}", []).append(r)
    failed = []
    for execution, runs in executions.items():
        if execution == execution_id:
            continue
        last = max(_last_sign_of_life(r) for r in runs)
        if now - last <= ttl:
            continue
        message = (f"{STALE} {utc(last)} ({(now - last) / 60:.0f} min, more than the {ttl:g} s of ${TTL_ENV}): "
                   f"the execution was killed or lost; marked FAILED by execution {execution_id}")
        for r in runs:
            c.set_tag(r.info.run_id, FAILURE_TAG, message)
            c.set_terminated(r.info.run_id, status="FAILED")
            failed.append(r.info.run_id)
        log.warning("MLflow runs of %s: %s", execution, message)
    return failed
