"""The tasks of the GRPO workflow (DESIGN.md "The DAG").

Each body unpacks typed inputs, calls the ``diffusionrl`` library and packs outputs; no algorithm
code lives here. Locally (``pyflyte run``) images and resources are ignored and the Ray task
starts a local Ray; on a cluster the train task is a KubeRay job.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import pandas as pd
from flytekit import Cache, Deck, Resources, current_context, task
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from diffusionrl.config import Config, DataConfig, RewardConfig, apply_overrides
from diffusionrl.data import PromptSet, load_prompts
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


RAY_CONFIG = RayJobConfig(
    head_node_config=HeadNodeConfig(
        ray_start_params={"num-cpus": "8", "log-color": "False"},
        requests=Resources(cpu="8", mem="64Gi", gpu="2"),
        limits=Resources(cpu="8", mem="64Gi", gpu="2"),
    ),
    worker_node_config=[WorkerNodeConfig(group_name="reward-cpu", replicas=1, min_replicas=0, max_replicas=4,
                                         requests=Resources(cpu="8", mem="16Gi"))],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=600,
)


@task(task_config=RAY_CONFIG, container_image=GPU_IMAGE, interruptible=True, retries=3, enable_deck=False)
def train(config: Config, train_prompts: pd.DataFrame, test_prompts: pd.DataFrame, prompts_digest: str,
          model_dir: FlyteDirectory, checkpoint_dir: str) -> TrainOutputs:
    """The RL loop as a Ray job. Resumes, in order, from this execution's Flyte checkpoint (a
    retried attempt), from ``checkpoint_dir`` (a local folder kept across runs), or starts fresh."""
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
    hooks = _FlyteHooks(run_dir / "trajectories", _execution_id(), latents=config.train.save_latents,
                        flyte_checkpoint=cp, fault_after=int(fault) if fault else None)
    prompts = PromptSet(rows_from_frame(train_prompts), rows_from_frame(test_prompts), "flyte")
    try:
        result = run_training(config, run_dir, resume=resume, callbacks=[hooks], prompts=prompts,
                              model_path=model_dir.download())
    except (ConnectionError, TimeoutError) as exc:  # engine/server faults: worth a retry
        raise FlyteRecoverableException(f"transient failure in training: {exc}") from exc
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower():
            raise FlyteRecoverableException(f"out of memory: {exc}") from exc
        raise
    lora = result.extra_lora_dirs.get("ema", result.lora_dir) if config.eval.use_ema else result.lora_dir
    metrics = pd.DataFrame(result.metrics)
    return TrainOutputs(FlyteDirectory(str(lora)), FlyteDirectory(str(run_dir / "trajectories")), metrics, str(run_dir))


def _execution_id() -> str:
    try:
        eid = current_context().execution_id
        return f"{eid.project}-{eid.domain}-{eid.name}"
    except Exception:  # noqa: BLE001 - outside an execution
        return "local"


# -- evaluate -----------------------------------------------------------------------------------------------


class EvalOutputs(NamedTuple):
    table: pd.DataFrame
    summary: dict[str, float]
    grid: FlyteFile


@task(container_image=GPU_IMAGE, requests=Resources(cpu="4", mem="32Gi", gpu="1"))
def evaluate(config: Config, test_prompts: pd.DataFrame, model_dir: FlyteDirectory, lora: FlyteDirectory) -> EvalOutputs:
    """ODE sampling on held-out prompts with the base model and with the LoRA, same seeds."""
    from PIL import Image

    from diffusionrl.evaluation import evaluate_lora

    result = evaluate_lora(config, rows_from_frame(test_prompts), lora.download(), model_path=model_dir.download())
    grid_path = Path(current_context().working_directory) / "eval_grid.png"
    Image.fromarray(result.grid).save(grid_path)
    log.info("evaluation: %s", result.summary)
    return EvalOutputs(result.table, result.summary, FlyteFile(str(grid_path)))


# -- report -------------------------------------------------------------------------------------------------


@task(container_image=CPU_IMAGE, enable_deck=True)
def report(config: Config, metrics: pd.DataFrame, eval_table: pd.DataFrame, eval_summary: dict[str, float],
           grid: FlyteFile, lora: FlyteDirectory, trajectories: FlyteDirectory, run_dir: str,
           prompts_digest: str, model_digest: str) -> FlyteFile:
    """HTML report (also shown as the task's Flyte Deck)."""
    import numpy as np
    from PIL import Image

    from diffusionrl.report import build_report

    artifacts = {
        "LoRA (peft adapter)": lora.remote_source or lora.path,
        "trajectories (Parquet, one file per step)": trajectories.remote_source or trajectories.path,
        "run folder (checkpoints, metrics.jsonl)": run_dir,
        "prompt data digest": prompts_digest,
        "base model": f"{config.model.name} (digest {model_digest[:16]})",
    }
    page = build_report(config=config.to_dict(), metrics=metrics, eval_table=eval_table, eval_summary=eval_summary,
                        grid=np.asarray(Image.open(grid.download()).convert("RGB")), artifacts=artifacts)
    Deck("Report", page)
    out = Path(tempfile.mkdtemp(dir=current_context().working_directory)) / "report.html"
    out.write_text(page)
    if Path(run_dir).is_dir():  # local runs: keep a copy next to the LoRA and trajectories
        (Path(run_dir) / "report.html").write_text(page)
    return FlyteFile(str(out))
