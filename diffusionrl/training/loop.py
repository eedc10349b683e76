"""The RL loop: rollout -> reward -> advantages -> update -> weight push -> metrics -> checkpoint.

Everything a step does is a named method of ``RLLoop`` (``sample_batch``, ``rollout``, ``score``,
``update``, ``push_weights``, ``checkpoint``). Every random choice of step ``s`` (its prompts,
sample seeds, SDE steps, micro-batch order) is seeded by ``(train.seed, s)``, so a run resumed
from a checkpoint repeats exactly what the uninterrupted run would have done.

Callbacks (``on_step``, ``on_checkpoint``, ``on_end``) let the Flyte task write Parquet
trajectories, save Flyte checkpoints and stream MLflow metrics without the loop knowing them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from diffusionrl.algorithms.advantages import group_advantages
from diffusionrl.config import Config
from diffusionrl.data import PromptSampler, PromptSet, load_prompts
from diffusionrl.models import load_adapter
from diffusionrl.rewards import make_scorer, reward_metrics
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.sampling import sde_step_mask
from diffusionrl.trajectory import Trajectory

from .checkpoint import (
    CheckpointState,
    check_metadata,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from .policy import LoraPolicy
from .trainer import FlowGRPOObjective, Trainer

log = logging.getLogger(__name__)


class Callback(Protocol):
    def on_step(self, loop: "RLLoop", step: int, traj: Trajectory, metrics: dict[str, float]) -> None: ...


@dataclass
class TrainResult:
    out_dir: Path
    lora_dir: Path
    metrics: list[dict[str, float]]
    steps_done: int
    checkpoint: Path | None
    extra_lora_dirs: dict[str, Path] = field(default_factory=dict)


def build_objective(cfg: Config, policy: LoraPolicy):
    if cfg.algorithm.name == "flow_grpo":
        return FlowGRPOObjective(cfg, policy)
    if cfg.algorithm.name == "nft":
        from .nft import NFTObjective

        return NFTObjective(cfg, policy)
    raise ValueError(f"unknown algorithm {cfg.algorithm.name!r}")


def make_engine(cfg: Config, adapter, policy: LoraPolicy, progress: bool = False):
    name = cfg.sampling.engine
    if name == "local":
        from diffusionrl.rollout.local import LocalRolloutEngine

        return LocalRolloutEngine(adapter, policy.engine_copy(), cfg.train.micro_batch_size, progress=progress)
    if name == "sglang":
        from diffusionrl.rollout.sglang import SGLangRolloutEngine

        return SGLangRolloutEngine.from_config(cfg, adapter, policy)
    raise ValueError(f"unknown rollout engine {name!r}")


class RLLoop:
    """Owns the adapter, policy, trainer, engine and scorer of one training run."""

    def __init__(
        self,
        cfg: Config,
        out_dir: str | Path,
        prompts: PromptSet | None = None,
        callbacks: list[Any] | None = None,
        progress: bool | None = None,
        model_path: str | None = None,
    ):
        """``model_path`` loads the base weights from a fetched folder; the run's identity
        (checkpoint metadata, lineage) stays ``cfg.model.name`` and the weights' digest."""
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.callbacks = list(callbacks or [])
        self.progress = progress
        torch.manual_seed(cfg.train.seed)
        self.prompts = prompts if prompts is not None else load_prompts(cfg.data, validate=prompt_validator(cfg.reward))
        model_cfg = dataclasses.replace(cfg.model, name=model_path) if model_path else cfg.model
        self.adapter = load_adapter(model_cfg, cfg.train.mixed_precision)
        self.policy = LoraPolicy(self.adapter, cfg.model, seed=cfg.train.seed)
        self.trainer = Trainer(cfg, self.policy)
        self.objective = build_objective(cfg, self.policy)
        self.engine = make_engine(cfg, self.adapter, self.policy)
        self.scorer = make_scorer(cfg.reward)
        self.sampler = PromptSampler(self.prompts.train, cfg.train.prompts_per_step, cfg.train.seed)
        self.spec = SamplingSpec.from_config(cfg)
        self.step = 0
        self.version = 0
        self.cursor = 0
        self.history: list[dict[str, float]] = []

    # -- identity ----------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed: the model and the objective."""
        cfg = self.cfg
        return {
            "model": cfg.model.name,
            "model_digest": self.adapter.digest(),
            "algorithm": cfg.algorithm.name,
            "reward": dict(sorted(cfg.reward.weights.items())),
            "lora": {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha, "targets": list(cfg.model.lora_targets)},
            "sde_type": cfg.sampling.sde_type if cfg.algorithm.name == "flow_grpo" else "ode",
        }

    # -- one step ------------------------------------------------------------------------------------
    def sample_batch(self, step: int) -> tuple[list[str], torch.Tensor, torch.Tensor, np.ndarray, list[dict]]:
        cfg = self.cfg
        k = cfg.train.group_size
        rows, self.cursor = self.sampler.batch(step)
        prompts = [r["prompt"] for r in rows for _ in range(k)]
        metadata = [{key: v for key, v in r.items() if key != "prompt"} for r in rows for _ in range(k)]
        groups = len(rows)
        group_ids = torch.arange(step * groups, (step + 1) * groups, dtype=torch.int64).repeat_interleave(k)
        seq = np.random.SeedSequence([cfg.train.seed, step])
        sample_seeds, group_seeds = seq.spawn(2)
        seeds = torch.as_tensor(sample_seeds.generate_state(groups * k, dtype=np.uint32).astype(np.int64))
        sc = cfg.sampling
        mask = sde_step_mask(
            sc.step_strategy,
            sc.num_steps,
            group_seeds.generate_state(groups, dtype=np.uint32),
            num_sde_steps=sc.num_sde_steps,
            window_range=sc.window_range,
            candidate_steps=sc.candidate_steps,
            epoch=step,
            seed=cfg.train.seed,
        )
        return prompts, group_ids, seeds, np.repeat(mask, k, axis=0), metadata

    def rollout(self, step: int) -> Trajectory:
        prompts, group_ids, seeds, mask, metadata = self.sample_batch(step)
        spec = self.spec
        if self.cfg.algorithm.name == "nft":
            spec = SamplingSpec.from_config(self.cfg, sde_type="ode")
        return self.engine.generate(prompts, group_ids, seeds, spec, mask, metadata)

    def score(self, traj: Trajectory) -> tuple[Trajectory, torch.Tensor, dict[str, float]]:
        total, parts = self.scorer(traj.images, traj.prompts, traj.metadata or [{}] * traj.batch_size)
        ac = self.cfg.algorithm
        rewards = torch.as_tensor(total, dtype=torch.float32)
        adv = group_advantages(rewards, traj.group_ids, global_std=ac.global_std, clip_max=ac.adv_clip_max)
        components = {n: torch.as_tensor(r.scores, dtype=torch.float32) for n, r in parts.items()}
        traj = traj.with_rewards(rewards, components, adv.advantages)
        metrics = reward_metrics(total, parts)
        metrics["rollout/zero_std/count"] = float(adv.zero_std_groups)
        return traj, adv.active, metrics

    def update(self, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]:
        return self.objective.train_step(self.trainer, traj, active, step)

    def push_weights(self, version: int) -> None:
        self.engine.update_weights(self.objective_rollout_state(), version)
        self.version = version

    def objective_rollout_state(self) -> dict[str, torch.Tensor]:
        """The LoRA the engine samples with: the live policy (or NFT's old policy)."""
        getter = getattr(self.objective, "rollout_state", None)
        return getter() if getter else self.policy.lora_state()

    def run_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        traj = self.rollout(step)
        t1 = time.perf_counter()
        traj, active, metrics = self.score(traj)
        t2 = time.perf_counter()
        metrics.update(self.update(traj, active, step))
        t3 = time.perf_counter()
        self.push_weights(step + 1)
        t4 = time.perf_counter()
        metrics.update(
            {
                "perf/rollout_time": t1 - t0,
                "perf/reward_time": t2 - t1,
                "perf/train_time": t3 - t2,
                "perf/update_weights_time": t4 - t3,
                "perf/step_time": t4 - t0,
                "step": float(step + 1),
                "policy_version": float(self.version),
            }
        )
        self.step = step + 1
        self.history.append(metrics)
        self._write_metrics(metrics)
        if self.cfg.train.log_images_every and (step + 1) % self.cfg.train.log_images_every == 0 and traj.images is not None:
            save_grid(traj.images, self.out_dir / "samples" / f"step-{step + 1:06d}.png", cols=self.cfg.train.group_size)
        for cb in self.callbacks:
            if hasattr(cb, "on_step"):
                cb.on_step(self, step + 1, traj, metrics)
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        tensors = {}
        if self.trainer.ema is not None:
            tensors["ema"] = self.trainer.ema.state()
        extra_state = getattr(self.objective, "state_tensors", None)
        if extra_state:
            tensors.update(extra_state())
        state = CheckpointState(
            step=self.step,
            policy_version=self.version,
            metadata=self.metadata(),
            lora=self.policy.lora_state(),
            optimizer=self.trainer.optimizer.state_dict(),
            scaler=self.trainer.scaler.state_dict() if self.trainer.scaler.is_enabled() else {},
            tensors=tensors,
            extra={"data_cursor": self.cursor, "config_digest": self.cfg.digest()},
        )
        return self.write_checkpoint(state)

    def write_checkpoint(self, state: CheckpointState) -> Path:
        """Save ``state`` as this step's checkpoint, prune old ones, tell the callbacks."""
        path = save_checkpoint(self.ckpt_dir / f"step-{self.step:06d}", state)
        prune_checkpoints(self.ckpt_dir, self.cfg.train.keep_checkpoints)
        for cb in self.callbacks:
            if hasattr(cb, "on_checkpoint"):
                cb.on_checkpoint(self, path)
        return path

    def restore(self, path: str | Path) -> None:
        state = load_checkpoint(path)
        check_metadata(state.metadata, self.metadata(), str(path))
        self.policy.load_lora_state(state.lora)
        self.trainer.optimizer.load_state_dict(state.optimizer)
        if state.scaler and self.trainer.scaler.is_enabled():
            self.trainer.scaler.load_state_dict(state.scaler)
        if self.trainer.ema is not None and "ema" in state.tensors:
            device = self.adapter.device
            self.trainer.ema.shadow = {k: v.to(device).clone() for k, v in state.tensors["ema"].items()}
        loader = getattr(self.objective, "load_state_tensors", None)
        if loader:
            loader(state.tensors)
        self.step = state.step
        self.cursor = int(state.extra.get("data_cursor", 0))
        self.history = _read_metrics(self.out_dir / "metrics.jsonl", upto=self.step)
        self.push_weights(state.policy_version)
        log.info("resumed from %s at step %d", path, self.step)

    # -- the run -------------------------------------------------------------------------------------
    def run(self, resume: str | Path | None = "auto", stop_after: int | None = None) -> TrainResult:
        """Train until ``train.steps`` (or ``stop_after`` more steps); resume from a checkpoint.

        ``resume="auto"`` continues from the latest checkpoint of this output folder, a path
        resumes from that checkpoint, ``None`` starts fresh.
        """
        path = latest_checkpoint(self.ckpt_dir) if resume == "auto" else resume
        if path:
            self.restore(path)
        else:
            self.push_weights(0)
            (self.out_dir / "metrics.jsonl").unlink(missing_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
        last = self.cfg.train.steps if stop_after is None else min(self.cfg.train.steps, self.step + stop_after)
        every = self.cfg.train.checkpoint_every
        ckpt = latest_checkpoint(self.ckpt_dir)
        bar = tqdm(range(self.step, last), desc="train", initial=self.step, total=self.cfg.train.steps,
                   disable=None if self.progress is None else not self.progress)
        for step in bar:
            metrics = self.run_step(step)
            bar.set_postfix(reward=f"{metrics['rollout/reward/raw_mean']:.4f}")
            if (every and self.step % every == 0) or self.step == last:
                ckpt = self.checkpoint()
        lora_dir, extra = self.save_lora()
        for cb in self.callbacks:
            if hasattr(cb, "on_end"):
                cb.on_end(self)
        return TrainResult(self.out_dir, lora_dir, list(self.history), self.step, ckpt, extra)

    def save_lora(self) -> tuple[Path, dict[str, Path]]:
        """The trained adapter in peft format (``adapter_model.safetensors``), and its EMA."""
        info = {
            "base_model": self.cfg.model.name,
            "base_model_revision": self.cfg.model.revision,
            "base_model_digest": self.adapter.digest(),
            "step": self.step,
            "algorithm": self.cfg.algorithm.name,
            "config_digest": self.cfg.digest(),
        }
        out = self.out_dir / "lora"
        self.policy.model.save_pretrained(str(out))
        (out / "diffusionrl.json").write_text(json.dumps(info, indent=1))
        extra = {}
        if self.trainer.ema is not None:
            ema_dir = self.out_dir / "lora_ema"
            live = self.policy.lora_state()
            self.policy.load_lora_state(self.trainer.ema.state())
            try:
                self.policy.model.save_pretrained(str(ema_dir))
            finally:
                self.policy.load_lora_state(live)
            (ema_dir / "diffusionrl.json").write_text(json.dumps({**info, "ema_decay": self.cfg.train.ema_decay}, indent=1))
            extra["ema"] = ema_dir
        return out, extra

    def close(self) -> None:
        self.engine.close()
        close = getattr(self.scorer, "close", None)
        if close:
            close()

    def _write_metrics(self, metrics: dict[str, float]) -> None:
        with (self.out_dir / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps(metrics) + "\n")


def _read_metrics(path: Path, upto: int) -> list[dict[str, float]]:
    """Metrics of the steps a checkpoint covers (later lines belong to lost, re-run steps)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) <= upto]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def prompt_validator(reward_cfg):
    """Extra prompt checks the configured rewards need (OCR needs a quoted target)."""
    if "ocr" not in reward_cfg.weights:
        return None
    from diffusionrl.rewards.ocr import validate_ocr_prompts

    def validate(rows: list[dict], where: str) -> None:
        validate_ocr_prompts([r["prompt"] for r in rows], [r for r in rows], source=where)

    return validate


def save_grid(images: np.ndarray, path: Path, cols: int) -> Path:
    """uint8 ``[N, H, W, 3]`` -> one PNG grid with ``cols`` columns."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    n, h, w, _ = images.shape
    cols = max(1, min(cols, n))
    rows = (n + cols - 1) // cols
    grid = np.zeros((rows * h, cols * w, 3), dtype=np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = img
    Image.fromarray(grid).save(path)
    return path


def train(cfg: Config, out_dir: str | Path, resume: str | Path | None = "auto", stop_after: int | None = None,
          callbacks: list[Any] | None = None, progress: bool | None = None, prompts: PromptSet | None = None,
          model_path: str | None = None) -> TrainResult:
    """Build a loop for ``cfg`` and run it (the library entry point)."""
    loop_cls = RLLoop
    if cfg.train.world_size > 1:  # the trainer as FSDP2 ranks in Ray actors (docs/scaling.md)
        from diffusionrl.distributed.loop import DistributedRLLoop as loop_cls
    loop = loop_cls(cfg, out_dir, prompts=prompts, callbacks=callbacks, progress=progress, model_path=model_path)
    try:
        return loop.run(resume=resume, stop_after=stop_after)
    finally:
        loop.close()
