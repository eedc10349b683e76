"""KL terms between the policy and another policy (reference or old), per pair (docs/algorithms.md 5, 14).

Two spaces (``algorithm.kl_space``, ``algorithm.dppo_kl_space``):
- x: between the two Gaussians of one SDE step, ``N(mean_a, s^2 I)`` and ``N(mean_b, s^2 I)``, whose
  per-element KL is ``(mean_a - mean_b)^2 / (2 s^2)``; averaged over (C, H, W) like the log-probs.
  With ``s`` the step's std (``StepOutput.step_std``) it is the exact KL; Flow-GRPO's reference
  term passes ``StepOutput.std`` (no ``sqrt(-dt)`` factor, section 5) and keeps its own scale.
- v: ``mean |v_a - v_b|^2`` over (C, H, W), the velocity-space penalty of DiffusionNFT and AWM.
"""

from __future__ import annotations

import torch

from .sde import mean_over_sample


def fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or kept in float64 (finite-difference tests run the maths in float64)."""
    return t if t.dtype == torch.float64 else t.float()


def gaussian_kl(mean_a: torch.Tensor, mean_b: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``mean over (C, H, W) of (mean_a - mean_b)^2 / (2 std^2)`` per pair ``[N]`` (``std`` ``[N]``)."""
    return mean_over_sample((fp32(mean_a) - fp32(mean_b)) ** 2) / (2 * fp32(std).reshape(-1) ** 2)


def velocity_kl(v_a: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """``mean over (C, H, W) of (v_a - v_b)^2`` per pair ``[N]``."""
    return mean_over_sample((fp32(v_a) - fp32(v_b)) ** 2)
