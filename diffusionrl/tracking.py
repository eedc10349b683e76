"""MLflow lineage: where the store is, the run tree of one workflow execution, buffered metrics.

One workflow execution is one MLflow run (the *workflow run*); each stage (prepare, train,
evaluate) is a nested run under it, found again by its ``diffusionrl.stage`` tag when a Flyte
task is retried. Every run carries the lineage tags (Flyte execution, git sha, config digest,
base model and dataset digests), so a registered version leads back to what made it.

The store: ``tracking.uri`` if set, else ``$MLFLOW_TRACKING_URI``, else a SQLite store in
``./runs/mlflow`` (the registry needs a database backend; artifacts go next to it). Secrets never
reach MLflow: params are the config tree (which holds no token) and nothing here reads the
environment except the MLflow URI and Flyte's execution ids.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)

ENV_URI = "MLFLOW_TRACKING_URI"
LOCAL_STORE = Path("runs") / "mlflow"
STAGE_TAG = "diffusionrl.stage"
PARENT_TAG = "mlflow.parentRunId"
REPO_ROOT = Path(__file__).resolve().parents[1]
# Lineage tag names (also the keys `python -m diffusionrl.registry show` prints).
LINEAGE_KEYS = ("flyte_execution_id", "git_sha", "dataset_digest", "base_model", "base_model_digest", "config_digest")
T = TypeVar("T")


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be reached (raised before any training work starts)."""


@dataclass
class TrackingRun:
    """The workflow run, as it travels between Flyte tasks."""

    uri: str
    experiment_id: str
    run_id: str
    execution_id: str = "local"  # the Flyte execution (also the trajectories' run_id column)


# -- the store ------------------------------------------------------------------------------------


def local_store_uri(root: str | Path | None = None) -> str:
    folder = (Path(root) if root else LOCAL_STORE).resolve()
    return f"sqlite:///{folder / 'mlflow.db'}"


def resolve_uri(configured: str = "") -> str:
    """``tracking.uri`` > ``$MLFLOW_TRACKING_URI`` > the local SQLite store (absolute path)."""
    return configured or os.environ.get(ENV_URI) or local_store_uri()


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment's artifacts go: next to a local SQLite file; the server decides otherwise."""
    db = _sqlite_path(uri)
    if db is None:
        return None
    return (db.parent / "artifacts" / experiment).as_uri()


def configure_http(timeout_s: int = 30, retries: int = 2) -> None:
    """Short client-side HTTP retries: our own buffer/backoff decides what a failure costs."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(retries))


def preflight(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast, naming the URI, when the tracking store cannot be reached."""
    scheme = urlparse(uri).scheme
    try:
        if scheme in ("http", "https"):
            import requests

            resp = requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
            if resp.status_code != 200:
                raise TrackingUnavailable(f"GET /health answered HTTP {resp.status_code}")
        elif scheme == "sqlite":
            _sqlite_path(uri).parent.mkdir(parents=True, exist_ok=True)
            client(uri).search_experiments(max_results=1)
        else:
            client(uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any failure here means "cannot track"
        raise TrackingUnavailable(
            f"MLflow tracking store {uri} is unreachable ({type(exc).__name__}: {exc}). Start the server, fix "
            f"tracking.uri / ${ENV_URI}, or unset both to use the local store {local_store_uri()}"
        ) from exc


def client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(uri: str, name: str) -> str:
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name, artifact_location=artifact_location(uri, name))
    except Exception:  # noqa: BLE001 - created concurrently by another execution
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


# -- lineage ---------------------------------------------------------------------------------------


