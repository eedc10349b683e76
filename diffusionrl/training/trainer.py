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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from diffusionrl.trajectory import Trajectory

from .policy import EMA, LoraPolicy

log = logging.getLogger(__name__)


@dataclass
class Unit:
    """One forward/backward: ``compute()`` returns the *sum* of its loss terms and stat sums."""

    count: float  # number of loss terms this unit adds to the step's denominator
    compute: Callable[[], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    expert: str | None = None  # the Wan2.2 expert its forwards run (``unit_expert``); None: one transformer


def unit_expert(adapter, timesteps) -> str | None:
    """The expert every forward of a unit at ``timesteps`` runs (``WanExperts.expert``: raises when they
    straddle its boundary); None for a model with one transformer."""
    experts = getattr(adapter, "experts", None)
    return None if experts is None else experts.expert(timesteps)


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
        train_cfg = cfg.train
        self.optimizer = torch.optim.AdamW(
            policy.parameters(),
            lr=train_cfg.learning_rate,
            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
            weight_decay=train_cfg.weight_decay,
            eps=1e-8,
        )
        device_type = policy.adapter.device.type
        self.scaler = torch.amp.GradScaler(device_type, enabled=train_cfg.mixed_precision == "fp16")
        self.ema = EMA(policy.lora_state(), train_cfg.ema_decay) if train_cfg.ema else None
        self.schedule = lr_schedule(self.optimizer, train_cfg)

    def begin_step(self, step: int) -> None:
        """Set the learning rate of run step ``step`` (0-based, ``train.lr_schedule``): the schedule's
        value after ``step + 1`` steps, so warm-up starts at ``learning_rate / lr_warmup_steps`` (not at 0)
        and a cosine run's last step trains at ``learning_rate * lr_min_ratio``. It is a function of the
        step alone (and of ``train.steps``), so a resumed run steps at the rates of an uninterrupted one."""
        lr = self.cfg.train.learning_rate * self.schedule.lr_lambdas[0](step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def accumulate(self, units: list[Unit], stats: UpdateStats, prefix: str = "") -> bool:
        """Backward ``sum(loss) / total_count`` of every unit into ``.grad`` (no optimizer step).

        Returns False as soon as a loss is not finite (gradients are then partial: discard them).
        """
        total = sum(u.count for u in units)
        for unit in units:
            loss_sum, unit_stats = unit.compute()
            if not torch.isfinite(loss_sum):
                return False
            if loss_sum.requires_grad:  # else no trained tensor reaches it (a step of the Wan2.2 expert
                self.scaler.scale(loss_sum / total).backward()  # without a LoRA): its gradient is exactly 0
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

    def global_stats(self, stats: UpdateStats) -> UpdateStats:
        """``stats`` over every rank that trains this step (one process: ``stats`` itself); objectives
        call it before ``stats.means()``."""
        return stats


def lr_schedule(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' schedule for ``train.lr_schedule`` over ``train.steps`` (constant, with or without
    warm-up; cosine to ``lr_min_ratio``). Only its per-step factors are used (``Trainer.begin_step``):
    it is never stepped, so it holds no state a checkpoint must carry."""
    from transformers import get_scheduler

    if train_cfg.lr_schedule == "cosine":
        return get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=train_cfg.lr_warmup_steps,
                             num_training_steps=train_cfg.steps,
                             scheduler_specific_kwargs={"min_lr_rate": train_cfg.lr_min_ratio})
    name = "constant_with_warmup" if train_cfg.lr_warmup_steps else "constant"
    return get_scheduler(name, optimizer, num_warmup_steps=train_cfg.lr_warmup_steps or None)


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
