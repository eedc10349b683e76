"""The Flow-GRPO objective (docs/algorithms.md sections 5-6) on the shared trainer.

Rollouts are SDE (or CPS) trajectories with per-step log-probs; one work unit per (micro-batch,
trained step), counted by its active samples. A micro-batch keeps the rollout's composition, so the
recomputed log-probs equal the recorded ones bit for bit before the first update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from diffusionrl.algorithms.flow_grpo import flow_grpo_terms, ratio_stats
from diffusionrl.algorithms.kl import gaussian_kl, velocity_kl
from diffusionrl.algorithms.sde import StepOutput, step_with_logprob
from diffusionrl.config import resolved_kl_space
from diffusionrl.trajectory import Trajectory

from .policy import LoraPolicy
from .trainer import Trainer, Unit, UpdateStats, minibatch_schedule, unit_expert


@dataclass
class StepEval:
    """The forwards of one (micro-batch, step) unit: what the per-pair losses are made of."""

    out: StepOutput  # the live policy's step on the recorded transition (gradient through out.mean)
    v: torch.Tensor  # [m, C, H, W] live velocity
    dt: torch.Tensor  # [m] sigma_next - sigma (< 0)
    v_ref: torch.Tensor | None = None  # LoRA disabled (kl_beta > 0), no gradient
    mean_ref: torch.Tensor | None = None
    v_old: torch.Tensor | None = None  # the rollout policy's (objectives with needs_old), no gradient
    mean_old: torch.Tensor | None = None


@dataclass
class PairTerms:
    """Per-pair ``[m]`` values of one unit; ``extra`` holds logged per-pair statistics (they replace
    the ratio statistics of the same name)."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