def git_sha() -> tuple[str, bool]:
    """(commit, dirty) of the code this process runs; ``$DIFFUSIONRL_GIT_SHA`` in built images."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
        return sha, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("DIFFUSIONRL_GIT_SHA", "unknown"), False


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


# -- the run tree --------------------------------------------------------------------------------


def start_workflow_run(cfg, execution: dict[str, str], extra_tags: dict[str, str] | None = None) -> TrackingRun:
    """Preflight, then the workflow run with lineage tags and the flattened config as params."""
    from mlflow.entities import Param

    uri = resolve_uri(cfg.tracking.uri)
    configure_http()
    preflight(uri)
    exp_id = ensure_experiment(uri, cfg.tracking.experiment)
    c = client(uri)
    name = execution.get("flyte_execution_id", "local")
    tags = {**lineage_tags(cfg, execution), **(extra_tags or {}), STAGE_TAG: "workflow"}
    run = c.create_run(exp_id, tags=tags, run_name=name)
    params = [Param(k, v[:6000]) for k, v in config_params(cfg).items()]
    for i in range(0, len(params), 100):
        c.log_batch(run.info.run_id, params=params[i : i + 100])
    log.info("MLflow run %s in %s (experiment %s)", run.info.run_id, uri, cfg.tracking.experiment)
    return TrackingRun(uri, exp_id, run.info.run_id, name)


def stage_run(run: TrackingRun, stage: str) -> str:
    """The nested run of ``stage`` (created once; a retried task finds and reuses it)."""
    c = client(run.uri)
    found = c.search_runs(
        [run.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{run.run_id}' and tags.`{STAGE_TAG}` = '{stage}'",
        max_results=1,
    )
    if found:
        c.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id
    parent = c.get_run(run.run_id)
    tags = {k: v for k, v in parent.data.tags.items() if not k.startswith("mlflow.") or k == "mlflow.source.git.commit"}
    tags.update({PARENT_TAG: run.run_id, STAGE_TAG: stage})
    return c.create_run(run.experiment_id, tags=tags, run_name=stage).info.run_id


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
    except Exception as exc:  # noqa: BLE001 - never mask the workflow's own error
        log.warning("could not mark the MLflow runs of %s as failed: %s", execution_id, exc)
        return 0


# -- datasets and artifacts ------------------------------------------------------------------------


def frame_digest(df: pd.DataFrame) -> str:
    blob = json.dumps(df.to_dict(orient="list"), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _artifact_source(uri: str):
    """An MLflow dataset source naming a run artifact (``mlflow-artifacts:/...`` has no built-in one)."""
    from mlflow.data.dataset_source import DatasetSource

    class RunArtifactSource(DatasetSource):
        def __init__(self, uri: str):
            self.uri = uri

        @staticmethod
        def _get_source_type() -> str:
            return "mlflow_artifact"

        def load(self, dst_path: str | None = None) -> str:
            from mlflow.artifacts import download_artifacts

            return download_artifacts(artifact_uri=self.uri, dst_path=dst_path)

        @staticmethod
        def _can_resolve(raw_source: Any) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source: Any) -> "RunArtifactSource":
            return cls(str(raw_source))

        def to_dict(self) -> dict[str, Any]:
            return {"uri": self.uri}

        @classmethod
        def from_dict(cls, source_dict: dict[Any, Any]) -> "RunArtifactSource":
            return cls(source_dict["uri"])

    return RunArtifactSource(uri)


def log_prompt_datasets(run: TrackingRun, stage_id: str, splits: dict[str, pd.DataFrame], source: str) -> dict[str, str]:
    """Each split as Parquet artifacts of the stage run and as an MLflow dataset (with its digest)
    on the stage run; returns split -> digest. Contexts: train -> training, test -> evaluation."""
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    c = client(run.uri)
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for split, df in splits.items():
            df.to_parquet(Path(tmp) / f"prompts-{split}.parquet", index=False)
        c.log_artifacts(stage_id, tmp, "data")
    artifact_uri = c.get_run(stage_id).info.artifact_uri
    inputs = []
    for split, df in splits.items():
        digest = frame_digest(df)
        digests[split] = digest
        ds = mlflow.data.from_pandas(df, source=_artifact_source(f"{artifact_uri}/data/prompts-{split}.parquet"),
                                     name=f"prompts-{split}", digest=digest)
        context = "training" if split == "train" else "evaluation"
        inputs.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context),
                                                                  InputTag("source_data", source)]))
    c.log_inputs(stage_id, datasets=inputs)
    return digests


def folder_size_mb(uri: str | Path) -> float:
    """Total size of a local folder or an object-store prefix (fsspec), without downloading it."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(str(uri))
    return fs.du(path, total=True) / 2**20


