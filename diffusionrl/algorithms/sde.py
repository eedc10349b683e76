"""Stochastic and deterministic flow-matching steps with per-step log-probs (docs/algorithms.md 1-3).

Pure tensor functions. Everything is computed in float32 whatever the model dtype: the log-prob
is a mean over ~C*H*W Gaussian terms whose differences are ~1e-4 (the PPO clip range); bf16/fp16
arithmetic here overflows ``1 / std**2`` on early steps and biases the ratio.

Conventions: ``x_sigma = (1 - sigma) * x0 + sigma * eps``, ``sigmas[0] = 1 ... sigmas[T] = 0``,
``dt = sigma_next - sigma < 0``. ``sigma``/``sigma_next`` may be Python floats, 0-d tensors or
per-sample ``[B]`` tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

SDE_TYPES = ("sde", "cps", "ode", "dance")


@dataclass
class StepOutput:
    x_next: torch.Tensor  # [B, C, H, W] float32
    log_prob: torch.Tensor  # [B] float32: mean over (C, H, W) of the Gaussian log-density
    mean: torch.Tensor  # [B, C, H, W] float32: mean of x_next given x
    std: torch.Tensor  # [B] float32: noise std without the sqrt(-dt) factor (used by the KL term)
    step_std: torch.Tensor | None = None  # [B] float32: std of x_next given x (sde/dance: std sqrt(-dt); cps: std)


def per_sample(value: float | torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] value as a float32 [B, 1, 1, 1] tensor on ``ref``'s device."""
    t = torch.as_tensor(value, dtype=torch.float32, device=ref.device)
    if t.ndim == 0:
        t = t.expand(ref.shape[0])
    return t.reshape(-1, *([1] * (ref.ndim - 1)))


def mean_over_sample(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=tuple(range(1, t.ndim)))


def step_with_logprob(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    sde_type: str = "sde",
    noise_level: float = 0.7,
    sigma_max: float | torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
) -> StepOutput:
    """One denoising step from ``sigma`` to ``sigma_next`` and the log-prob of its result.

    ``sde_type``: ``sde`` (Flow-GRPO's SDE, ``g = a sqrt(sigma / (1 - sigma))``), ``dance``
    (DanceGRPO's SDE, the same reverse-time mean with a constant ``g = a``; DanceGRPO calls it
    eta), ``cps`` (coefficients-preserving) or ``ode`` (Euler). ``sde`` and ``dance`` give the
    exact Gaussian log-density (a mean over elements), ``cps`` drops its constants.

    Either ``noise`` (rollout: draw ``x_next = mean + std * noise``) or ``x_next`` (training:
    score a recorded transition) must be given for the stochastic types. ``sigma_max`` is
    ``sigmas[1]``, used in place of ``sigma`` when ``sigma == 1`` (avoids ``1 / (1 - 1)``).
    """
    v = v.float()
    x = x.float()
    s = per_sample(sigma, x)
    s_next = per_sample(sigma_next, x)
    dt = s_next - s  # [B,1,1,1], negative

    if sde_type == "ode":
        mean = x + v * dt
        out = mean if x_next is None else x_next.float()
        zeros = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        return StepOutput(out, zeros, mean, zeros, zeros)

    if sde_type in ("sde", "dance"):
        if sde_type == "sde":  # Flow-GRPO: g = a sqrt(sigma / (1 - sigma)), sigma_max in place of sigma = 1
            s_max = per_sample(sigma_max if sigma_max is not None else sigma_next, x)
            s_safe = torch.where(s == 1, s_max, s)
            std = torch.sqrt(s / (1 - s_safe)) * noise_level  # [B,1,1,1]
        else:  # DanceGRPO: a constant diffusion coefficient g = eta (the noise level)
            std = torch.full_like(s, float(noise_level))
        # The reference's arrangement of mean = x + (v + std^2/(2 sigma) (x + (1 - sigma) v)) dt.
        mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
        step_std = std * torch.sqrt(-dt)
        if x_next is None:
            if noise is None:
                raise ValueError("step_with_logprob: give noise (to sample) or x_next (to score)")
            x_next = mean + step_std * noise.float()
        x_next = x_next.float()
        log_prob = (
            -((x_next.detach() - mean) ** 2) / (2 * step_std**2)
            - torch.log(step_std)
            - math.log(math.sqrt(2 * math.pi))
        )
        return StepOutput(x_next, mean_over_sample(log_prob), mean, std.flatten(), step_std.flatten())

    if sde_type == "cps":
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - s * v
        x1_hat = x + (1 - s) * v
        mean = x0_hat * (1 - s_next) + x1_hat * torch.sqrt(torch.clamp(s_next**2 - std**2, min=0))
        if x_next is None:
            if noise is None:
                raise ValueError("step_with_logprob: give noise (to sample) or x_next (to score)")
            x_next = mean + std * noise.float()
        x_next = x_next.float()
        # Constants dropped as in the reference: -(x_next - mean)^2, a per-element mean.
        log_prob = -((x_next.detach() - mean) ** 2)
        return StepOutput(x_next, mean_over_sample(log_prob), mean, std.flatten(), std.flatten())

    raise ValueError(f"unknown sde_type {sde_type!r}; use one of {SDE_TYPES}")


