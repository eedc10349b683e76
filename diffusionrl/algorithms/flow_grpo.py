"""The Flow-GRPO loss (docs/algorithms.md section 5), per (sample, trained step) pair.

The trainer sums these per-pair values over all active pairs of a step and divides once by
their count (section 6); this module has no notion of batches or micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FlowGRPOTerms:
    loss: torch.Tensor  # [N] policy_loss + kl_beta * kl
    policy_loss: torch.Tensor  # [N]
    kl: torch.Tensor  # [N] (zeros when there is no reference)
    ratio: torch.Tensor  # [N]


def flow_grpo_terms(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    kl_beta: float = 0.0,
    mean_new: torch.Tensor | None = None,
    mean_ref: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
) -> FlowGRPOTerms:
    """Clipped surrogate plus the KL to the reference for N pairs.

    ``ratio = exp(new - old)``; ``policy_loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))``;
    ``kl = mean over (C, H, W) of (mean_new - mean_ref)^2 / (2 std^2)`` where ``std`` is the step's
    noise std *without* the sqrt(-dt) factor, as in the reference implementation (a deliberate
    choice there that weights late, low-noise steps more; kept so results compare). A given ``kl``
    ``[N]`` (another space, ``algorithms.kl``) is used as it is.
    """
    ratio = torch.exp(log_prob_new - log_prob_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped)
    if kl_beta > 0 and kl is None:
        if mean_new is None or mean_ref is None or std is None:
            raise ValueError("kl_beta > 0 needs mean_new, mean_ref and std")
        diff = (mean_new - mean_ref) ** 2
        kl = diff.mean(dim=tuple(range(1, diff.ndim))) / (2 * std**2)
    elif kl is None:
        kl = torch.zeros_like(policy_loss)
    return FlowGRPOTerms(policy_loss + kl_beta * kl, policy_loss, kl, ratio)


def ratio_stats(log_prob_new: torch.Tensor, log_prob_old: torch.Tensor, clip_range: float) -> dict[str, torch.Tensor]:
    """Sums (not means) over pairs of the logged ratio statistics, for exact aggregation."""
    with torch.no_grad():
        diff = log_prob_new - log_prob_old
        ratio = torch.exp(diff)
        return {
            "approx_kl": 0.5 * (diff**2).sum(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().sum(),
            "ratio_abs_minus_1": (ratio - 1.0).abs().sum(),
        }