class FlowGRPOObjective:
    """Flow-GRPO on recorded SDE trajectories: one unit per (micro-batch, trained step).

    Subclasses (GRPO-Guard, Flow-DPPO) replace ``pair_terms``; with ``needs_old`` every unit also
    gets the rollout policy's velocity and step mean: the live ones (detached) while the live policy
    still is the rollout policy, else a forward with the step's starting LoRA copied in.
    """

    name = "flow_grpo"
    needs_old = False

    def __init__(self, cfg, policy: LoraPolicy):
        self.cfg = cfg
        self.policy = policy
        self.adapter = policy.adapter
        self.kl_space = resolved_kl_space(cfg.algorithm)
        self.old_state: dict[str, torch.Tensor] | None = None  # set once the live policy has moved in a step

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
                units.append(Unit(float(mask.sum()), self._make(traj, sl, int(j), mask, diff_probe),
                                  unit_expert(self.adapter, traj.timesteps[int(j)])))
        return units

    def evaluate(self, traj: Trajectory, sl: slice, j: int) -> StepEval:
        """The live forward of step ``j`` of micro-batch ``sl`` (and the reference / old ones)."""
        algo_cfg = self.cfg.algorithm
        device = self.adapter.device
        x = traj.latents[sl, j].to(device)
        cond = traj.conditioning.select(sl).to(device)
        sig, sig_next = traj.sigmas[j], traj.sigmas[j + 1]
        step_kw = dict(sde_type=traj.sde_type, noise_level=traj.noise_level, sigma_max=traj.sigmas[1],
                       x_next=traj.latents[sl, j + 1].to(device))

        def velocity() -> torch.Tensor:
            return self.adapter.velocity(self.policy.model, x, traj.timesteps[j], cond, *traj.guidance)

        v_old = mean_old = None
        if self.needs_old and self.old_state is not None:  # before the live forward: its graph must stay intact
            with torch.no_grad(), self.policy.swapped(self.old_state):
                v_old = velocity()
                mean_old = step_with_logprob(v_old, x, sig, sig_next, **step_kw).mean
        v = velocity()
        out = step_with_logprob(v, x, sig, sig_next, **step_kw)
        if self.needs_old and v_old is None:  # the live policy is the rollout policy
            v_old, mean_old = v.detach(), out.mean.detach()
        v_ref = mean_ref = None
        if algo_cfg.kl_beta > 0:
            with torch.no_grad(), self.policy.reference():
                v_ref = velocity()
                mean_ref = step_with_logprob(v_ref, x, sig, sig_next, **step_kw).mean
        dt = torch.full((x.shape[0],), float(sig_next - sig), device=device)
        return StepEval(out, v, dt, v_ref, mean_ref, v_old, mean_old)

    def reference_kl(self, step_eval: StepEval) -> torch.Tensor | None:
        """The KL term to the reference in ``algorithm.kl_space`` (None without a reference)."""
        if step_eval.v_ref is None:
            return None
        if self.kl_space == "v":
            return velocity_kl(step_eval.v, step_eval.v_ref)
        # section 5's term (std without sqrt(-dt))
        return gaussian_kl(step_eval.out.mean, step_eval.mean_ref, step_eval.out.std)

    def pair_terms(self, step_eval: StepEval, log_prob_old: torch.Tensor, advantages: torch.Tensor) -> PairTerms:
        algo_cfg = self.cfg.algorithm
        terms = flow_grpo_terms(step_eval.out.log_prob, log_prob_old, advantages, clip_range=algo_cfg.clip_range,
                                kl_beta=algo_cfg.kl_beta, kl=self.reference_kl(step_eval))
        return PairTerms(terms.loss, terms.policy_loss, terms.kl)

    def _make(self, traj: Trajectory, sl: slice, j: int, mask: torch.Tensor, diff_probe: dict | None):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            device = self.adapter.device
            step_eval = self.evaluate(traj, sl, j)
            old = traj.log_probs[sl, j].to(device)
            terms = self.pair_terms(step_eval, old, traj.advantages[sl].to(device))
            m = mask.to(device).float()
            new_m, old_m = step_eval.out.log_prob.detach()[m > 0], old[m > 0]
            # Sums over the unit's active pairs; UpdateStats divides by the total count once.
            stats = ratio_stats(new_m, old_m, self.cfg.algorithm.clip_range)
            stats.update({k: (value.detach() * m).sum() for k, value in terms.extra.items()})
            stats["policy_loss"] = (terms.policy_loss.detach() * m).sum()
            stats["kl_loss"] = (terms.kl.detach() * m).sum()
            stats["loss"] = (terms.loss.detach() * m).sum()
            if diff_probe is not None and diff_probe.get("open", False):  # the policy still is the rollout's
                stats["log_prob_mean_abs_diff"] = (new_m - old_m).abs().sum()
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
        everyone = torch.ones(traj.batch_size, dtype=torch.bool)
        total, count = 0.0, 0
        for unit in self.units(traj, traj.micro_batches(), everyone, np.random.default_rng(0), {"open": True}):
            total += float(unit.compute()[1]["log_prob_mean_abs_diff"])
            count += int(unit.count)
        return total / count, count

    def train_step(self, trainer: Trainer, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]:
        """Inner epochs x minibatches optimizer steps on one rollout batch.

        ``log_prob_old`` is always the rollout's. The micro-batch order is shuffled per epoch
        (composition kept); ``train/log_prob_mean_abs_diff`` is measured on every pair scored
        before the first optimizer step, when the policy still equals the rollout policy.
        """
        train_cfg = self.cfg.train
        rng = np.random.default_rng([train_cfg.seed, step, 0x5EED])
        stats = UpdateStats()
        probe = {"open": True}
        rollout_state = self.policy.lora_state() if self.needs_old else None
        self.old_state = None
        try:
            for _epoch, selected in minibatch_schedule(traj, train_cfg, rng):
                if trainer.apply(self.units(traj, selected, active, rng, probe), stats) and self.needs_old:
                    self.old_state = rollout_state  # the live policy has left the rollout policy
                probe["open"] = False
        finally:
            self.old_state = None
        metrics = trainer.global_stats(stats).means()  # train/log_prob_mean_abs_diff: the first step's pairs
        metrics["train/lr"] = trainer.lr()
        return metrics