# -- step strategies (docs/algorithms.md 3) --------------------------------------------------------


def sde_step_mask(
    strategy: str,
    num_steps: int,
    group_seeds: list[int] | np.ndarray,
    *,
    num_sde_steps: int = 2,
    window_range: tuple[int, int] | list[int] = (0, 5),
    candidate_steps: list[int] | None = None,
    epoch: int = 0,
    seed: int = 0,
    shift_interval: int = 1,
    stride: int = 1,
) -> np.ndarray:
    """Boolean ``[G, T]`` mask of the stochastic steps of each sample group.

    - ``all``: every step but the last (``int(T * 0.99)`` steps for T < 100, as Flow-GRPO).
    - ``sde_window``: a contiguous window of ``num_sde_steps`` at a random start inside
      ``window_range`` = [lo, hi), drawn from ``numpy.random.default_rng(group_seed)``.
    - ``epoch_random_choice``: ``num_sde_steps`` of ``candidate_steps``, seeded by
      ``epoch + seed``, the same for every group of the epoch.
    - ``mix_window`` (MixGRPO's progressive sliding window): ``num_sde_steps`` contiguous steps,
      the same for every group, starting at ``lo`` and moving ``stride`` steps later every
      ``shift_interval`` RL steps (``epoch``); once the next start would leave [lo, hi) it
      restarts at ``lo``. A function of the step alone, so a resumed run takes the same window.
    """
    groups = len(group_seeds)
    mask = np.zeros((groups, num_steps), dtype=bool)
    if strategy == "all":
        mask[:, : min(int(num_steps * 0.99), num_steps - 1)] = True
    elif strategy == "sde_window":
        lo, hi = int(window_range[0]), int(window_range[1])
        for g, group_seed in enumerate(group_seeds):
            start = int(np.random.default_rng(int(group_seed)).integers(lo, hi - num_sde_steps + 1))
            mask[g, start : start + num_sde_steps] = True
    elif strategy == "epoch_random_choice":
        candidates = sorted(set(candidate_steps if candidate_steps is not None else range(num_steps - 1)))
        chosen = np.random.default_rng(epoch + seed).choice(candidates, size=num_sde_steps, replace=False)
        mask[:, chosen] = True
    elif strategy == "mix_window":
        start = mix_window_start(epoch, num_sde_steps, window_range, shift_interval, stride)
        mask[:, start : start + num_sde_steps] = True
    else:
        raise ValueError(f"unknown step strategy {strategy!r}; use all | sde_window | epoch_random_choice | mix_window")
    return mask


