"""GRPO on exact decoding traces: the objective, the old-policy snapshot and the update step.

Policy choice: the tiny model is **fully fine-tuned**; the reference is a frozen copy of the
initial weights (``frozen_copy``), which costs one extra copy of a 0.3 M-parameter model. A LoRA
policy (reference = adapter disabled) would plug into the same objective through the adapter.

Per committed token ``i`` of sample ``b`` (action at step ``s_i``; ``w_i`` its loss weight):

    ratio_i  = exp(log p_live(x_i | canvas_s) - log p_old(x_i | canvas_s))
    pg_i     = max(-A_b * ratio_i, -A_b * clip(ratio_i, 1 - eps, 1 + eps))
    kl_i     = KL(p_live(. | canvas_s) || p_ref(. | canvas_s)) at position i   (exact, over V)
    loss     = sum_i w_i * (pg_i + beta * kl_i) / sum_i w_i

All three policies score the *same* recorded canvases (``replay``), so ratio and KL are exact
rather than estimated from fresh random re-masking. The old policy is a snapshot of the live
weights taken at the start of the step: with ``inner_iterations > 1`` it stays those weights while
the live model moves. One work unit is one (micro-batch, step) forward/backward; its loss *sum* is
divided once by the total weight of the whole step (``docs/algorithms.md`` section 6), so the gradient
does not depend on how the batch was split.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from diffusionrl.training.trainer import Unit, UpdateStats

from .model import BDLMAdapter, frozen_copy
from .replay import replay_log_probs, replay_rows, steps_with_actions
from .trace import TraceBatch

log = logging.getLogger(__name__)

OBJECTIVE = "bdlm_grpo_exact_trace"


@dataclass
class TokenTerms:
    loss: torch.Tensor  # [...] pg + kl_beta * kl
    policy_loss: torch.Tensor  # [...]
    kl: torch.Tensor  # [...]
    ratio: torch.Tensor  # [...]


def grpo_token_terms(log_prob_new: torch.Tensor, log_prob_old: torch.Tensor, advantages: torch.Tensor,
                     kl: torch.Tensor, *, clip_range: float, kl_beta: float) -> TokenTerms:
    """Clipped surrogate plus ``kl_beta * kl`` per token (all arguments broadcast together)."""
    ratio = torch.exp(log_prob_new - log_prob_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped)
    return TokenTerms(policy_loss + kl_beta * kl, policy_loss, kl, ratio)


def categorical_kl(log_p: torch.Tensor, log_q: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``[B, L]`` exact ``KL(p || q)`` of each position's proposal distribution over ``V``.

    The MASK column is -inf in both (never proposed) and is dropped rather than computed as
    ``0 * (-inf - -inf)``, which would be nan.
    """
    keep = torch.ones(log_p.shape[-1], dtype=torch.bool)
    keep[mask_id] = False
    lp, lq = log_p[..., keep], log_q[..., keep]  # [B, L, V-1]
    return (lp.exp() * (lp - lq)).sum(-1)


class OldPolicy:
    """A frozen snapshot of the live weights, taken at the start of an RL step.

    Its scores of a trace are computed once and reused by every inner iteration; they stay the
    start-of-step scores whatever the live model does afterwards.
    """

    def __init__(self, live: BDLMAdapter):
        self.adapter = frozen_copy(live)
        self._cache: dict[int, torch.Tensor] = {}

    def scores(self, trace: TraceBatch, micro_batch_size: int) -> torch.Tensor:
        key = id(trace)
        if key not in self._cache:
            self._cache[key] = replay_log_probs(self.adapter, trace, micro_batch_size)  # [B, L]
        return self._cache[key]


def apply_units(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], units: list[Unit],
                stats: UpdateStats, max_grad_norm: float) -> bool:
    """Backward ``sum(loss) / total weight`` of all units, clip, one optimizer step.

    Returns False (weights untouched, skip counted) when a loss or the gradient norm is not finite.
    """
    optimizer.zero_grad(set_to_none=True)
    if not units or not accumulate(units, stats):
        if units:
            log.warning("non-finite loss: optimizer step skipped")
            stats.skipped += 1
        optimizer.zero_grad(set_to_none=True)
        return False
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf))
    if not math.isfinite(grad_norm):
        log.warning("non-finite gradient norm: optimizer step skipped")
        optimizer.zero_grad(set_to_none=True)
        stats.skipped += 1
        return False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats.grad_norms.append(grad_norm)
    stats.steps += 1
    return True