def log_folder_or_link(run: TrackingRun, run_id: str, uri: str, fetch: Callable[[], str], artifact_path: str,
                       max_mb: float) -> str:
    """Copy the folder at ``uri`` into the run's artifacts when it is small enough (``fetch()``
    gives a local copy), else record ``uri`` as a tag. Returns where it can be found."""
    size = folder_size_mb(uri)
    c = client(run.uri)
    if size <= max_mb:
        c.log_artifacts(run_id, fetch(), artifact_path)
        c.set_tag(run_id, f"artifact.{artifact_path}", f"artifacts/{artifact_path} ({size:.1f} MB)")
        return f"{c.get_run(run_id).info.artifact_uri}/{artifact_path}"
    c.set_tag(run_id, f"artifact.{artifact_path}", f"{uri} ({size:.1f} MB, over tracking.max_artifact_mb={max_mb})")
    return str(uri)


def image_row(images: np.ndarray, max_images: int = 8) -> np.ndarray:
    """uint8 ``[N, H, W, 3]`` -> the first ``max_images`` side by side."""
    return np.concatenate(list(images[:max_images]), axis=1)


# -- retries and the buffered metric logger ----------------------------------------------------------


def with_retries(fn: Callable[[], T], attempts: int, what: str, base_delay_s: float = 0.5) -> T:
    """Call ``fn`` up to ``attempts`` times with exponential backoff; re-raise the last error."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - transient store errors have many types
            if i == attempts - 1:
                raise
            delay = base_delay_s * 2**i
            log.warning("%s failed (%s: %s); retry %d/%d in %.1fs", what, type(exc).__name__, exc, i + 1,
                        attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


class MetricLogger:
    """Training-loop callback that streams per-step metrics (and sample images) to a run.

    Metrics are buffered and flushed with ``log_batch`` after every step; a failing store is
    retried with backoff, and what still fails stays buffered for the next flush, so an MLflow
    outage never stops or loses the training (``metrics.jsonl`` in the run folder has every step
    regardless). Steps already in the run (a resumed attempt) are not logged twice.
    """

    def __init__(self, uri: str, run_id: str, images_every: int = 0, attempts: int = 5, base_delay_s: float = 0.5):
        self.uri = uri
        self.run_id = run_id
        self.images_every = images_every
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self.buffer: list[Any] = []
        self.failed_flushes = 0
        self.logged_upto = self._logged_upto()

    def _logged_upto(self) -> int:
        try:
            history = client(self.uri).get_metric_history(self.run_id, "perf/step_time")
            return max((m.step for m in history), default=0)
        except Exception:  # noqa: BLE001 - unknown is "nothing logged yet"
            return 0

    def on_step(self, loop, step: int, traj, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_upto:
            return
        now = int(time.time() * 1000)
        self.buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()
                        if isinstance(v, (int, float)) and math.isfinite(float(v))]
        self.flush()
        images = getattr(traj, "images", None)  # image trajectories have them, text traces do not
        if self.images_every and step % self.images_every == 0 and images is not None:
            row = image_row(images)
            try:
                with_retries(lambda: client(self.uri).log_image(self.run_id, row, key="rollout/samples", step=step),
                             self.attempts, f"log_image step {step}", self.base_delay_s)
            except Exception as exc:  # noqa: BLE001 - an image is not worth a training run
                log.warning("sample images of step %d not logged: %s (they are in the run folder)", step, exc)

    def flush(self) -> bool:
        c = client(self.uri)
        while self.buffer:
            chunk = self.buffer[:1000]
            try:
                with_retries(lambda: c.log_batch(self.run_id, metrics=chunk), self.attempts, "MLflow log_batch",
                             self.base_delay_s)
            except Exception as exc:  # noqa: BLE001 - keep the metrics, try again next step
                self.failed_flushes += 1
                log.warning("MLflow unreachable (%s); %d metrics kept for the next flush", exc, len(self.buffer))
                return False
            del self.buffer[: len(chunk)]
        return True

    def on_end(self, loop) -> None:
        if not self.flush():
            log.error("%d metrics could not reach MLflow run %s; they are in %s", len(self.buffer), self.run_id,
                      Path(loop.out_dir) / "metrics.jsonl")


def run_url(run: TrackingRun, run_id: str | None = None) -> str:
    """A link to the run: the UI page on a server, the ``mlflow ui`` command for a local store."""
    rid = run_id or run.run_id
    if urlparse(run.uri).scheme in ("http", "https"):
        return f"{run.uri.rstrip('/')}/#/experiments/{run.experiment_id}/runs/{rid}"
    return f"run {rid} in {run.uri} (open with: mlflow ui --backend-store-uri {run.uri})"
