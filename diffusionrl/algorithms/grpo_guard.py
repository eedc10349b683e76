"""GRPO-Guard (docs/algorithms.md section 14.2), per (sample, trained step) pair.

Flow-GRPO's per-step log-ratio of an exact Gaussian step ``x_next = mean_old + s eps`` (``s`` the
step's std, ``D`` elements, log-probs averaged over them) is

    log r = mean((x_next - mean_old)^2 - (x_next - mean)^2) / (2 s^2)
          = mean(eps * delta) / s  -  mean(delta^2) / (2 s^2),          delta = mean - mean_old

whose second term is never positive: the ratio is biased below 1 (more so at low-noise steps),
so the upper clip rarely stops positive-advantage updates, and its scale varies with ``s`` from step
to step. GRPO-Guard's RatioNorm adds the bias back and rescales by ``s``:

    log r_guard = s * (log r + mean(delta^2) / (2 s^2)) = mean(eps * delta)

centred on 0 with a spread that depends on ``delta`` only (not on the noise level), and its gradient
reweighting divides each step's clipped objective by ``|dt|`` (the ``sqrt(-dt)^2`` of the step's
Brownian increment), equalising the per-step gradient scale. The trainer sums these per-pair values
over the active pairs of a step and divides once by their count (section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kl import fp32, gaussian_kl


@dataclass
class GuardTerms:
    loss: torch.Tensor  # [N] policy_loss + kl_beta * kl
    policy_loss: torch.Tensor  # [N] clipped objective of the normalised ratio, / |dt| with reweighting
    kl: torch.Tensor  # [N] (zeros without a reference)
    ratio: torch.Tensor  # [N] the normalised ratio exp(log r_guard)
    bias: torch.Tensor  # [N] mean(delta^2) / (2 s^2), detached


def grpo_guard_terms(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mean_new: torch.Tensor,
    mean_old: torch.Tensor,
    step_std: torch.Tensor,
    dt: torch.Tensor,
    clip_range: float,
    ratio_norm: bool = True,
    reweight: bool = True,
    kl_beta: float = 0.0,
    kl: torch.Tensor | None = None,
) -> GuardTerms:
    """GRPO-Guard's clipped objective for N pairs.

    ``bias = mean((mean_new - mean_old)^2) / (2 step_std^2)`` (``mean_old`` detached);
    ``ratio = exp(step_std * (log_prob_new - log_prob_old + bias))`` with ``ratio_norm``, else
    Flow-GRPO's ``exp(log_prob_new - log_prob_old)``;
    ``policy_loss = max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)) / |dt|`` (``/ |dt|`` with
    ``reweight``); ``loss = policy_loss + kl_beta * kl``. ``step_std`` is the std of ``x_next``
    given ``x`` (``StepOutput.step_std``); the identity behind the normalisation needs the exact
    Gaussian log-prob (``sde``/``dance`` rollouts).
    """
    step_std = fp32(step_std).reshape(-1)
    bias = gaussian_kl(mean_new, mean_old.detach(), step_std)
    log_ratio = log_prob_new - log_prob_old
    if ratio_norm:
        log_ratio = step_std * (log_ratio + bias)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped)
    if reweight:
        policy_loss = policy_loss / fp32(dt).reshape(-1).abs()
    if kl_beta > 0:
        if kl is None:
            raise ValueError("kl_beta > 0 needs the kl term")
    else:
        kl = torch.zeros_like(policy_loss)
    return GuardTerms(policy_loss + kl_beta * kl, policy_loss, kl, ratio, bias.detach())
