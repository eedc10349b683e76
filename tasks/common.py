"""What the tasks of both workflows share: Flyte execution ids, failure handling, the train stage's
resume point and Flyte checkpoint callback, the registry record and the report publisher.

Nothing here is algorithm code; it translates between Flyte (context, checkpoints, retryable
errors, Decks) and the ``diffusionrl`` library.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from flytekit import Deck, current_context
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.types.error import FlyteError
from flytekit.types.file import FlyteFile

from diffusionrl import tracking
from diffusionrl.errors import UserError, filesystem_error
from diffusionrl.run import Callback
from diffusionrl.serving import Registration
from diffusionrl.tracking import TrackingRun

log = logging.getLogger(__name__)

# Test/ops hook: make a train task fail (retryably) after this many steps of an attempt.
FAULT_ENV = "DIFFUSIONRL_FAULT_AFTER_STEPS"
RUN_POINTER = "run.json"  # the Flyte intra-task checkpoint: {"run_uri": ..., "step": ...}

# Local executions all report the id "local": a process gets its own id instead, so that a failure
# handler finds its execution's runs (local executions of one process run one after another).
_LOCAL_EXECUTION_ID = f"local-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


# -- user errors -----------------------------------------------------------------------------------


def user_errors(fn):
    """Under ``@task``: a ``diffusionrl.errors.UserError`` (a config or prompt-data mistake, whose
    one-line message names the key, file or line) leaves the task without the library frames below
    it. Flyte shows the message; ``pyflyte run`` prints every task error as a traceback box (flytekit
    1.16 prints one for any exception that is not click's), here the task's own frame, then
    ``<Type>: Error encountered while executing '<task>':`` and the message line. The file system refusing
    a file (no permission, read-only, full: ``errors.filesystem_error``) is such an error too, naming the path.
    Other exceptions keep their traceback."""

    @functools.wraps(fn)
    def task_body(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            raise exc.with_traceback(None) from None
        except Exception as exc:
            err = filesystem_error(exc)
            if err is None:
                raise
            raise err from None

    return task_body


# -- execution ids ------------------------------------------------------------------------------------


def flyte_execution_id() -> str:
    try:
        eid = current_context().execution_id
        return f"{eid.project}-{eid.domain}-{eid.name}"
    except Exception:  # outside an execution
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
    except Exception:  # outside an execution
        pass
    workflow = os.environ.get("FLYTE_INTERNAL_EXECUTION_WORKFLOW")
    if workflow:
        out["flyte_workflow"] = workflow
    return out


def on_cluster() -> bool:
    """True inside a task pod of a Flyte cluster (propeller sets the execution id variables)."""
    return bool(os.environ.get("FLYTE_INTERNAL_EXECUTION_ID")) and not flyte_execution_id().startswith("local")


def require_shared_store(uri: str) -> None:
    """On a cluster, tasks share no disk: a file-backed MLflow store would be a different, empty
    store in every pod. Fail in the first task, naming the URI and the fix."""
    if on_cluster() and (uri.startswith(("sqlite:", "file:")) or "://" not in uri):
        raise ValueError(
            f"MLflow store {uri} is a file inside this pod, and the tasks of a cluster execution share no disk: "
            "set tracking.uri in the config (or MLFLOW_TRACKING_URI when registering: make package "
            "MLFLOW_TRACKING_URI=http://mlflow.example:5000) to a tracking server every pod can reach"
        )


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
    except Exception:  # the overrides themselves may be what failed
        return config


class DatasetDigests(NamedTuple):
    train: str
    test: str


# -- the train stage ----------------------------------------------------------------------------------


def stage_dir(checkpoint_dir: str, name: str = "") -> str:
    """Where a stage keeps its run folder: ``checkpoint_dir[/name]`` (a local folder or an
    object-store URI, kept across executions), else a folder under this attempt's raw output prefix
    (an object-store prefix on a cluster, so it outlives the pod; a temporary folder locally)."""
    root = checkpoint_dir.rstrip("/") if checkpoint_dir else f"{current_context().raw_output_prefix.rstrip('/')}/run"
    return f"{root}/{name}" if name else root


def flyte_checkpoint():
    try:
        return current_context().checkpoint
    except (NotImplementedError, AttributeError):
        return None


@contextlib.contextmanager
def open_run_folder(uri: str):
    """Inside: the train stage's ``RunFolder`` and the checkpoint to resume from, ``(folder, resume)``,
    while this attempt owns the run folder.

    A retried attempt finds the run folder of the attempt before it in the execution's Flyte
    checkpoint (``run.json``: one small file, so it is never half-written) and resumes from that
    folder's published checkpoint; otherwise the folder is ``uri`` and the run resumes from its
    latest checkpoint, if any (a re-launched execution with the same ``checkpoint_dir``). The
    pointer is saved again at once: an attempt only sees the previous attempt's checkpoint.

    The folder is owned (``run.lock.hold_run_folder``: an object store's lease, renewed while the
    attempt runs, or a local folder's lock) from before the resume point is read until the block
    ends, so a second execution with the same ``checkpoint_dir`` fails in one line naming the first
    instead of writing the folder too; the loop inside re-enters the hold for the staging folder. A
    lease left by a previous attempt of this execution (preempted: it could not release it) is
    waited for until it expires (``run.lock.LEASE_TTL_S``).
    """
    from diffusionrl.run import RunFolder, hold_run_folder, latest_checkpoint

    cp = flyte_checkpoint()
    restored = cp.restore() if cp is not None else None
    pointer = Path(restored) / RUN_POINTER if restored is not None else None
    if pointer is not None and pointer.is_file():
        uri = json.loads(pointer.read_text())["run_uri"]
        log.info("retried attempt: continuing the run folder %s", uri)
    staging = Path(current_context().working_directory) / "run"
    folder = RunFolder(uri, staging=staging)
    execution = {"execution": tracking_execution_id()}
    with hold_run_folder(folder.uri, local=folder.local, tags=execution, wait_for=execution):
        save_run_pointer(folder)
        resume = folder.pull() if folder.remote else latest_checkpoint(folder.local / "checkpoints")
        if resume is not None:
            log.info("resuming from %s", resume)
        yield folder, resume


def save_run_pointer(folder, step: int | None = None) -> None:
    """Record the run folder (and the step of its last checkpoint) in the Flyte checkpoint."""
    cp = flyte_checkpoint()
    if cp is None:
        return
    pointer = Path(tempfile.mkdtemp(dir=current_context().working_directory)) / RUN_POINTER
    pointer.write_text(json.dumps({"run_uri": folder.uri, "step": step}))
    cp.save(pointer)


class FlyteCheckpoints(Callback):
    """After every loop checkpoint (published to the run folder by ``run.folder.SyncRunFolder``, which
    runs first), the run folder pointer saved as the execution's Flyte checkpoint, what a retried
    attempt resumes from; ``$DIFFUSIONRL_FAULT_AFTER_STEPS=K`` fails the attempt retryably after
    K steps (tests, drills)."""

    def __init__(self, folder):
        self.folder = folder
        fault = os.environ.get(FAULT_ENV)
        self.fault_after = int(fault) if fault else None
        self.steps_this_attempt = 0

    def on_step(self, loop, step, batch, metrics) -> None:
        self.steps_this_attempt += 1

    def on_checkpoint(self, loop, path) -> None:
        save_run_pointer(self.folder, loop.step)
        if self.fault_after is not None and self.steps_this_attempt >= self.fault_after:
            raise FlyteRecoverableException(f"injected fault after {self.steps_this_attempt} steps ({FAULT_ENV})")


CONFIG_CHANGE_CHOICES = ("fail", "record")


def config_change_allowed(on_config_change: str) -> bool:
    """The workflows' ``on_config_change`` input: ``fail`` (a resume whose objective settings differ
    from the checkpoint's fails closed) or ``record`` (it continues, and the change is recorded in the
    run folder's ``config_changes.jsonl``). A string, not a bool: pyflyte warns on bool inputs."""
    from diffusionrl.config import ConfigError

    if on_config_change not in CONFIG_CHANGE_CHOICES:
        raise ConfigError(f"on_config_change={on_config_change!r} is not one of {list(CONFIG_CHANGE_CHOICES)}")
    return on_config_change == "record"


def check_workflow_inputs(on_config_change: str, checkpoint_dir: str, stages: tuple[str, ...] = ("",)) -> None:
    """What a workflow's first task checks of the workflow's own inputs, before any prompts are prepared or
    weights fetched: ``on_config_change`` is a choice (``config_change_allowed``), and no other run owns the
    run folders under ``checkpoint_dir`` that this execution's ``stages`` will hold (``stage_dir``;
    ``run.lock_check.check_free``: one read of an object store's lease, or a probe of a local lock; a previous
    attempt of this execution is not another run). Without ``checkpoint_dir`` each stage gets a fresh folder
    under the attempt's output prefix: nothing to check. The stages still hold their folders as they run."""
    config_change_allowed(on_config_change)
    if checkpoint_dir:
        from diffusionrl.run import check_free

        for name in stages:
            check_free(stage_dir(checkpoint_dir, name), tags={"execution": tracking_execution_id()})


def run_callbacks(folder, keep: int, *writers: Callback) -> list[Callback]:
    """The train stage's callbacks in their order: what writes into the run folder, the sync to
    the store, the Flyte checkpoint pointer."""
    from diffusionrl.run import SyncRunFolder

    return [*writers, SyncRunFolder(folder, keep), FlyteCheckpoints(folder)]


def open_train_stage(run: TrackingRun, run_dir: str, attempts: int, name: str = "train") -> str:
    """The ``train`` (or ``sft``) stage run, tagged with its run folder; an unreachable store is retryable."""
    try:
        return tracking.open_stage(run, name, attempts, tags={"run_dir": str(run_dir)})
    except tracking.TrackingUnavailable as exc:
        raise FlyteRecoverableException(str(exc)) from exc


@contextlib.contextmanager
def retryable_faults():
    """Inside: engine/server faults (connection errors, timeouts) and CUDA out-of-memory raise
    ``FlyteRecoverableException``, so Flyte retries the attempt (which resumes from its checkpoint)."""
    try:
        yield
    except (ConnectionError, TimeoutError) as exc:
        raise FlyteRecoverableException(f"transient failure in training: {exc}") from exc
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower():
            raise FlyteRecoverableException(f"out of memory: {exc}") from exc
        raise


# -- register and report --------------------------------------------------------------------------------


def record_registration(run: TrackingRun, reg: Registration) -> Registration:
    """``reg`` (the ``register`` tasks' output), also tagged on the workflow run."""
    tracking.set_tags(run, {"registered_model": reg.name, "registered_version": reg.version,
                            "registry_decision": reg.decision})
    return reg


def report_artifacts(run: TrackingRun, registered: Registration, run_dir: str, max_mb: float,
                     model, model_label: str, batches, batches_name: str, batches_label: str) -> dict[str, str]:
    """The report's artifact lines: the registry and run links, the trained model, the per-step
    Parquet folder (copied into the MLflow run when at most ``max_mb``, else linked) and the run folder."""
    path = batches.remote_source or batches.path
    where = tracking.log_folder_or_link(run, run.run_id, path, batches.download, batches_name, max_mb)
    return {
        **registered.links(),
        model_label: model.remote_source or model.path,
        batches_label: path,
        f"{batches_name} in MLflow": where,
        "run folder (checkpoints, metrics.jsonl)": run_dir,
    }


def publish_report(run: TrackingRun, page: str, run_dir: str) -> FlyteFile:
    """The report as the task's Deck, a file output, a copy in the run folder (local runs) and an
    artifact of the MLflow run, which is then closed."""
    Deck("Report", page)
    out = Path(tempfile.mkdtemp(dir=current_context().working_directory)) / "report.html"
    out.write_text(page)
    from diffusionrl.run import is_remote, write_text

    if is_remote(run_dir) or Path(run_dir).is_dir():
        write_text(f"{run_dir.rstrip('/')}/report.html", page)
    tracking.client(run.uri).log_artifact(run.run_id, str(out))
    tracking.finish(run)
    return FlyteFile(str(out))