def accumulate(units: list[Unit], stats: UpdateStats) -> bool:
    """Backward every unit's loss sum divided by the total weight of all units (no step)."""
    total = sum(u.count for u in units)
    for unit in units:
        loss_sum, unit_stats = unit.compute()
        if not torch.isfinite(loss_sum):
            return False
        (loss_sum / total).backward()
        for key, value in unit_stats.items():
            stats.add(key, float(value), unit.count)
    return True


class TraceGRPO:
    """The objective: work units of a trace, scored by live, reference and old policies."""

    name = OBJECTIVE

    def __init__(self, cfg, live: BDLMAdapter, reference: BDLMAdapter | None):
        self.cfg = cfg  # a GRPOConfig
        self.live = live
        self.reference = reference
        if cfg.kl_beta > 0 and reference is None:
            raise ValueError("grpo.kl_beta > 0 needs a reference model; pass one or set kl_beta=0")

    def units(self, trace: TraceBatch, old_log_probs: torch.Tensor, weights: torch.Tensor) -> list[Unit]:
        """One unit per (micro-batch, step with a weighted action); ``weights`` is ``[B, L]``."""
        if trace.advantages is None:
            raise ValueError("the trace has no advantages: score it (with_rewards) before training on it")
        units = []
        for rows in trace.micro_batches(self.cfg.micro_batch_size):
            steps = trace.action_steps[rows]
            for step in steps_with_actions(steps):
                w = torch.where(steps == step, weights[rows], torch.zeros(()))  # [m, L]
                if float(w.sum()) > 0:
                    units.append(Unit(float(w.sum()), self._make(trace, rows, step, w, old_log_probs[rows])))
        return units

    def _make(self, trace: TraceBatch, rows: slice, step: int, w: torch.Tensor, old: torch.Tensor):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            cfg = self.cfg
            new = replay_rows(self.live, trace, rows, step)
            kl = torch.zeros_like(new.token_log_probs)
            if cfg.kl_beta > 0:
                with torch.no_grad():
                    ref = replay_rows(self.reference, trace, rows, step)
                kl = categorical_kl(new.log_probs, ref.log_probs, trace.vocab.mask)  # [m, L]
            adv = trace.advantages[rows, None]  # [m, 1]
            terms = grpo_token_terms(new.token_log_probs, old, adv, kl, clip_range=cfg.clip_range, kl_beta=cfg.kl_beta)
            on = w > 0
            zero = torch.zeros(())

            def wsum(x: torch.Tensor) -> torch.Tensor:  # weighted sum over active tokens, nan-proof
                return torch.where(on, x * w, zero).sum()

            with torch.no_grad():
                diff = new.token_log_probs.detach() - old
                stats = {
                    "loss": wsum(terms.loss.detach()),
                    "policy_loss": wsum(terms.policy_loss.detach()),
                    "kl_loss": wsum(terms.kl.detach()),
                    "approx_kl": wsum(0.5 * diff**2),
                    "clipfrac": wsum(((terms.ratio.detach() - 1).abs() > cfg.clip_range).float()),
                    "ratio_abs_minus_1": wsum((terms.ratio.detach() - 1).abs()),
                }
            return wsum(terms.loss), stats

        return compute

    def train_step(self, optimizer: torch.optim.Optimizer, trace: TraceBatch, active: torch.Tensor) -> dict[str, float]:
        """``inner_iterations`` optimizer steps on one scored trace; ``active`` ``[B]`` drops
        zero-std groups. Returns ``train/*`` metrics (``first_*``: before any update)."""
        cfg = self.cfg
        old = OldPolicy(self.live).scores(trace, cfg.micro_batch_size)  # [B, L] start-of-step snapshot
        weights = trace.loss_weights * active[:, None].float()  # [B, L]
        params = [p for p in self.live.module.parameters() if p.requires_grad]
        stats, first = UpdateStats(), UpdateStats()
        for it in range(cfg.inner_iterations):
            units = self.units(trace, old, weights)
            apply_units(optimizer, params, units, first if it == 0 else stats, cfg.max_grad_norm)
            if it == 0:
                _merge(stats, first)
        metrics = stats.means()
        metrics.update({k.replace("train/", "train/first_"): v for k, v in first.means().items()
                        if k in ("train/approx_kl", "train/ratio_abs_minus_1")})
        committed = trace.action_steps >= 0
        if bool(committed.any()):
            metrics["train/log_prob_mean_abs_diff"] = float((old - trace.log_probs)[committed].abs().mean())
        metrics["train/lr"] = float(optimizer.param_groups[0]["lr"])
        metrics["train/active_tokens"] = float(weights.sum())
        return metrics


def _merge(into: UpdateStats, other: UpdateStats) -> None:
    for key in other.sums:
        into.add(key, other.sums[key], other.counts[key])
    into.grad_norms.extend(other.grad_norms)
    into.skipped += other.skipped
    into.steps += other.steps
