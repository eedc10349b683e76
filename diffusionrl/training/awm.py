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

import torch

from diffusionrl.algorithms.awm import awm_terms
from diffusionrl.trajectory import Trajectory

from .nft import RenoisedUnits, TimestepPlan


class AWMObjective(RenoisedUnits):
    """Advantage-weighted flow matching on the clean latents of ODE rollouts."""

    name = "awm"
    label = "AWM"
    order_stream = 0x41574D  # "AWM": the micro-batch order of a step

    def _make(self, traj: Trajectory, sl: slice, slot: int, mask: torch.Tensor, plan: TimestepPlan):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            algo_cfg = self.cfg.algorithm
            device = self.adapter.device
            x0, eps, t, x_t = self.noised(traj, sl, slot, plan)
            cond = traj.conditioning.select(sl).to(device)
            timestep = t * self.num_train_timesteps
            v = self.adapter.velocity(self.policy.model, x_t, timestep, cond, *traj.guidance)
            v_ref = None
            if algo_cfg.kl_beta > 0:
                with torch.no_grad(), self.policy.reference():
                    v_ref = self.adapter.velocity(self.policy.model, x_t, timestep, cond, *traj.guidance)
            terms = awm_terms(v, x0, eps, traj.advantages[sl].to(device), kl_beta=algo_cfg.kl_beta, v_ref=v_ref)
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