def mix_window_start(step: int, size: int, window_range: tuple[int, int] | list[int], shift_interval: int = 1,
                     stride: int = 1) -> int:
    """First step of MixGRPO's window at RL step ``step``: ``lo + stride * k`` for the k-th of the
    window's ``(hi - lo - size) // stride + 1`` positions in [lo, hi), k = ``step // shift_interval``
    modulo the number of positions."""
    lo, hi = int(window_range[0]), int(window_range[1])
    positions = (hi - lo - size) // stride + 1
    if positions < 1 or shift_interval < 1 or stride < 1:
        raise ValueError(f"mix_window: no window of {size} steps fits [{lo}, {hi}) (stride {stride}, interval "
                         f"{shift_interval})")
    return lo + stride * ((int(step) // shift_interval) % positions)


def compressed_steps(sde_mask: np.ndarray | torch.Tensor, num_steps: int, steps: int) -> np.ndarray:
    """MixGRPO-Flash's time-step compression: the indices into a schedule's ``sigmas`` ``[T+1]`` that a
    rollout with the SDE steps ``sde_mask`` (``[B, T]`` or ``[T]``) samples on.

    Every step up to the end ``e`` of the last SDE step (any sample's) is kept; the ``T - e`` ODE steps
    after it, which carry no log-prob and no gradient, become ``steps`` larger ones: the sigmas at the
    indices ``round(linspace(e, T, steps + 1))``, a subset of the schedule ending at ``sigmas[T] = 0``.
    All indices (``arange(T + 1)``) when ``steps`` is 0, no step is stochastic, or ``steps >= T - e``.
    """
    mask = np.asarray(sde_mask, dtype=bool).reshape(-1, num_steps)
    used = np.flatnonzero(mask.any(axis=0))
    end = int(used[-1]) + 1 if used.size else num_steps
    if steps <= 0 or steps >= num_steps - end:
        return np.arange(num_steps + 1)
    tail = np.floor(np.linspace(end, num_steps, steps + 1) + 0.5).astype(np.int64)  # strictly increasing
    return np.concatenate([np.arange(end), tail])


# -- DPM-Solver++(2M) on the flow-matching ODE (docs/algorithms.md 2) -------------------------------


def dpm_solver_2m_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float,
    sigma_next: float,
    x0_prev: torch.Tensor | None = None,
    sigma_prev: float | None = None,
    use_prev: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DPM-Solver++ step of the probability-flow ODE (data prediction ``x0 = x - sigma v``,
    ``alpha = 1 - sigma``, ``lambda = log(alpha / sigma)``); returns ``(x_next, x0)``.

    Second order (2M: ``D = x0 + (x0 - x0_prev) / (2 r)``, ``r = h_prev / h``) for the samples where
    ``use_prev`` ([B] bool, default all) holds and a previous data prediction at ``sigma_prev < 1``
    is given; first order (``D = x0``, which is the Euler step) otherwise and on the last step
    (``sigma_next = 0``, as diffusers' ``lower_order_final``). Float32, like ``step_with_logprob``.
    """
    x, v = x.float(), v.float()
    sigma, sigma_next = float(sigma), float(sigma_next)
    x0 = x - sigma * v
    if sigma_next == 0.0:
        return x0, x0
    d = x0
    if x0_prev is not None and sigma_prev is not None and float(sigma_prev) < 1.0 and sigma < 1.0:
        lam = math.log((1 - sigma) / sigma)
        h = math.log((1 - sigma_next) / sigma_next) - lam
        r = (lam - math.log((1 - float(sigma_prev)) / float(sigma_prev))) / h
        d2 = x0 + (x0 - x0_prev.float()) / (2 * r)
        d = d2 if use_prev is None else torch.where(per_sample(use_prev.float(), x) > 0, d2, x0)
    # x_next = (sigma_next / sigma) x - alpha_next (exp(-h) - 1) D, exp(-h) = sigma_next alpha / (sigma alpha_next)
    ratio = sigma_next / sigma
    return ratio * x + ((1 - sigma_next) - ratio * (1 - sigma)) * d, x0
