"""The run tree of one workflow execution and its lineage.

One workflow execution is one MLflow run (the *workflow run*); each stage (prepare, train,
evaluate) is a nested run under it, found again by its ``diffusionrl.stage`` tag when a Flyte
task is retried. Every run carries the lineage tags (Flyte execution, git sha, config digest,
base model and dataset digests), so a registered version leads back to what made it. Secrets never
reach MLflow: params are the config tree (which holds no token) and nothing here reads the
environment except Flyte's execution ids.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from .heartbeat import HEARTBEAT_TAG, STAGE_TAG, beat, fail_stale_runs, stamp
from .store import client, configure_http, ensure_experiment, preflight, resolve_uri, with_retries

log = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Lineage tag names (also the keys `python -m diffusionrl.serving show` prints).
LINEAGE_KEYS = ("flyte_execution_id", "git_sha", "dataset_digest", "base_model", "base_model_digest", "config_digest")


@dataclass
class TrackingRun:
    """The workflow run, as it travels between Flyte tasks."""

    uri: str
    experiment_id: str
    run_id: str
    execution_id: str = "local"  # the Flyte execution (also the trajectories' run_id column)


def git_sha() -> tuple[str, bool]:
    """(commit, dirty) of the code this process runs. Where the code is no repository (a pod runs the
    fast-registration tarball), ``$DIFFUSIONRL_GIT_SHA`` / ``$DIFFUSIONRL_GIT_DIRTY``, which
    registration puts into every task's environment (``tasks/resources.py``)."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
        return sha, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("DIFFUSIONRL_GIT_SHA", "unknown"), os.environ.get("DIFFUSIONRL_GIT_DIRTY") == "true"


def lineage_tags(cfg, execution: dict[str, str]) -> dict[str, str]:
    """Tags every run of an execution carries (dataset and weight digests are added once known).

    ``cfg`` is an image ``Config`` or a ``BDLMConfig``: anything with ``digest()``, ``preset``,
    ``model.name`` and ``tracking``; an ``algorithm.name`` and ``model.revision`` if it has them."""
    sha, dirty = git_sha()
    algorithm = getattr(getattr(cfg, "algorithm", None), "name", "")
    return {
        **execution,
        "git_sha": sha,
        "git_dirty": str(dirty).lower(),
        "mlflow.source.git.commit": sha,
        "config_digest": cfg.digest(),
        "preset": cfg.preset,
        "algorithm": algorithm,
        "base_model": cfg.model.name,
        "base_model_revision": getattr(cfg.model, "revision", "") or "default",
        "registered_model": cfg.tracking.registered_model,
    }


def config_params(cfg) -> dict[str, str]:
    return {k: json.dumps(v) if isinstance(v, (list, dict)) else str(v) for k, v in cfg.flat().items()}


def start_workflow_run(cfg, execution: dict[str, str], extra_tags: dict[str, str] | None = None) -> TrackingRun:
    """Preflight, then the workflow run with lineage tags, a heartbeat and the flattened config as
    params; then runs of killed executions still ``RUNNING`` in the experiment are closed as
    ``FAILED`` (``heartbeat.fail_stale_runs``)."""
    from mlflow.entities import Param

    uri = resolve_uri(cfg.tracking.uri)
    configure_http()
    preflight(uri)
    exp_id = ensure_experiment(uri, cfg.tracking.experiment)
    c = client(uri)
    name = execution.get("flyte_execution_id", "local")
    tags = {**lineage_tags(cfg, execution), **(extra_tags or {}), STAGE_TAG: "workflow", HEARTBEAT_TAG: stamp()}
    run = c.create_run(exp_id, tags=tags, run_name=name)
    params = [Param(k, v[:6000]) for k, v in config_params(cfg).items()]
    for i in range(0, len(params), 100):
        c.log_batch(run.info.run_id, params=params[i : i + 100])
    log.info("MLflow run %s in %s (experiment %s)", run.info.run_id, uri, cfg.tracking.experiment)
    try:
        fail_stale_runs(uri, exp_id, name)
    except Exception as exc:  # housekeeping of other executions must not stop this one
        log.warning("could not look for MLflow runs of killed executions in %s: %s", uri, exc)
    return TrackingRun(uri, exp_id, run.info.run_id, name)


