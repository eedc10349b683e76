"""Advantage Weighted Matching (docs/algorithms.md section 14.4), per (sample, timestep) pair.

AWM trains with the pretraining loss itself: the clean latent ``x0`` of a rollout (any solver: the
rollout's log-probs are not used) is re-noised at a noise level ``t`` with fresh noise ``eps``,
``x_t = (1 - t) x0 + t eps`` (``algorithms.nft.noisy_latents``), and the flow-matching error of the
velocity, whose target is ``eps - x0`` (the model predicts ``v = E[eps - x0 | x_t]``, so
``x0_hat = x_t - t v``), is weighted by the sample's advantage:

    loss = A * mean |v_theta(x_t, t) - (eps - x0)|^2  +  kl_beta * mean |v_theta - v_ref|^2

Samples better than their group (A > 0) are fitted like training data, worse ones (A < 0) pushed
away; with A = 0 only the KL acts. This is the gradient of AWM's PPO-style surrogate
``-A exp(log p - log p_old)`` with ``log p = -mean |v - (eps - x0)|^2`` at ``p = p_old`` (the
first update on a rollout). The trainer sums these per-pair values over the active pairs of a step
and divides once by their count (section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kl import fp32, velocity_kl


@dataclass
class AWMTerms:
    loss: torch.Tensor  # [N] policy_loss + kl_beta * kl
    policy_loss: torch.Tensor  # [N] A * fm_error
    fm_error: torch.Tensor  # [N] mean |v - (eps - x0)|^2
    kl: torch.Tensor  # [N] mean |v - v_ref|^2 (zeros without a reference)


def flow_matching_error(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``mean over (C, H, W) of (v - (eps - x0))^2`` per sample ``[N]``: the flow-matching loss at
    ``x_t = (1 - t) x0 + t eps``, whatever ``t``."""
    return velocity_kl(v, fp32(eps) - fp32(x0))


def awm_terms(
    v_theta: torch.Tensor,
    x0: torch.Tensor,
    eps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    kl_beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
) -> AWMTerms:
    """AWM loss of N pairs (``v_theta`` predicted at ``x_t = (1 - t) x0 + t eps``)."""
    fm_error = flow_matching_error(v_theta, x0, eps)
    policy_loss = fp32(advantages).reshape(-1) * fm_error
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("kl_beta > 0 needs v_ref (the LoRA-disabled reference velocity)")
        kl = velocity_kl(v_theta, v_ref.detach())
    else:
        kl = torch.zeros_like(policy_loss)
    return AWMTerms(policy_loss + kl_beta * kl, policy_loss, fm_error, kl)
