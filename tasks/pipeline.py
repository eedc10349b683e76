"""The tasks of the GRPO workflow (docs/architecture.md "The DAG").

Each body unpacks typed inputs, calls the ``diffusionrl`` library and packs outputs; no algorithm
code lives here. Locally (``pyflyte run``) images and resources are ignored and the Ray task
starts a local Ray; on a cluster the train task is a KubeRay job.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import pandas as pd
from flytekit import Cache, Deck, Resources, current_context, task
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.types.error import FlyteError
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from diffusionrl.config import Config, DataConfig, RewardConfig, apply_overrides
from diffusionrl.data import PromptSet, load_prompts
from diffusionrl.tracking import TrackingRun
from images import CPU_IMAGE, GPU_IMAGE

log = logging.getLogger(__name__)

# Bump when a task's outputs change for the same inputs (the cache key is name + version + inputs).
PREPARE_CACHE = Cache(version="prompts-v1")
FETCH_CACHE = Cache(version="checkpoint-v1")

# Test/ops hook: make the train task fail (retryably) after this many steps of an attempt.
FAULT_ENV = "DIFFUSIONRL_FAULT_AFTER_STEPS"


# -- config ------------------------------------------------------------------------------------------


@task(container_image=CPU_IMAGE)
def resolve_config(config: Config, overrides: list[str]) -> Config:
    """Apply dotted ``key=value`` overrides and re-validate the whole tree."""
    return Config.from_dict(apply_overrides(config.to_dict(), overrides))


# -- tracking -------------------------------------------------------------------------------------------


# Local executions all report the id "local": a process gets its own id instead, so that a failure
# handler finds its execution's runs (local executions of one process run one after another).
_LOCAL_EXECUTION_ID = f"local-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def tracking_execution_id() -> str:
    eid = _execution_id()
    return _LOCAL_EXECUTION_ID if eid.startswith("local") else eid


def _execution() -> dict[str, str]:
    """Flyte's ids for this execution (see ``tracking_execution_id``)."""
    out = {"flyte_execution_id": tracking_execution_id(), "workflow_version": os.environ.get("FLYTE_INTERNAL_TASK_VERSION", "local")}
    try:
        eid = current_context().execution_id
        out.update({"flyte_project": eid.project, "flyte_domain": eid.domain})
    except Exception:  # noqa: BLE001 - outside an execution
        pass
    workflow = os.environ.get("FLYTE_INTERNAL_EXECUTION_WORKFLOW")
    if workflow:
        out["flyte_workflow"] = workflow
    return out


@task(container_image=CPU_IMAGE)
def start_run(config: Config) -> TrackingRun:
    """Preflight the MLflow store (fails fast, naming the URI) and open this execution's run."""
    from diffusionrl.tracking import start_workflow_run

    return start_workflow_run(config, _execution())


def close_failed_runs(tracking_cfg, err: FlyteError | None) -> None:
    """Body of the workflows' failure handlers: this execution's open MLflow runs -> FAILED."""
    from diffusionrl import tracking

    message = err.message if err is not None else "workflow failed"
    n = tracking.fail_open_runs(tracking.resolve_uri(tracking_cfg.uri), tracking_cfg.experiment,
                                tracking_execution_id(), message)
    log.info("marked %d MLflow runs of %s as FAILED", n, tracking_execution_id())


@task(container_image=CPU_IMAGE)
def on_grpo_failure(config: Config, overrides: list[str], checkpoint_dir: str, err: Optional[FlyteError] = None) -> None:
    """Failure handler of ``grpo``: the MLflow runs it left open are marked FAILED."""
    try:
        cfg = Config.from_dict(apply_overrides(config.to_dict(), overrides))
    except Exception:  # noqa: BLE001 - the overrides themselves may be what failed
        cfg = config
    close_failed_runs(cfg.tracking, err)


class DatasetDigests(NamedTuple):
    train: str
    test: str