def stage_run(run: TrackingRun, stage: str) -> str:
    """The nested run of ``stage`` (created once; a retried task finds and reuses it); the stage
    and the workflow run get a heartbeat."""
    c = client(run.uri)
    found = c.search_runs(
        [run.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{run.run_id}' and tags.`{STAGE_TAG}` = '{stage}'",
        max_results=1,
    )
    if found:
        stage_id = found[0].info.run_id
        c.update_run(stage_id, status="RUNNING")
    else:
        parent = c.get_run(run.run_id)
        tags = {k: v for k, v in parent.data.tags.items()
                if not k.startswith("mlflow.") or k == "mlflow.source.git.commit"}
        tags.update({PARENT_TAG: run.run_id, STAGE_TAG: stage, HEARTBEAT_TAG: stamp()})
        stage_id = c.create_run(run.experiment_id, tags=tags, run_name=stage).info.run_id
    try:
        beat(run.uri, [run.run_id, stage_id])
    except Exception as exc:  # the stage itself is what matters here
        log.warning("MLflow heartbeat of the %s stage not sent: %s", stage, exc)
    return stage_id


def set_tags(run: TrackingRun, tags: dict[str, str], also: list[str] = ()) -> None:
    """Tag the workflow run (and the given stage runs)."""
    c = client(run.uri)
    for run_id in [run.run_id, *also]:
        for k, v in tags.items():
            c.set_tag(run_id, k, v)


def finish(run: TrackingRun, run_id: str | None = None, status: str = "FINISHED") -> None:
    client(run.uri).set_terminated(run_id or run.run_id, status=status)


def fail_open_runs(uri: str, experiment: str, execution_id: str, message: str) -> int:
    """Mark the runs of a failed execution that are still RUNNING (the workflow run and its
    stage runs) as FAILED, with the error as a tag. Best effort: returns how many were closed,
    0 when the store cannot be reached (this runs while an error is already being raised)."""
    try:
        preflight(uri, timeout_s=5)
        c = client(uri)
        exp = c.get_experiment_by_name(experiment)
        if exp is None:
            return 0
        runs = c.search_runs([exp.experiment_id], filter_string=f"tags.flyte_execution_id = '{execution_id}' "
                             "and attributes.status = 'RUNNING'")
        for r in runs:
            c.set_tag(r.info.run_id, "failure", message[:5000])
            c.set_terminated(r.info.run_id, status="FAILED")
        return len(runs)
    except Exception as exc:  # never mask the workflow's own error
        log.warning("could not mark the MLflow runs of %s as failed: %s", execution_id, exc)
        return 0


def run_url(run: TrackingRun, run_id: str | None = None) -> str:
    """A link to the run: the UI page on a server, the ``mlflow ui`` command for a local store."""
    rid = run_id or run.run_id
    if urlparse(run.uri).scheme in ("http", "https"):
        return f"{run.uri.rstrip('/')}/#/experiments/{run.experiment_id}/runs/{rid}"
    return f"run {rid} in {run.uri} (open with: mlflow ui --backend-store-uri {run.uri})"


# -- stage helpers the tasks share ---------------------------------------------------------------


def open_stage(run: TrackingRun, stage: str, attempts: int, tags: dict[str, str] | None = None) -> str:
    """The nested run of ``stage`` (with ``tags``), retried; a store still down raises
    ``TrackingUnavailable`` (a task turns it into a retryable failure: nothing is lost, the retried
    attempt resumes from the last checkpoint)."""
    from .store import TrackingUnavailable

    configure_http()

    def open_run() -> str:
        stage_id = stage_run(run, stage)
        c = client(run.uri)
        for key, value in (tags or {}).items():
            c.set_tag(stage_id, key, value)
        return stage_id

    try:
        return with_retries(open_run, attempts, f"opening the MLflow {stage} run")
    except Exception as exc:  # any failure here means "cannot track yet"
        raise TrackingUnavailable(f"MLflow store {run.uri} unreachable before the {stage} stage: {exc}") from exc


def finish_quietly(run: TrackingRun, stage_id: str) -> None:
    """Close a stage run; a tracking outage at this point must not fail a finished stage."""
    try:
        with_retries(lambda: finish(run, stage_id), 3, "closing the MLflow stage run")
    except Exception as exc:
        log.warning("could not close MLflow run %s: %s", stage_id, exc)


def log_evaluation(run: TrackingRun, summary: dict[str, float], table, grid=None) -> None:
    """The ``evaluate`` stage run: the summary (also on the workflow run), the per-prompt table and
    the base-over-tuned image grid when there is one."""
    stage = stage_run(run, "evaluate")
    c = client(run.uri)
    log_values(c, [stage, run.run_id], summary)
    c.log_table(stage, table, "eval/table.json")
    if grid is not None:
        log_picture(run.uri, stage, grid, "eval/grid_base_top_tuned_bottom.png")  # video: a GIF
    finish(run, stage)


def lineage(run: TrackingRun, **known: str) -> dict[str, str]:
    """The workflow run's lineage tags (``LINEAGE_KEYS``) updated with what a stage knows."""
    tags = client(run.uri).get_run(run.run_id).data.tags
    return {**{k: tags.get(k, "") for k in LINEAGE_KEYS}, **known}


def log_final_metrics(
    run: TrackingRun, metrics, keys=("rollout/reward/raw_mean", "train/loss", "perf/step_time")
) -> None:
    """The last training step's headline metrics as ``final/<key>`` on the workflow run."""
    import pandas as pd

    if not len(metrics):
        return
    last = metrics.iloc[-1]
    log_values(client(run.uri), [run.run_id],
               {f"final/{key}": last[key] for key in keys if key in last and pd.notna(last[key])})


def log_values(c, run_ids: list[str], values: dict[str, float]) -> None:
    """``values`` as metrics at step 0 of each run in ``run_ids``: one ``log_batch`` per run."""
    from mlflow.entities import Metric

    if not values:
        return
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(value), now, 0) for key, value in values.items()]
    for run_id in run_ids:
        c.log_batch(run_id, metrics=metrics)


def log_picture(uri: str, run_id: str, picture, artifact_file: str) -> None:
    """An image as ``artifact_file`` (PNG, ``log_image``), or frames ``[F, H, W, 3]`` as an animated
    GIF next to it (``artifact_file`` with suffix ``.gif``, ``log_artifact``) -- MLflow's image
    logging takes single images only."""
    from pathlib import PurePosixPath

    from diffusionrl.video import is_animated, save_picture

    if not is_animated(picture):
        client(uri).log_image(run_id, picture, artifact_file=artifact_file)
        return
    path = PurePosixPath(artifact_file)
    with tempfile.TemporaryDirectory() as tmp:
        local = save_picture(picture, f"{tmp}/{path.name}")
        client(uri).log_artifact(run_id, str(local), str(path.parent) if str(path.parent) != "." else None)
