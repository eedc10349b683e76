"""GRPO and its family (``objectives``: dapo, dr_grpo, opd) on exact decoding traces: the
objective, the old-policy snapshot and the update step. A trace is anything with the learner
interface (``micro_batches``, ``unit_keys``, ``unit_mask``, ``score_unit``, ``log_probs``,
``loss_weights``): the built-in sampler's ``TraceBatch`` or DiffusionGemma's ``CanvasTrace``.

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
from .objectives import OBJECTIVES, categorical_kl, clipped_surrogate, distillation_terms, entropy, reduce_metrics
from .replay import replay_log_probs
from .trace import TraceBatch

__all__ = ["OBJECTIVE", "OldPolicy", "TraceGRPO", "categorical_kl", "grpo_token_terms"]

log = logging.getLogger(__name__)

OBJECTIVE = OBJECTIVES["grpo"]  # the default objective's checkpoint name


@dataclass
class TokenTerms:
    loss: torch.Tensor  # [...] pg + kl_beta * kl
    policy_loss: torch.Tensor  # [...]
    kl: torch.Tensor  # [...]
    ratio: torch.Tensor  # [...]


def grpo_token_terms(log_prob_new: torch.Tensor, log_prob_old: torch.Tensor, advantages: torch.Tensor,
                     kl: torch.Tensor, *, clip_range: float, kl_beta: float,
                     clip_range_high: float | None = None) -> TokenTerms:
    """Clipped surrogate (``[1 - clip_range, 1 + clip_range_high]``, symmetric by default) plus
    ``kl_beta * kl`` per token (all arguments broadcast together)."""
    high = clip_range if clip_range_high is None else clip_range_high
    policy_loss, ratio = clipped_surrogate(log_prob_new, log_prob_old, advantages, clip_low=clip_range, clip_high=high)
    return TokenTerms(policy_loss + kl_beta * kl, policy_loss, kl, ratio)


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
                stats: UpdateStats, max_grad_norm: float, denominator: float | None = None) -> bool:
    """Backward ``sum(loss) / total weight`` of all units, clip, one optimizer step.

    Returns False (weights untouched, skip counted) when a loss or the gradient norm is not finite.
    """
    optimizer.zero_grad(set_to_none=True)
    if not units or not accumulate(units, stats, denominator):
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


def accumulate(units: list[Unit], stats: UpdateStats, denominator: float | None = None) -> bool:
    """Backward every unit's loss sum divided by ``denominator`` (default: the total weight of all
    units; ``dr_grpo`` passes a constant) (no step)."""
    total = denominator or sum(u.count for u in units)
    for unit in units:
        loss_sum, unit_stats = unit.compute()
        if not torch.isfinite(loss_sum):
            return False
        (loss_sum / total).backward()
        for key, value in unit_stats.items():
            stats.add(key, float(value), unit.count)
    return True


class TraceGRPO:
    """The objective (``cfg.objective``: grpo | dapo | dr_grpo | opd): work units of a trace,
    scored by the live, reference, old and (opd) teacher policies."""

    def __init__(self, cfg, live: BDLMAdapter, reference: BDLMAdapter | None, teacher: BDLMAdapter | None = None):
        self.cfg = cfg  # a GRPOConfig
        self.objective = cfg.objective
        self.name = OBJECTIVES[cfg.objective]
        self.live = live
        self.reference = reference
        self.teacher = teacher
        if cfg.kl_beta > 0 and reference is None:
            raise ValueError("grpo.kl_beta > 0 needs a reference model; pass one or set kl_beta=0")
        if self.objective == "opd" and teacher is None:
            raise ValueError("grpo.objective=opd needs a teacher model (grpo.teacher: a model folder)")
        if teacher is not None and any(p.requires_grad for p in teacher.module.parameters()):
            raise ValueError("the teacher must be frozen (frozen_copy): it is never updated")
        self.clip_high = (cfg.clip_range_high or cfg.clip_range) if self.objective == "dapo" else cfg.clip_range

    def units(self, trace, old_log_probs: torch.Tensor, weights: torch.Tensor) -> list[Unit]:
        """One unit per (micro-batch, replay unit with a weighted action); ``weights`` is ``[B, A]``."""
        if trace.advantages is None and self.objective != "opd":
            raise ValueError("the trace has no advantages: score it (with_rewards) before training on it")
        units = []
        for rows in trace.micro_batches(self.cfg.micro_batch_size):
            for key in trace.unit_keys(rows):
                w = torch.where(trace.unit_mask(rows, key), weights[rows], torch.zeros(()))  # [m, A]
                if float(w.sum()) > 0:
                    units.append(Unit(float(w.sum()), self._make(trace, rows, key, w, old_log_probs[rows])))
        return units

    def _score(self, adapter, trace, rows, key, grad: bool):
        with torch.set_grad_enabled(grad):
            return trace.score_unit(adapter, rows, key)

    def _make(self, trace, rows: slice, key: int, w: torch.Tensor, old: torch.Tensor):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            cfg = self.cfg
            new = self._score(self.live, trace, rows, key, True)
            wc, oc = w[:, new.cols], old[:, new.cols]  # [m, K]
            kl = torch.zeros_like(new.token_log_probs)
            if cfg.kl_beta > 0:
                ref = self._score(self.reference, trace, rows, key, False)
                kl = categorical_kl(new.log_probs, ref.log_probs, trace.excluded_token)  # [m, K]
            extra = {}
            if self.objective == "opd":
                teach = self._score(self.teacher, trace, rows, key, False)
                policy_loss, dkl = distillation_terms(new.log_probs, teach.log_probs,
                                                      rollout_temperature=trace.temperature, tau=cfg.opd_temperature,
                                                      hard_ce=cfg.opd_hard_ce, excluded=trace.excluded_token)
                ratio = torch.exp(new.token_log_probs - oc)
                extra["distill_kl"] = dkl.detach()
            else:
                adv = trace.advantages[rows, None]  # [m, 1]
                policy_loss, ratio = clipped_surrogate(new.token_log_probs, oc, adv, clip_low=cfg.clip_range,
                                                       clip_high=self.clip_high)
            loss = policy_loss + cfg.kl_beta * kl
            on = wc > 0
            zero = torch.zeros(())

            def wsum(x: torch.Tensor) -> torch.Tensor:  # weighted sum over active tokens, nan-proof
                return torch.where(on, x * wc, zero).sum()

            with torch.no_grad():
                diff = new.token_log_probs.detach() - oc
                r = ratio.detach()
                outside = (r < 1 - cfg.clip_range) | (r > 1 + self.clip_high)
                stats = {"loss": wsum(loss.detach()), "policy_loss": wsum(policy_loss.detach()),
                         "kl_loss": wsum(kl.detach()), "approx_kl": wsum(0.5 * diff**2),
                         "clipfrac": wsum(outside.float()), "ratio_abs_minus_1": wsum((r - 1).abs()),
                         "entropy": wsum(entropy(new.log_probs.detach()))}
                stats.update({k: wsum(v) for k, v in extra.items()})
            return wsum(loss), stats

        return compute

    def denominator(self, trace) -> float | None:
        """``dr_grpo``: the constant ``B * G`` (no length normalisation); others: the step's weight."""
        return float(trace.batch_size * trace.generation_length) if self.objective == "dr_grpo" else None

    def train_step(self, optimizer: torch.optim.Optimizer, trace, active: torch.Tensor) -> dict[str, float]:
        """``inner_iterations`` optimizer steps on one scored trace; ``active`` ``[B]`` drops rows
        (zero-variance groups for grpo/dapo). Returns ``train/*`` metrics (``first_*``: before any
        update), token metrics weighted globally, per-optimizer-step ones averaged."""
        cfg = self.cfg
        old = OldPolicy(self.live).scores(trace, cfg.micro_batch_size)  # [B, A] start-of-step snapshot
        weights = trace.loss_weights * active[:, None].float()  # [B, A]
        params = [p for p in self.live.module.parameters() if p.requires_grad]
        stats, first = UpdateStats(), UpdateStats()
        for it in range(cfg.inner_iterations):
            units = self.units(trace, old, weights)
            apply_units(optimizer, params, units, first if it == 0 else stats, cfg.max_grad_norm,
                        self.denominator(trace))
            if it == 0:
                _merge(stats, first)
        metrics = reduce_metrics({f"train/{k}": [(stats.sums[k], stats.counts[k])] for k in stats.sums},
                                 {"train/grad_norm": stats.grad_norms})
        metrics.setdefault("train/grad_norm", 0.0)
        metrics.update({"train/skipped_updates": float(stats.skipped), "train/optimizer_steps": float(stats.steps)})
        metrics.update({f"train/first_{k}": first.sums[k] / first.counts[k] for k in ("approx_kl", "ratio_abs_minus_1")
                        if first.counts.get(k)})
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
