"""The SDE/Dance/CPS/ODE steps against closed forms, and the step strategies."""

import math

import numpy as np
import pytest
import torch

from diffusionrl.algorithms.sde import sde_step_mask, step_with_logprob


def _inputs(seed=0, b=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 4, 5, 5, generator=g)
    v = torch.randn(b, 4, 5, 5, generator=g)
    eps = torch.randn(b, 4, 5, 5, generator=g)
    return x, v, eps


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.05)])
def test_sde_log_prob_is_the_closed_form_gaussian(sigma, sigma_next):
    x, v, eps = _inputs()
    a = 0.7
    out = step_with_logprob(v, x, sigma, sigma_next, sde_type="sde", noise_level=a, sigma_max=0.9, noise=eps)
    dt = sigma_next - sigma
    s_safe = 0.9 if sigma == 1 else sigma
    std = a * math.sqrt(sigma / (1 - s_safe))
    mean = x + (v + std**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt
    scale = std * math.sqrt(-dt)
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.x_next, mean + scale * eps, rtol=1e-5, atol=1e-6)
    expected = torch.distributions.Normal(mean, scale).log_prob(out.x_next).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std, torch.full((3,), std), rtol=1e-6, atol=0)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.0)])
def test_dance_step_is_the_reverse_sde_with_constant_noise_and_an_exact_gaussian_log_prob(sigma, sigma_next):
    """DanceGRPO: g = eta for every sigma (also sigma = 1, where sde needs sigma_max); the mean is
    x + (v - eta^2 / 2 * score) dt with score = -(x + (1 - sigma) v) / sigma."""
    x, v, eps = _inputs(4)
    eta = 0.3
    out = step_with_logprob(v, x, sigma, sigma_next, sde_type="dance", noise_level=eta, noise=eps)
    dt = sigma_next - sigma
    x0_hat = x - sigma * v
    score = -(x - (1 - sigma) * x0_hat) / sigma**2
    mean = x + (v - 0.5 * eta**2 * score) * dt
    scale = eta * math.sqrt(-dt)
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.x_next, mean + scale * eps, rtol=1e-5, atol=1e-6)
    expected = torch.distributions.Normal(mean.double(), scale).log_prob(out.x_next.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)
    assert out.std.tolist() == pytest.approx([eta] * 3) and out.step_std.tolist() == pytest.approx([scale] * 3)
    scored = step_with_logprob(v, x, sigma, sigma_next, sde_type="dance", noise_level=eta, x_next=out.x_next)
    assert torch.equal(scored.log_prob, out.log_prob)


def test_scoring_a_recorded_transition_gives_the_sampled_log_prob():
    x, v, eps = _inputs(1)
    sampled = step_with_logprob(v, x, 0.7, 0.5, noise=eps)
    scored = step_with_logprob(v, x, 0.7, 0.5, x_next=sampled.x_next)
    assert torch.equal(sampled.log_prob, scored.log_prob)


def test_cps_step_matches_its_definition_and_is_deterministic_at_the_end():
    x, v, eps = _inputs(2)
    a = 0.8
    out = step_with_logprob(v, x, 0.5, 0.3, sde_type="cps", noise_level=a, noise=eps)
    std = 0.3 * math.sin(a * math.pi / 2)
    mean = (x - 0.5 * v) * 0.7 + (x + 0.5 * v) * math.sqrt(0.3**2 - std**2)
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.log_prob, -((out.x_next - mean) ** 2).mean(dim=(1, 2, 3)))
    last = step_with_logprob(v, x, 0.1, 0.0, sde_type="cps", noise_level=a, noise=eps)
    assert torch.equal(last.x_next, last.mean)


def test_ode_step_is_euler_with_zero_log_prob():
    x, v, _ = _inputs(3)
    out = step_with_logprob(v, x, 0.5, 0.25, sde_type="ode")
    torch.testing.assert_close(out.x_next, x - 0.25 * v)
    assert torch.count_nonzero(out.log_prob) == 0


def test_steps_compute_in_float32_whatever_the_input_dtype():
    x, v, eps = _inputs(4)
    out = step_with_logprob(v.half(), x.half(), 0.6, 0.4, noise=eps.half())
    assert out.log_prob.dtype == torch.float32 and out.x_next.dtype == torch.float32


def test_strategy_all_trains_every_step_but_the_last():
    mask = sde_step_mask("all", 10, [1, 2])
    assert mask.shape == (2, 10) and mask[:, :9].all() and not mask[:, 9].any()


def test_strategy_sde_window_is_contiguous_inside_the_range_and_seeded():
    mask = sde_step_mask("sde_window", 10, list(range(50)), num_sde_steps=3, window_range=[1, 7])
    for row in mask:
        idx = np.flatnonzero(row)
        assert len(idx) == 3 and idx[0] >= 1 and idx[-1] < 7 and np.all(np.diff(idx) == 1)
    again = sde_step_mask("sde_window", 10, list(range(50)), num_sde_steps=3, window_range=[1, 7])
    assert np.array_equal(mask, again)
    assert len({tuple(np.flatnonzero(r)) for r in mask}) > 1  # windows move between groups


def test_strategy_epoch_random_choice_is_shared_in_an_epoch_and_changes_across_epochs():
    masks = [sde_step_mask("epoch_random_choice", 10, [0, 1, 2], num_sde_steps=2, candidate_steps=[0, 2, 4, 6, 8],
                           epoch=e, seed=3) for e in range(6)]
    for m in masks:
        assert (m == m[0]).all() and m[0].sum() == 2 and set(np.flatnonzero(m[0])) <= {0, 2, 4, 6, 8}
    assert len({tuple(np.flatnonzero(m[0])) for m in masks}) > 1
