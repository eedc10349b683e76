"""The Flow-GRPO objective (docs/algorithms.md sections 5-6) on the shared trainer.

Rollouts are SDE (or CPS) trajectories with per-step log-probs; one work unit per (micro-batch,
trained step), counted by its active samples. A micro-batch keeps the rollout's composition, so the
recomputed log-probs equal the recorded ones bit for bit before the first update.
"""

from __future__ import annotations

import numpy as np
import torch

from diffusionrl.algorithms.flow_grpo import flow_grpo_terms, ratio_stats
from diffusionrl.sampling import step_with_logprob
from diffusionrl.trajectory import Trajectory

from .policy import LoraPolicy
from .trainer import Trainer, Unit, UpdateStats, minibatch_schedule


class FlowGRPOObjective:
    """Flow-GRPO on recorded SDE trajectories: one unit per (micro-batch, trained step)."""

    name = "flow_grpo"

    def __init__(self, cfg, policy: LoraPolicy):
        self.cfg = cfg
        self.policy = policy
        self.adapter = policy.adapter

    def units(
        self,
        traj: Trajectory,
        chunks: list[slice],
        active: torch.Tensor,
        rng: np.random.Generator,
        diff_probe: dict | None = None,
    ) -> list[Unit]:
        """Work units of the given micro-batches, their step order shuffled by ``rng``.

        A micro-batch keeps the rollout's composition (all its samples go through the
        transformer together, inactive ones masked out of the loss) so the recomputed
        log-probs are those of the rollout, bit for bit.
        """
        units: list[Unit] = []
        for sl in chunks:
            pairs = traj.sde_mask[sl] & active[sl, None]  # [m, T]
            steps = [j for j in range(traj.num_steps) if bool(pairs[:, j].any())]
            for j in rng.permutation(steps) if steps else []:
                mask = pairs[:, int(j)]
                units.append(Unit(float(mask.sum()), self._make(traj, sl, int(j), mask, diff_probe)))
        return units

    def _make(self, traj: Trajectory, sl: slice, j: int, mask: torch.Tensor, diff_probe: dict | None):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            ac = self.cfg.algorithm
            device = self.adapter.device
            x = traj.latents[sl, j].to(device)
            x_next = traj.latents[sl, j + 1].to(device)
            cond = traj.conditioning.select(sl).to(device)
            sig, sig_next, sig_max = traj.sigmas[j], traj.sigmas[j + 1], traj.sigmas[1]
            step_kw = dict(sde_type=traj.sde_type, noise_level=traj.noise_level, sigma_max=sig_max, x_next=x_next)
            v = self.adapter.velocity(self.policy.model, x, traj.timesteps[j], cond, traj.guidance_scale)
            out = step_with_logprob(v, x, sig, sig_next, **step_kw)
            mean_ref = None
            if ac.kl_beta > 0:
                with torch.no_grad(), self.policy.reference():
                    v_ref = self.adapter.velocity(self.policy.model, x, traj.timesteps[j], cond, traj.guidance_scale)
                    mean_ref = step_with_logprob(v_ref, x, sig, sig_next, **step_kw).mean
            old = traj.log_probs[sl, j].to(device)
            adv = traj.advantages[sl].to(device)
            terms = flow_grpo_terms(
                out.log_prob, old, adv, clip_range=ac.clip_range, kl_beta=ac.kl_beta,
                mean_new=out.mean, mean_ref=mean_ref, std=out.std,
            )
            m = mask.to(device).float()
            new_m, old_m = out.log_prob.detach()[m > 0], old[m > 0]
            # Sums over the unit's active pairs; UpdateStats divides by the total count once.
            stats = ratio_stats(new_m, old_m, ac.clip_range)
            stats["policy_loss"] = (terms.policy_loss.detach() * m).sum()
            stats["kl_loss"] = (terms.kl.detach() * m).sum()
            stats["loss"] = (terms.loss.detach() * m).sum()
            if diff_probe is not None and diff_probe.get("open", False):
                diff_probe["sum"] = diff_probe.get("sum", 0.0) + float((new_m - old_m).abs().sum())
                diff_probe["count"] = diff_probe.get("count", 0) + int(m.sum())
            return (terms.loss * m).sum(), stats

        return compute

    @torch.no_grad()
    def recompute_log_prob_diff(self, traj: Trajectory) -> tuple[float, int]:
        """Mean ``|recomputed - recorded|`` log-prob over every SDE pair of ``traj`` with the current
        weights (the rollout's micro-batches, no update), and the number of pairs. Used to check
        an engine against the trainer: before any update it must be 0 (or fp32 noise)."""
        if traj.advantages is None:  # the loss needs advantages; their values do not matter here
            zeros = torch.zeros(traj.batch_size)
            traj = traj.with_rewards(zeros, {}, zeros)
        probe = {"open": True}
        everyone = torch.ones(traj.batch_size, dtype=torch.bool)
        for unit in self.units(traj, traj.micro_batches(), everyone, np.random.default_rng(0), probe):
            unit.compute()
        return probe["sum"] / probe["count"], probe["count"]

    def train_step(self, trainer: Trainer, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]:
        """Inner epochs x minibatches optimizer steps on one rollout batch.

        ``log_prob_old`` is always the rollout's. The micro-batch order is shuffled per epoch
        (composition kept); ``train/log_prob_mean_abs_diff`` is measured on every pair scored
        before the first optimizer step, when the policy still equals the rollout policy.
        """
        tc = self.cfg.train
        rng = np.random.default_rng([tc.seed, step, 0x5EED])
        stats = UpdateStats()
        probe = {"open": True}
        for _epoch, selected in minibatch_schedule(traj, tc, rng):
            trainer.apply(self.units(traj, selected, active, rng, probe), stats)
            probe["open"] = False
        metrics = stats.means()
        if probe.get("count"):
            metrics["train/log_prob_mean_abs_diff"] = probe["sum"] / probe["count"]
        metrics["train/lr"] = trainer.lr()
        return metrics