@task(container_image=CPU_IMAGE)
def track_inputs(run: TrackingRun, config: Config, train_prompts: pd.DataFrame, test_prompts: pd.DataFrame,
                 prompts_digest: str, model_digest: str) -> DatasetDigests:
    """The ``prepare`` stage run: prompt splits as MLflow datasets (Parquet + digest) and the data
    and weight digests as lineage tags."""
    from diffusionrl import tracking

    stage = tracking.stage_run(run, "prepare")
    digests = tracking.log_prompt_datasets(run, stage, {"train": train_prompts, "test": test_prompts}, config.data.source)
    tracking.set_tags(run, {"dataset_digest": prompts_digest, "base_model_digest": model_digest,
                            "dataset_source": config.data.source}, also=[stage])
    client = tracking.client(run.uri)
    for split, df in (("train", train_prompts), ("test", test_prompts)):
        client.log_metric(stage, f"data/{split}_prompts", float(len(df)))
    tracking.finish(run, stage)
    return DatasetDigests(digests["train"], digests["test"])


# -- prepare_prompts -----------------------------------------------------------------------------------


class Prompts(NamedTuple):
    train: pd.DataFrame
    test: pd.DataFrame
    digest: str
    stats: dict[str, int]


def _frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [r["prompt"] for r in rows],
                         "metadata_json": [json.dumps({k: v for k, v in r.items() if k != "prompt"}, sort_keys=True)
                                           for r in rows]})


def rows_from_frame(df: pd.DataFrame) -> list[dict]:
    return [{"prompt": p, **json.loads(m)} for p, m in zip(df["prompt"], df["metadata_json"])]


