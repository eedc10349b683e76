"""Policy updates with exact gradient accumulation (docs/algorithms.md sections 5-6).

``Trainer`` owns what every objective shares: the optimizer, the grad scaler, clipping, the NaN
guard, the EMA and the accumulation rule. An objective turns a rollout batch into *work units*
(one forward/backward each) and says how many loss terms each unit contributes; the trainer sums
every unit's loss and divides once by the step's total count, so the gradient does not depend on
how the batch was split into micro-batches.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from diffusionrl.algorithms.flow_grpo import flow_grpo_terms, ratio_stats
from diffusionrl.sampling import step_with_logprob
from diffusionrl.trajectory import Trajectory

from .policy import EMA, LoraPolicy

log = logging.getLogger(__name__)


@dataclass
class Unit:
    """One forward/backward: ``compute()`` returns the *sum* of its loss terms and stat sums."""

    count: float  # number of loss terms this unit adds to the step's denominator
    compute: Callable[[], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class UpdateStats:
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0  # optimizer steps skipped for non-finite loss/gradients
    steps: int = 0

    def add(self, name: str, value: float, count: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)

    def means(self, prefix: str = "train/") -> dict[str, float]:
        out = {f"{prefix}{k}": self.sums[k] / self.counts[k] for k in self.sums if self.counts[k] > 0}
        out[f"{prefix}grad_norm"] = float(np.mean(self.grad_norms)) if self.grad_norms else 0.0
        out[f"{prefix}skipped_updates"] = float(self.skipped)
        out[f"{prefix}optimizer_steps"] = float(self.steps)
        return out


class Trainer:
    """Optimizer, scaler, clipping, NaN guard and EMA around an objective's work units."""

    def __init__(self, cfg, policy: LoraPolicy):
        self.cfg = cfg
        self.policy = policy
        tc = cfg.train
        self.optimizer = torch.optim.AdamW(
            policy.parameters(),
            lr=tc.learning_rate,
            betas=(tc.adam_beta1, tc.adam_beta2),
            weight_decay=tc.weight_decay,
            eps=1e-8,
        )
        device_type = policy.adapter.device.type
        self.scaler = torch.amp.GradScaler(device_type, enabled=tc.mixed_precision == "fp16")
        self.ema = EMA(policy.lora_state(), tc.ema_decay) if tc.ema else None

    def accumulate(self, units: list[Unit], stats: UpdateStats, prefix: str = "") -> bool:
        """Backward ``sum(loss) / total_count`` of every unit into ``.grad`` (no optimizer step).

        Returns False as soon as a loss is not finite (gradients are then partial: discard them).
        """
        total = sum(u.count for u in units)
        for unit in units:
            loss_sum, unit_stats = unit.compute()
            if not torch.isfinite(loss_sum):
                return False
            self.scaler.scale(loss_sum / total).backward()
            for key, value in unit_stats.items():
                stats.add(prefix + key, float(value), unit.count)
        return True

    def apply(self, units: Iterable[Unit], stats: UpdateStats, prefix: str = "") -> bool:
        """Accumulate all units, then one optimizer step.

        Returns False (and leaves the weights untouched) when a loss or the gradient norm is
        not finite; the skip is counted in ``stats.skipped``.
        """
        units = list(units)
        if sum(u.count for u in units) <= 0:
            return False
        self.optimizer.zero_grad(set_to_none=True)
        if not self.accumulate(units, stats, prefix):
            log.warning("non-finite loss: optimizer step skipped")
            self.optimizer.zero_grad(set_to_none=True)
            stats.skipped += 1
            return False
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.max_grad_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm))
        return self.step_optimizer(grad_norm, stats)

    def step_optimizer(self, grad_norm: float, stats: UpdateStats) -> bool:
        """After unscaling and clipping: one optimizer (and EMA) step, or a counted skip when the
        gradient norm is not finite (the scaler still sees the inf and lowers its scale)."""
        if not math.isfinite(grad_norm):
            log.warning("non-finite gradient norm: optimizer step skipped")
            if self.scaler.is_enabled():
                self.scaler.step(self.optimizer)  # records the inf and skips the step
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            stats.skipped += 1
            return False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        stats.grad_norms.append(grad_norm)
        stats.steps += 1
        if self.ema is not None:
            self.ema.update(self.policy.params)
        return True

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def minibatch_schedule(traj: Trajectory, train_cfg, rng: np.random.Generator) -> Iterator[tuple[int, list[slice]]]:
    """``(inner epoch, micro-batches of one optimizer step)`` for ``inner_epochs x minibatches``.

    The micro-batch order is shuffled by ``rng`` at the start of each epoch; each micro-batch
    keeps the rollout's composition.
    """
    chunks = traj.micro_batches()
    per_mb = len(chunks) // train_cfg.minibatches
    for epoch in range(train_cfg.inner_epochs):
        order = rng.permutation(len(chunks))
        for k in range(train_cfg.minibatches):
            yield epoch, [chunks[i] for i in order[k * per_mb : (k + 1) * per_mb]]


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
