"""What the tasks of both workflows share: Flyte execution ids, failure handling, the train stage's
resume point and Flyte checkpoint callback, the registry record and the report publisher.

Nothing here is algorithm code; it translates between Flyte (context, checkpoints, retryable
errors, Decks) and the ``diffusionrl`` library.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from flytekit import Deck, current_context
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.types.error import FlyteError
from flytekit.types.file import FlyteFile

from diffusionrl import tracking
from diffusionrl.callbacks import Callback
from diffusionrl.tracking import TrackingRun

log = logging.getLogger(__name__)

# Test/ops hook: make a train task fail (retryably) after this many steps of an attempt.
FAULT_ENV = "DIFFUSIONRL_FAULT_AFTER_STEPS"

# Local executions all report the id "local": a process gets its own id instead, so that a failure
# handler finds its execution's runs (local executions of one process run one after another).
_LOCAL_EXECUTION_ID = f"local-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


# -- execution ids ------------------------------------------------------------------------------------


def flyte_execution_id() -> str:
    try:
        eid = current_context().execution_id
        return f"{eid.project}-{eid.domain}-{eid.name}"
    except Exception:  # noqa: BLE001 - outside an execution
        return "local"


def tracking_execution_id() -> str:
    eid = flyte_execution_id()
    return _LOCAL_EXECUTION_ID if eid.startswith("local") else eid


def execution_tags() -> dict[str, str]:
    """Flyte's ids for this execution, as lineage tags (see ``tracking_execution_id``)."""
    out = {"flyte_execution_id": tracking_execution_id(),
           "workflow_version": os.environ.get("FLYTE_INTERNAL_TASK_VERSION", "local")}
    try:
        eid = current_context().execution_id
        out.update({"flyte_project": eid.project, "flyte_domain": eid.domain})
    except Exception:  # noqa: BLE001 - outside an execution
        pass
    workflow = os.environ.get("FLYTE_INTERNAL_EXECUTION_WORKFLOW")
    if workflow:
        out["flyte_workflow"] = workflow
    return out


def close_failed_runs(tracking_cfg, err: FlyteError | None) -> None:
    """Body of the workflows' failure handlers: this execution's open MLflow runs -> FAILED."""
    message = err.message if err is not None else "workflow failed"
    n = tracking.fail_open_runs(tracking.resolve_uri(tracking_cfg.uri), tracking_cfg.experiment,
                                tracking_execution_id(), message)
    log.info("marked %d MLflow runs of %s as FAILED", n, tracking_execution_id())


def resolved_or_given(config, overrides: list[str]):
    """``config`` with ``overrides`` applied, or ``config`` itself when they are what failed."""
    from diffusionrl.config import apply_overrides

    try:
        return type(config).from_dict(apply_overrides(config.to_dict(), overrides))
    except Exception:  # noqa: BLE001 - the overrides themselves may be what failed
        return config


class DatasetDigests(NamedTuple):
    train: str
    test: str


# -- the train stage ----------------------------------------------------------------------------------


def stage_dir(checkpoint_dir: str, name: str = "") -> Path:
    """``checkpoint_dir/name`` (kept across runs) or a folder in the task's working directory."""
    root = Path(checkpoint_dir) if checkpoint_dir else Path(current_context().working_directory) / "train"
    out = root / name if name else root
    out.mkdir(parents=True, exist_ok=True)
    return out


def flyte_checkpoint():
    try:
        return current_context().checkpoint
    except (NotImplementedError, AttributeError):
        return None


def resume_point(run_dir: Path) -> Path | None:
    """Where a train attempt resumes: this execution's Flyte checkpoint (a retried attempt; saved
    again at once, since an attempt only sees the previous attempt's), else the latest checkpoint
    in ``run_dir/checkpoints`` (a folder kept across runs), else nothing (a fresh start)."""
    from diffusionrl.checkpoint import latest_checkpoint

    cp = flyte_checkpoint()
    restored = cp.restore() if cp is not None else None
    if restored is not None and (Path(restored) / "state.json").is_file():
        cp.save(Path(restored))
        resume = Path(restored)
    else:
        resume = latest_checkpoint(run_dir / "checkpoints")
    if resume is not None:
        log.info("resuming from %s", resume)
    return resume


class FlyteCheckpoints(Callback):
    """Every loop checkpoint also saved as the execution's Flyte checkpoint (what a retried attempt
    resumes from); ``$DIFFUSIONRL_FAULT_AFTER_STEPS=K`` fails the attempt retryably after K steps."""

    def __init__(self):
        self.cp = flyte_checkpoint()
        fault = os.environ.get(FAULT_ENV)
        self.fault_after = int(fault) if fault else None
        self.steps_this_attempt = 0

    def on_step(self, loop, step, batch, metrics) -> None:
        self.steps_this_attempt += 1

    def on_checkpoint(self, loop, path) -> None:
        if self.cp is not None:
            self.cp.save(path)
        if self.fault_after is not None and self.steps_this_attempt >= self.fault_after:
            raise FlyteRecoverableException(f"injected fault after {self.steps_this_attempt} steps ({FAULT_ENV})")


def open_train_stage(run: TrackingRun, run_dir: Path, attempts: int) -> str:
    """The ``train`` stage run, tagged with its run folder; an unreachable store is retryable."""
    try:
        return tracking.open_stage(run, "train", attempts, tags={"run_dir": str(run_dir)})
    except tracking.TrackingUnavailable as exc:
        raise FlyteRecoverableException(str(exc)) from exc


# -- register and report --------------------------------------------------------------------------------


@dataclass
class RegisteredVersion:
    name: str
    version: str
    aliases: list[str]
    promoted: bool
    decision: str
    score: float
    champion_version: str
    model_uri: str
    version_url: str
    run_url: str

    @classmethod
    def record(cls, run: TrackingRun, reg) -> RegisteredVersion:
        """A ``registry.Registration`` as a task output, also tagged on the workflow run."""
        tracking.set_tags(run, {"registered_model": reg.name, "registered_version": reg.version,
                                "registry_decision": reg.decision})
        return cls(reg.name, reg.version, reg.aliases, reg.promoted, reg.decision, reg.score, reg.champion_version,
                   reg.model_uri, reg.version_url, reg.run_url)

    def links(self) -> dict[str, str]:
        """The report's lines about the registry and the MLflow run."""
        return {"registered model": f"{self.name} v{self.version} ({', '.join(self.aliases)}): {self.decision} "
                                    f"-> {self.version_url}",
                "MLflow run": self.run_url}


def publish_report(run: TrackingRun, page: str, run_dir: str) -> FlyteFile:
    """The report as the task's Deck, a file output, a copy in the run folder (local runs) and an
    artifact of the MLflow run, which is then closed."""
    Deck("Report", page)
    out = Path(tempfile.mkdtemp(dir=current_context().working_directory)) / "report.html"
    out.write_text(page)
    if Path(run_dir).is_dir():
        (Path(run_dir) / "report.html").write_text(page)
    tracking.client(run.uri).log_artifact(run.run_id, str(out))
    tracking.finish(run)
    return FlyteFile(str(out))