@task(cache=PREPARE_CACHE, container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"))
def prepare_prompts(data: DataConfig, reward: RewardConfig) -> Prompts:
    """Prompt source -> validated, deterministically split train/test tables + content digest."""
    from diffusionrl.training.loop import prompt_validator

    ps = load_prompts(data, validate=prompt_validator(reward))
    log.info("prompts from %s: %s (digest %s)", data.source, ps.stats, ps.digest)
    return Prompts(_frame(ps.train), _frame(ps.test), ps.digest, dict(ps.stats))


# -- fetch_checkpoint ------------------------------------------------------------------------------------


class Checkpoint(NamedTuple):
    model_dir: FlyteDirectory
    digest: str


@task(cache=FETCH_CACHE, container_image=CPU_IMAGE, requests=Resources(cpu="2", mem="8Gi", ephemeral_storage="60Gi"))
def fetch_checkpoint(reference: str, revision: str) -> Checkpoint:
    """Model reference -> diffusers folder + digest. ``HF_TOKEN`` comes from the environment (or a
    Flyte secret mounted as that variable) and only ever reaches the hub client."""
    from diffusionrl.models.fetch import fetch_model, folder_digest

    dest = Path(current_context().working_directory) / "model"
    path = fetch_model(reference, revision, dest)
    digest = folder_digest(path)
    log.info("model %s@%s -> %s (digest %s)", reference, revision or "main", path, digest[:16])
    return Checkpoint(FlyteDirectory(str(path)), digest)


# -- train --------------------------------------------------------------------------------------------------


class TrainOutputs(NamedTuple):
    lora: FlyteDirectory
    trajectories: FlyteDirectory
    metrics: pd.DataFrame
    run_dir: str


class _FlyteHooks:
    """Loop callbacks: Parquet trajectories each step, Flyte checkpoints, fault injection."""

    def __init__(self, traj_dir: Path, run_id: str, latents: bool, flyte_checkpoint, fault_after: int | None):
        self.traj_dir = traj_dir
        self.run_id = run_id
        self.latents = latents
        self.cp = flyte_checkpoint
        self.fault_after = fault_after
        self.steps_this_attempt = 0

    def on_step(self, loop, step, traj, metrics) -> None:
        from diffusionrl.trajectory_store import write_step

        write_step(self.traj_dir, traj, run_id=self.run_id, step=step, images=True, latents=self.latents)
        self.steps_this_attempt += 1

    def on_checkpoint(self, loop, path) -> None:
        if self.cp is not None:
            self.cp.save(path)
        if self.fault_after is not None and self.steps_this_attempt >= self.fault_after:
            raise FlyteRecoverableException(f"injected fault after {self.steps_this_attempt} steps ({FAULT_ENV})")


def _flyte_checkpoint():
    try:
        return current_context().checkpoint
    except (NotImplementedError, AttributeError):
        return None


# The reference layout (sd35m-ocr: train.world_size=2, colocated): the head holds 2 GPU bundles of
# 4 CPUs (a trainer rank + an SGLang engine each) plus the driver; `train-gpu` workers (2 GPUs
# each) join when train.world_size grows past the head's GPUs; reward actors run on `reward-cpu`.
# Several nodes need checkpoint_dir and the model folder on shared storage (docs/scaling.md).
_GPU_NODE = Resources(cpu="10", mem="96Gi", gpu="2")
RAY_CONFIG = RayJobConfig(
    head_node_config=HeadNodeConfig(
        ray_start_params={"num-cpus": "10", "num-gpus": "2", "log-color": "False"},
        requests=_GPU_NODE,
        limits=_GPU_NODE,
    ),
    worker_node_config=[
        WorkerNodeConfig(group_name="train-gpu", replicas=0, min_replicas=0, max_replicas=4,
                         requests=_GPU_NODE, limits=_GPU_NODE),
        WorkerNodeConfig(group_name="reward-cpu", replicas=1, min_replicas=0, max_replicas=4,
                         requests=Resources(cpu="8", mem="16Gi")),
    ],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=600,
)


@task(task_config=RAY_CONFIG, container_image=GPU_IMAGE, interruptible=True, retries=3, enable_deck=False)
def train(config: Config, train_prompts: pd.DataFrame, test_prompts: pd.DataFrame, prompts_digest: str,
          model_dir: FlyteDirectory, checkpoint_dir: str, run: TrackingRun) -> TrainOutputs:
    """The RL loop as a Ray job. Resumes, in order, from this execution's Flyte checkpoint (a
    retried attempt), from ``checkpoint_dir`` (a local folder kept across runs), or starts fresh."""
    from diffusionrl import tracking
    from diffusionrl.training.checkpoint import latest_checkpoint
    from diffusionrl.training.loop import train as run_training

    ctx = current_context()
    run_dir = Path(checkpoint_dir) if checkpoint_dir else Path(ctx.working_directory) / "train"
    run_dir.mkdir(parents=True, exist_ok=True)
    cp = _flyte_checkpoint()
    resume = None
    restored = cp.restore() if cp is not None else None
    if restored is not None and (Path(restored) / "state.json").is_file():
        resume = Path(restored)
        cp.save(resume)  # an attempt only sees the previous attempt's checkpoint: keep it alive
    elif latest_checkpoint(run_dir / "checkpoints") is not None:
        resume = latest_checkpoint(run_dir / "checkpoints")
    if resume is not None:
        log.info("resuming from %s", resume)
    fault = os.environ.get(FAULT_ENV)
    hooks = _FlyteHooks(run_dir / "trajectories", run.execution_id, latents=config.train.save_latents,
                        flyte_checkpoint=cp, fault_after=int(fault) if fault else None)
    prompts = PromptSet(rows_from_frame(train_prompts), rows_from_frame(test_prompts), "flyte")
    stage = _open_train_run(run, run_dir, config.tracking.log_retries)
    metrics_cb = tracking.MetricLogger(run.uri, stage, images_every=config.train.log_images_every,
                                       attempts=config.tracking.log_retries)
    try:
        result = run_training(config, run_dir, resume=resume, callbacks=[hooks, metrics_cb], prompts=prompts,
                              model_path=model_dir.download())
    except (ConnectionError, TimeoutError) as exc:  # engine/server faults: worth a retry
        raise FlyteRecoverableException(f"transient failure in training: {exc}") from exc
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower():
            raise FlyteRecoverableException(f"out of memory: {exc}") from exc
        raise
    _finish_quietly(run, stage)
    lora = result.extra_lora_dirs.get("ema", result.lora_dir) if config.eval.use_ema else result.lora_dir
    metrics = pd.DataFrame(result.metrics)
    return TrainOutputs(FlyteDirectory(str(lora)), FlyteDirectory(str(run_dir / "trajectories")), metrics, str(run_dir))


def _execution_id() -> str:
    try:
        eid = current_context().execution_id
        return f"{eid.project}-{eid.domain}-{eid.name}"
    except Exception:  # noqa: BLE001 - outside an execution
        return "local"


def _open_train_run(run: TrackingRun, run_dir: Path, attempts: int) -> str:
    """The ``train`` stage run, retried; a store still down is a retryable task failure (nothing
    is lost: the retried attempt resumes from the last checkpoint)."""
    from diffusionrl import tracking

    tracking.configure_http()

    def open_run() -> str:
        stage = tracking.stage_run(run, "train")
        tracking.client(run.uri).set_tag(stage, "run_dir", str(run_dir))
        return stage

    try:
        return tracking.with_retries(open_run, attempts, "opening the MLflow train run")
    except Exception as exc:  # noqa: BLE001
        raise FlyteRecoverableException(f"MLflow store {run.uri} unreachable before training: {exc}") from exc


def _finish_quietly(run: TrackingRun, stage: str) -> None:
    """Close a stage run; a tracking outage at this point must not fail a finished stage."""
    from diffusionrl import tracking

    try:
        tracking.with_retries(lambda: tracking.finish(run, stage), 3, "closing the MLflow stage run")
    except Exception as exc:  # noqa: BLE001
        log.warning("could not close MLflow run %s: %s", stage, exc)


# -- evaluate -----------------------------------------------------------------------------------------------


class EvalOutputs(NamedTuple):
    table: pd.DataFrame
    summary: dict[str, float]
    grid: FlyteFile


@task(container_image=GPU_IMAGE, requests=Resources(cpu="4", mem="32Gi", gpu="1"))
def evaluate(config: Config, test_prompts: pd.DataFrame, model_dir: FlyteDirectory, lora: FlyteDirectory,
             run: TrackingRun) -> EvalOutputs:
    """ODE sampling on held-out prompts with the base model and with the LoRA, same seeds."""
    from PIL import Image

    from diffusionrl import tracking
    from diffusionrl.evaluation import evaluate_lora

    result = evaluate_lora(config, rows_from_frame(test_prompts), lora.download(), model_path=model_dir.download())
    grid_path = Path(current_context().working_directory) / "eval_grid.png"
    Image.fromarray(result.grid).save(grid_path)
    log.info("evaluation: %s", result.summary)
    stage = tracking.stage_run(run, "evaluate")
    client = tracking.client(run.uri)
    for key, value in result.summary.items():
        client.log_metric(stage, key, value)
        client.log_metric(run.run_id, key, value)
    client.log_table(stage, result.table, "eval/table.json")
    client.log_image(stage, result.grid, artifact_file="eval/grid_base_top_tuned_bottom.png")
    tracking.finish(run, stage)
    return EvalOutputs(result.table, result.summary, FlyteFile(str(grid_path)))


# -- register -----------------------------------------------------------------------------------------------


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
    def record(cls, run: TrackingRun, reg) -> "RegisteredVersion":
        """A ``registry.Registration`` as a task output, also tagged on the workflow run."""
        from diffusionrl import tracking

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
    from diffusionrl import tracking

    Deck("Report", page)
    out = Path(tempfile.mkdtemp(dir=current_context().working_directory)) / "report.html"
    out.write_text(page)
    if Path(run_dir).is_dir():
        (Path(run_dir) / "report.html").write_text(page)
    tracking.client(run.uri).log_artifact(run.run_id, str(out))
    tracking.finish(run)
    return FlyteFile(str(out))


@task(container_image=GPU_IMAGE, requests=Resources(cpu="4", mem="32Gi", gpu="1"))
def register(config: Config, run: TrackingRun, lora: FlyteDirectory, model_dir: FlyteDirectory, model_digest: str,
             test_prompts: pd.DataFrame, test_digest: str, prompts_digest: str,
             eval_summary: dict[str, float]) -> RegisteredVersion:
    """Log the LoRA as an ``mlflow.diffusers`` model, register a version (alias ``candidate``) and
    move ``champion`` only if it beats the current one on the same evaluation."""
    from diffusionrl import registry, tracking
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.models.fetch import base_model_reference

    model_path = model_dir.download()
    parent = tracking.client(run.uri).get_run(run.run_id).data.tags
    lineage = {k: parent.get(k, "") for k in tracking.LINEAGE_KEYS}
    lineage.update({"dataset_digest": prompts_digest, "test_dataset_digest": test_digest,
                    "base_model_digest": model_digest, "algorithm": config.algorithm.name, "preset": config.preset})
    rows = rows_from_frame(test_prompts)
    info = registry.log_lora_model(
        run, config, lora.download(), base_model_reference(config.model.name, model_path, model_digest),
        example_prompt=rows[0]["prompt"], metadata=lineage,
    )

    def rescore(model_dir: Path) -> float:
        peft_dir = model_dir / "adapter_weights" / registry.PEFT_SUBDIR
        return evaluate_lora(config, rows, peft_dir, model_path=model_path).summary["eval/reward_mean"]

    key = registry.eval_key(config, test_digest, model_digest)
    reg = registry.register(run, config, info, eval_summary["eval/reward_mean"], key, lineage, rescore=rescore)
    return RegisteredVersion.record(run, reg)


# -- report -------------------------------------------------------------------------------------------------


@task(container_image=CPU_IMAGE, enable_deck=True)
def report(config: Config, metrics: pd.DataFrame, eval_table: pd.DataFrame, eval_summary: dict[str, float],
           grid: FlyteFile, lora: FlyteDirectory, trajectories: FlyteDirectory, run_dir: str,
           prompts_digest: str, model_digest: str, run: TrackingRun, registered: RegisteredVersion) -> FlyteFile:
    """HTML report (also shown as the task's Flyte Deck and logged to the MLflow run, which it closes)."""
    import numpy as np
    from PIL import Image

    from diffusionrl import tracking
    from diffusionrl.report import build_report

    traj_path = trajectories.remote_source or trajectories.path
    traj_where = tracking.log_folder_or_link(run, run.run_id, traj_path, trajectories.download, "trajectories",
                                             config.tracking.max_artifact_mb)
    artifacts = {
        **registered.links(),
        "LoRA (peft adapter)": lora.remote_source or lora.path,
        "trajectories (Parquet, one file per step)": traj_path,
        "trajectories in MLflow": traj_where,
        "run folder (checkpoints, metrics.jsonl)": run_dir,
        "prompt data digest": prompts_digest,
        "base model": f"{config.model.name} (digest {model_digest[:16]})",
    }
    page = build_report(config=config.to_dict(), metrics=metrics, eval_table=eval_table, eval_summary=eval_summary,
                        grid=np.asarray(Image.open(grid.download()).convert("RGB")), artifacts=artifacts)
    client = tracking.client(run.uri)
    if len(metrics):
        last = metrics.iloc[-1]
        for key in ("rollout/reward/raw_mean", "train/loss", "perf/step_time"):
            if key in last and pd.notna(last[key]):
                client.log_metric(run.run_id, f"final/{key}", float(last[key]))
    return publish_report(run, page, run_dir)
