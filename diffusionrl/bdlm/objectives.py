"""The objective family on exact traces: ``grpo``, ``dapo``, ``dr_grpo`` and ``opd`` (docs/bdlm.md).

Every objective scores the same replayed actions (one per committed or edited token); they differ
in four places, all here:

| objective | advantages | ratio clip | equal-reward groups | loss denominator |
| --- | --- | --- | --- | --- |
| grpo | ``(r - mean_g) / std_g`` | ``[1 - eps, 1 + eps]`` | dropped | the step's action weight |
| dapo | ``(r - mean_g) / std_g`` | ``[1 - eps, 1 + eps_high]`` | refilled (``dynamic_sampling``) | same (token level) |
| dr_grpo | ``r - mean_g`` (no std) | ``[1 - eps, 1 + eps]`` | kept (advantage 0) | ``B * G``, a constant |
| opd | none (no reward in the loss) | none | kept | the step's action weight |

``opd`` (on-policy distillation): the student's own rollout states are scored by a frozen
teacher; per action ``tau^2 KL(p_teacher^tau || p_student^tau)`` (forward KL at distillation
temperature ``tau``, Hinton's ``tau^2`` keeps gradient scale) plus ``hard_ce *
-log p_student(argmax p_teacher)`` (the teacher's target, at the rollout temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusionrl.algorithms.advantages import group_advantages

OBJECTIVES = {
    "grpo": "bdlm_grpo_exact_trace",
    "dapo": "bdlm_dapo_exact_trace",
    "dr_grpo": "bdlm_dr_grpo_exact_trace",
    "opd": "bdlm_opd_exact_trace",
}


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B]
    active: torch.Tensor  # [B] bool: rows that enter the loss
    zero_std_groups: int


def advantages_for(objective: str, rewards: torch.Tensor, group_ids: torch.Tensor, *, global_std: bool,
                   clip_max: float) -> Advantages:
    """Group-relative advantages as ``objective`` defines them (table above)."""
    adv = group_advantages(rewards, group_ids, global_std=global_std, clip_max=clip_max)
    if objective in ("grpo", "dapo"):
        return Advantages(adv.advantages, adv.active, adv.zero_std_groups)
    ones = torch.ones_like(adv.active)
    if objective == "opd":
        return Advantages(torch.zeros_like(adv.advantages), ones, adv.zero_std_groups)
    r = rewards.detach().float().reshape(-1)
    _, inverse, counts = torch.unique(group_ids.reshape(-1), return_inverse=True, return_counts=True)
    means = torch.zeros(len(counts)).index_add_(0, inverse, r) / counts
    return Advantages((r - means[inverse]).clamp(-clip_max, clip_max), ones, adv.zero_std_groups)


def clipped_surrogate(log_prob_new: torch.Tensor, log_prob_old: torch.Tensor, advantages: torch.Tensor, *,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO surrogate with an asymmetric clip ``[1 - clip_low, 1 + clip_high]``; returns (loss, ratio)."""
    ratio = torch.exp(log_prob_new - log_prob_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), ratio


def categorical_kl(log_p: torch.Tensor, log_q: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """``[...]`` exact ``KL(p || q)`` over the last axis. The ``mask_id`` column (MASK: -inf in both,
    never proposed; ``None`` for models without one) is dropped rather than computed as
    ``0 * (-inf - -inf)``, which would be nan."""
    if mask_id is not None:
        keep = torch.ones(log_p.shape[-1], dtype=torch.bool)
        keep[mask_id] = False
        log_p, log_q = log_p[..., keep], log_q[..., keep]
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def entropy(log_p: torch.Tensor) -> torch.Tensor:
    """``[...]`` entropy over the last axis; finite when some entries are -inf (``entr(0) = 0``)."""
    return torch.special.entr(log_p.exp()).sum(-1)


def retemper(log_p: torch.Tensor, rollout_temperature: float, tau: float) -> torch.Tensor:
    """``log_softmax(logits / tau)`` from ``log_p = log_softmax(logits / T)``: the normaliser is a
    per-position shift, so ``log_p * T / tau`` differs from ``logits / tau`` by a constant only."""
    return torch.log_softmax(log_p * (rollout_temperature / tau), dim=-1)


def distillation_terms(student_log_p: torch.Tensor, teacher_log_p: torch.Tensor, *, rollout_temperature: float,
                       tau: float, hard_ce: float, excluded: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: ``tau^2 KL(teacher^tau || student^tau) + hard_ce * CE(student, argmax teacher)``.

    Both inputs are ``[..., V]`` log-probs at the rollout temperature; returns (loss, kl)."""
    s_tau = retemper(student_log_p, rollout_temperature, tau)
    t_tau = retemper(teacher_log_p.detach(), rollout_temperature, tau)
    kl = categorical_kl(t_tau, s_tau, excluded)
    loss = tau**2 * kl
    if hard_ce > 0:
        target = teacher_log_p.detach().argmax(-1, keepdim=True)
        loss = loss - hard_ce * student_log_p.gather(-1, target).squeeze(-1)
    return loss, kl


def reduce_metrics(weighted: dict[str, list[tuple[float, float]]], plain: dict[str, list[float]]) -> dict[str, float]:
    """Weighted metrics are combined globally (``sum of sums / sum of weights`` over every unit,
    not a mean of per-unit means); plain metrics (one value per optimizer step: grad norm, lr)
    are averaged."""
    out = {}
    for name, parts in weighted.items():
        total = sum(w for _, w in parts)
        if total > 0:
            out[name] = sum(s for s, _ in parts) / total
    for name, values in plain.items():
        if values:
            out[name] = sum(values) / len(values)
    return out
