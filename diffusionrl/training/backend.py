"""``ImageBackend``: one step of image RL, driven by ``run.loop.RunLoop``.

A step is ``sample_batch -> rollout -> score -> update -> push_weights``. Every random choice of
step ``s`` (its prompts, sample seeds, SDE steps, micro-batch order) is seeded by
``(train.seed, s)``, so a run resumed from a checkpoint repeats what the uninterrupted run would
have done. The policy side is a ``PolicyWorker``: ``training.local_worker.LocalPolicyWorker`` in
this process, or ``distributed.ranks.RankGroup`` (``train.world_size > 1``, trainer ranks in Ray
actors); prompts, rewards, advantages and checkpoints stay here, identical for both.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from diffusionrl.algorithms.advantages import group_advantages
from diffusionrl.algorithms.sde import sde_step_mask
from diffusionrl.config import objective
from diffusionrl.data import PromptSampler, PromptSet
from diffusionrl.evaluation import eval_spec
from diffusionrl.heldout import HeldOutProbe
from diffusionrl.rewards import reward_metrics
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.run import CheckpointState
from diffusionrl.trajectory import Trajectory
from diffusionrl.video import grid, save_picture


class PolicyWorker(Protocol):
    """The policy side of an image run (weights, optimizer, engine), in one process or many."""

    def digest(self) -> str: ...  # base weights' digest

    def info(self) -> dict[str, Any]: ...  # layout facts recorded in checkpoints and adapters

    def generate(self, prompts, group_ids, seeds, spec, mask, metadata) -> Trajectory: ...

    def train_step(self, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]: ...

    def push_weights(self, version: int) -> dict[str, float]: ...  # -> extra perf metrics

    def checkpoint_parts(self) -> dict[str, Any]: ...  # lora, optimizer, scaler, tensors

    def load_checkpoint_parts(self, state: CheckpointState) -> None: ...

    def save_lora(self, out_dir: Path, info: dict[str, Any]) -> tuple[Path, dict[str, Path]]: ...

    def close(self) -> None: ...


class ImageBackend:
    """Prompts, rewards and step bookkeeping of an image RL run over a ``PolicyWorker``."""

    progress_label = "train"
    restore_rng = True

    def __init__(self, cfg, out_dir: str | Path, prompts: PromptSet, worker: PolicyWorker, scorer):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.prompts = prompts
        self.worker = worker
        self.scorer = scorer
        self.sampler = PromptSampler(prompts.train, cfg.train.prompts_per_step, cfg.train.seed,
                                     cfg.data.balance_by)
        self.probe = HeldOutProbe(cfg, prompts.test, scorer, eval_spec(cfg))
        # An SDE objective samples with the configured dynamics; the others re-noise clean ODE samples. Only the
        # training rollouts share latents or compress the steps after MixGRPO's window (eval_spec does neither).
        self.rollout_sde_type = cfg.sampling.sde_type if objective(cfg.algorithm.name).sde else "ode"
        self.spec = SamplingSpec.from_config(cfg, sde_type=self.rollout_sde_type, same_latent=cfg.sampling.same_latent,
                                             post_window_ode_steps=cfg.sampling.post_window_ode_steps)
        self.version = 0
        self.cursor = 0

    # -- identity --------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed: the model and the objective."""
        from diffusionrl.models.families import lora_suffixes

        cfg = self.cfg
        return {
            "model": cfg.model.name,
            "model_digest": self.worker.digest(),
            "algorithm": cfg.algorithm.name,
            "reward": dict(sorted(cfg.reward.weights.items())),
            "lora": {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha,
                     "targets": lora_suffixes(cfg.model)},
            "sde_type": self.rollout_sde_type,
        }

    # -- one step --------------------------------------------------------------------------------
    def sample_batch(self, step: int) -> tuple[list[str], torch.Tensor, torch.Tensor, np.ndarray, list[dict]]:
        """Prompts (each ``group_size`` times), group ids, per-sample seeds, SDE mask, metadata."""
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
        sampling_cfg = cfg.sampling
        mask = sde_step_mask(
            sampling_cfg.step_strategy,
            sampling_cfg.num_steps,
            group_seeds.generate_state(groups, dtype=np.uint32),
            num_sde_steps=sampling_cfg.num_sde_steps,
            window_range=sampling_cfg.window_range,
            candidate_steps=sampling_cfg.candidate_steps,
            epoch=step,
            seed=cfg.train.seed,
            shift_interval=sampling_cfg.window_shift_interval,
            stride=sampling_cfg.window_stride,
        )
        return prompts, group_ids, seeds, np.repeat(mask, k, axis=0), metadata

    def rollout(self, step: int) -> Trajectory:
        prompts, group_ids, seeds, mask, metadata = self.sample_batch(step)
        return self.worker.generate(prompts, group_ids, seeds, self.spec, mask, metadata)

    def score(self, traj: Trajectory) -> tuple[Trajectory, torch.Tensor, dict[str, float]]:
        total, parts = self.scorer(traj.images, traj.prompts, traj.metadata or [{}] * traj.batch_size)
        algo_cfg = self.cfg.algorithm
        rewards = torch.as_tensor(total, dtype=torch.float32)
        adv = group_advantages(rewards, traj.group_ids, global_std=algo_cfg.global_std, clip_max=algo_cfg.adv_clip_max)
        components = {n: torch.as_tensor(r.scores, dtype=torch.float32) for n, r in parts.items()}
        traj = traj.with_rewards(rewards, components, adv.advantages)
        metrics = reward_metrics(total, parts)
        metrics["rollout/zero_std/count"] = float(adv.zero_std_groups)
        return traj, adv.active, metrics

    def update(self, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]:
        return self.worker.train_step(traj, active, step)

    def push_weights(self, version: int) -> dict[str, float]:
        extra = self.worker.push_weights(version)
        self.version = version
        return extra

    def run_step(self, step: int) -> tuple[Trajectory, dict[str, float]]:
        # the held-out probe sees the weights the step's rollouts use (``step`` updates in)
        probed = self.probe(self.worker, step) if self.probe.due(step) else {}
        t0 = time.perf_counter()
        traj = self.rollout(step)
        t1 = time.perf_counter()
        traj, active, metrics = self.score(traj)
        t2 = time.perf_counter()
        metrics.update(self.update(traj, active, step))
        t3 = time.perf_counter()
        push_metrics = self.push_weights(step + 1)
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
        metrics.update(push_metrics)
        metrics.update(probed)
        every = self.cfg.train.log_images_every
        if every and (step + 1) % every == 0 and traj.images is not None:
            save_grid(traj.images, self.out_dir / "samples" / f"step-{step + 1:06d}.png",
                      cols=self.cfg.train.group_size)
        return traj, metrics

    # -- run lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.push_weights(0)

    def state(self, step: int) -> CheckpointState:
        extra = {"data_cursor": self.cursor, "config_digest": self.cfg.digest(), **self.worker.info()}
        return CheckpointState(step=step, policy_version=self.version, metadata=self.metadata(),
                               extra=extra, **self.worker.checkpoint_parts())

    def load_state(self, state: CheckpointState) -> None:
        self.worker.load_checkpoint_parts(state)
        self.cursor = int(state.extra.get("data_cursor", 0))
        self.push_weights(state.policy_version)

    def save_outputs(self, step: int) -> tuple[Path, dict[str, Path]]:
        info = {
            "base_model": self.cfg.model.name,
            "base_model_revision": self.cfg.model.revision,
            "base_model_digest": self.worker.digest(),
            "step": step,
            "algorithm": self.cfg.algorithm.name,
            "config_digest": self.cfg.digest(),
            **self.worker.info(),
        }
        return self.worker.save_lora(self.out_dir, info)

    def close(self) -> None:
        # the scorer's actors first: the worker's trainer ranks may have started the Ray they run in
        close = getattr(self.scorer, "close", None)
        if close:
            close()
        self.worker.close()


def save_grid(images: np.ndarray, path: Path, cols: int) -> Path:
    """uint8 ``[N, H, W, 3]`` -> one PNG grid with ``cols`` columns; videos ``[N, F, H, W, 3]`` -> one
    animated GIF of the grid (``path`` with suffix ``.gif``). Returns the path written."""
    return save_picture(grid(images, max(1, min(cols, len(images)))), path)
