"""The DiffusionNFT loss (docs/algorithms.md section 7), per (sample, trained timestep) pair.

Likelihood-free: no log-probs, only the clean final latent ``x0`` of a deterministic rollout of
the old policy, re-noised to ``x_t = (1 - t) x0 + t eps``. The trained velocity ``v_theta`` and
the old one ``v_old`` define an implicit positive policy ``v_pos = b v_theta + (1 - b) v_old``
and its mirror ``v_neg = (1 + b) v_old - b v_theta``; each predicts ``x0`` as ``x_t - t v``.
Samples that did well (``r`` near 1) pull the positive prediction onto their ``x0``, samples
that did badly pull the negative one, which pushes ``v_theta`` away.

The trainer sums these per-pair values over all active pairs of a step and divides once by their
count (section 6); this module has no notion of batches or micro-batches. Everything runs in
float32 (the adaptive weights in float64, as the reference does), whatever the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sde import mean_over_sample, per_sample

WEIGHT_FLOOR = 1e-5  # the reference's lower clip of the adaptive weights (avoids 1 / 0 at x0_hat == x0)


@dataclass
class NFTTerms:
    loss: torch.Tensor  # [N] policy_loss + kl_beta * kl
    policy_loss: torch.Tensor  # [N] c * (r * positive + (1 - r) * negative) / b
    positive: torch.Tensor  # [N] mean |x0_pos - x0|^2 / w_pos
    negative: torch.Tensor  # [N] mean |x0_neg - x0|^2 / w_neg
    kl: torch.Tensor  # [N] mean |v_theta - v_ref|^2 (zeros without a reference)
    r: torch.Tensor  # [N] optimality weight in [0, 1]
    w_pos: torch.Tensor  # [N] detached adaptive weight of the positive branch
    w_neg: torch.Tensor  # [N] detached adaptive weight of the negative branch


def nft_optimality(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """``r = clamp(A, -c, c) / (2c) + 0.5`` in [0, 1]: 1 for the best samples, 0 for the worst."""
    a = advantages.float().clamp(-adv_clip, adv_clip)
    return (a / (2.0 * adv_clip) + 0.5).clamp(0.0, 1.0)


def noisy_latents(x0: torch.Tensor, eps: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) * x0 + t * eps`` (``t`` scalar or per sample ``[N]``), float32."""
    tt = per_sample(t, x0)
    return (1 - tt) * x0.float() + tt * eps.float()


def adaptive_weight(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Detached per-sample ``mean |x0_hat - x0|`` (float64, floored at 1e-5) as float32 ``[N]``."""
    with torch.no_grad():
        w = mean_over_sample((x0_hat.detach().double() - x0.double()).abs())
        return w.clamp(min=WEIGHT_FLOOR).float()


def nft_terms(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: float | torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float = 1.0,
    adv_clip: float = 5.0,
    kl_beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
    weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> NFTTerms:
    """DiffusionNFT loss of N pairs (``x0``, ``x_t`` at noise level ``t``) with advantages ``A``.

    ``loss = c * (r * |x0_pos - x0|^2 / w_pos + (1 - r) * |x0_neg - x0|^2 / w_neg) / b
    + kl_beta * |v_theta - v_ref|^2``, squared norms as means over (C, H, W), ``c = adv_clip``
    (the reference multiplies by its advantage clip, 5), ``b = beta``. ``w_pos``/``w_neg`` are
    the detached mean absolute errors of each branch's ``x0`` prediction: the gradient of a term
    is ``2 (x0_hat - x0) / w``, a step of roughly unit size whatever the noise level. ``weights``
    replaces them (finite-difference tests hold them fixed). ``v_old`` and ``v_ref`` get no
    gradient.
    """
    if beta <= 0:
        raise ValueError(f"nft beta must be > 0, got {beta}")
    v_theta = v_theta.float()
    v_old = v_old.detach().float()
    x0 = x0.float()
    x_t = x_t.float()
    tt = per_sample(t, x0)
    r = nft_optimality(advantages.to(x0.device), adv_clip)

    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    x0_pos = x_t - tt * v_pos
    x0_neg = x_t - tt * v_neg
    if weights is None:
        w_pos, w_neg = adaptive_weight(x0_pos, x0), adaptive_weight(x0_neg, x0)
    else:
        w_pos, w_neg = (w.detach().float().reshape(-1) for w in weights)
    positive = mean_over_sample((x0_pos - x0) ** 2) / w_pos
    negative = mean_over_sample((x0_neg - x0) ** 2) / w_neg
    policy_loss = adv_clip * (r * positive + (1 - r) * negative) / beta

    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("kl_beta > 0 needs v_ref (the LoRA-disabled reference velocity)")
        kl = mean_over_sample((v_theta - v_ref.detach().float()) ** 2)
    else:
        kl = torch.zeros_like(policy_loss)
    return NFTTerms(policy_loss + kl_beta * kl, policy_loss, positive, negative, kl, r, w_pos, w_neg)


def old_policy_eta(step: int, rate: float, flat: int, cap: float) -> float:
    """EMA weight of the old policy after ``step`` completed steps: ``min(rate * max(step - flat, 0), cap)``."""
    return float(min(rate * max(step - flat, 0), cap))
