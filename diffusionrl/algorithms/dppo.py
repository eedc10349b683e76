"""Flow-DPPO (docs/algorithms.md section 14.3), per (sample, trained step) pair.

PPO's ratio clip is a one-sample proxy for a trust region. An SDE step is Gaussian, so the
divergence between the current and the old (rollout) policy at a recorded state is available in
closed form: Flow-DPPO keeps the plain policy-gradient surrogate ``-A * ratio`` and removes from the
gradient only the pairs that are outside the trust region *and* moving further out in the direction
their advantage pushes (ratio > 1 with A > 0, ratio < 1 with A < 0); a pair outside it but moving
back is kept. The trainer sums these per-pair values over the active pairs of a step and divides
once by their count (section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kl import gaussian_kl, velocity_kl


@dataclass
class DPPOTerms:
    loss: torch.Tensor  # [N] policy_loss + kl_beta * kl
    policy_loss: torch.Tensor  # [N] -A * ratio, 0 where masked
    kl: torch.Tensor  # [N] KL to the reference (zeros without one)
    ratio: torch.Tensor  # [N] exp(log_prob_new - log_prob_old)
    divergence: torch.Tensor  # [N] KL(current || old) of the trust region, detached
    masked: torch.Tensor  # [N] bool: removed from the gradient


def trust_region_divergence(
    space: str,
    *,
    mean_new: torch.Tensor | None = None,
    mean_old: torch.Tensor | None = None,
    step_std: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    v_old: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(current || old) per pair ``[N]``, detached.

    ``x``: the exact KL of the two step Gaussians ``N(mean_new, s^2 I)``, ``N(mean_old, s^2 I)``,
    ``mean((mean_new - mean_old)^2) / (2 s^2)`` with ``s`` the std of ``x_next`` given ``x``
    (``StepOutput.step_std``); ``v``: ``mean((v_new - v_old)^2)``.
    """
    with torch.no_grad():
        if space == "x":
            return gaussian_kl(mean_new, mean_old, step_std)
        if space == "v":
            return velocity_kl(v_new, v_old)
    raise ValueError(f"unknown trust-region space {space!r}; use x | v")


def dppo_terms(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    divergence: torch.Tensor,
    threshold: float,
    kl_beta: float = 0.0,
    kl: torch.Tensor | None = None,
) -> DPPOTerms:
    """``masked = (divergence > threshold) & ((ratio > 1 & A > 0) | (ratio < 1 & A < 0))``;
    ``policy_loss = -A * ratio`` where not masked, exactly 0 (no gradient) where masked;
    ``loss = policy_loss + kl_beta * kl``."""
    ratio = torch.exp(log_prob_new - log_prob_old)
    with torch.no_grad():
        outward = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
        masked = (divergence.detach() > threshold) & outward
    policy_loss = torch.where(masked, torch.zeros_like(ratio), -advantages * ratio)
    if kl_beta > 0:
        if kl is None:
            raise ValueError("kl_beta > 0 needs the kl term")
    else:
        kl = torch.zeros_like(policy_loss)
    return DPPOTerms(policy_loss + kl_beta * kl, policy_loss, kl, ratio, divergence.detach(), masked)
