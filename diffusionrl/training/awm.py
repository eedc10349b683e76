"""The Advantage Weighted Matching objective (docs/algorithms.md section 14.4) on the shared trainer.

Rollouts are deterministic (ODE) samples of the live policy; only their clean latents ``x0`` are
used, so the solver does not matter. Each sample is re-noised at T-1 of the rollout's T noise
levels in a random order, with fresh noise, exactly as DiffusionNFT draws them (``nft.TimestepPlan``:
per sample (per prompt group with ``algorithm.group_renoise``), seeded by ``(train.seed, step, inner epoch,
sample index or group id)``, independent of the split).
One work unit per (micro-batch, slot), counted by the micro-batch's active samples; micro-batches
keep the rollout's composition. No old policy: every update is on the policy that sampled.
"""

from __future__ import annotations

import numpy as np
import torch

from diffusionrl.algorithms.awm import awm_terms
from diffusionrl.trajectory import Trajectory

from .nft import RenoisedUnits, TimestepPlan
from .policy import LoraPolicy
from .trainer import Trainer, UpdateStats, minibatch_schedule

_ORDER_STREAM = 0x41574D  # "AWM": the micro-batch order of a step


class AWMObjective(RenoisedUnits):
    """Advantage-weighted flow matching on the clean latents of ODE rollouts."""

    name = "awm"
    label = "AWM"

    def __init__(self, cfg, policy: LoraPolicy):
        self.cfg = cfg
        self.policy = policy
        self.adapter = policy.adapter
        self.num_train_timesteps = float(self.adapter.scheduler.config.num_train_timesteps)

    def _make(self, traj: Trajectory, sl: slice, slot: int, mask: torch.Tensor, plan: TimestepPlan):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            ac = self.cfg.algorithm
            device = self.adapter.device
            x0, eps, t, x_t = self.noised(traj, sl, slot, plan)
            cond = traj.conditioning.select(sl).to(device)
            timestep = t * self.num_train_timesteps
            v = self.adapter.velocity(self.policy.model, x_t, timestep, cond, traj.guidance_scale)
            v_ref = None
            if ac.kl_beta > 0:
                with torch.no_grad(), self.policy.reference():
                    v_ref = self.adapter.velocity(self.policy.model, x_t, timestep, cond, traj.guidance_scale)
            terms = awm_terms(v, x0, eps, traj.advantages[sl].to(device), kl_beta=ac.kl_beta, v_ref=v_ref)
            m = mask.to(device).float()
            with torch.no_grad():  # sums over the active samples; the trainer divides by the counts
                stats = {
                    "policy_loss": (terms.policy_loss.detach() * m).sum(),
                    "awm_fm_error": (terms.fm_error.detach() * m).sum(),
                    "kl_loss": (terms.kl.detach() * m).sum(),
                    "loss": (terms.loss.detach() * m).sum(),
                }
            return (terms.loss * m).sum(), stats

        return compute

    def train_step(self, trainer: Trainer, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]:
        """Inner epochs x minibatches optimizer steps; each inner epoch draws fresh timesteps and noises."""
        tc = self.cfg.train
        rng = np.random.default_rng([_ORDER_STREAM, tc.seed, step])
        stats = UpdateStats()
        plan = None
        for epoch, selected in minibatch_schedule(traj, tc, rng):
            if plan is None or plan.epoch != epoch:
                plan = self.plan(traj, step, epoch)
            trainer.apply(self.units(traj, selected, active, plan), stats)
        metrics = stats.means()
        metrics["train/lr"] = trainer.lr()
        return metrics
