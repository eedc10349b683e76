"""Dance-SDE rollouts, GRPO-Guard and Flow-DPPO: the maths by hand, and the loop invariants
(docs/algorithms.md section 14)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from diffusionrl.algorithms.dppo import dppo_terms, trust_region_divergence
from diffusionrl.algorithms.grpo_guard import grpo_guard_terms
from diffusionrl.algorithms.sde import step_with_logprob
from diffusionrl.config import ConfigError
from diffusionrl.run import CheckpointMismatch
from diffusionrl.train import build_loop, train
from diffusionrl.training.trainer import UpdateStats

from .conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gaussian_step(seed=0, n=3, shape=(2, 3, 3), s=0.2):
    """A recorded step x_next = mean_old + s eps and a live mean near mean_old, as leaves."""
    g = torch.Generator().manual_seed(seed)
    mean_old = torch.randn(n, *shape, generator=g)
    eps = torch.randn(n, *shape, generator=g)
    mean_new = (mean_old + 0.05 * torch.randn(n, *shape, generator=g)).requires_grad_()
    return mean_old, eps, mean_old + s * eps, mean_new, torch.full((n,), s)


def _log_prob(x_next, mean, s):
    """The per-element mean Gaussian log-density of section 2."""
    s = s.reshape(-1, 1, 1, 1)
    lp = -((x_next - mean) ** 2) / (2 * s**2) - torch.log(s) - math.log(math.sqrt(2 * math.pi))
    return lp.mean(dim=(1, 2, 3))


# -- GRPO-Guard: the maths -----------------------------------------------------------------------------


def test_guard_ratio_norm_is_the_centred_noise_projection_and_the_bias_is_the_exact_kl():
    mean_old, eps, x_next, mean_new, s = _gaussian_step()
    new, old = _log_prob(x_next, mean_new, s), _log_prob(x_next, mean_old, s)
    adv = torch.tensor([1.0, -2.0, 0.5])
    dt = torch.tensor([-0.04, -0.04, -0.04])
    terms = grpo_guard_terms(new, old, adv, mean_new=mean_new, mean_old=mean_old, step_std=s, dt=dt, clip_range=1.0)
    delta = (mean_new - mean_old).detach()
    # log r + bias = mean(eps * delta) / s, so the normalised log-ratio is mean(eps * delta): no -|delta|^2 drift
    torch.testing.assert_close(terms.ratio.log(), (eps * delta).mean(dim=(1, 2, 3)), rtol=1e-4, atol=1e-6)
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mean_new.detach(), 0.2),
                                           torch.distributions.Normal(mean_old, 0.2)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(terms.bias, kl, rtol=1e-5, atol=1e-7)
    # clip range 1: nothing clipped, policy_loss = -A ratio / |dt|
    torch.testing.assert_close(terms.policy_loss, -adv * terms.ratio / 0.04)
    plain = grpo_guard_terms(new, old, adv, mean_new=mean_new, mean_old=mean_old, step_std=s, dt=dt,
                             clip_range=1.0, ratio_norm=False, reweight=False)
    torch.testing.assert_close(plain.ratio, torch.exp(new - old))  # both off: Flow-GRPO's ratio
    same = grpo_guard_terms(old, old, adv, mean_new=mean_old, mean_old=mean_old, step_std=s, dt=dt, clip_range=1e-4)
    assert torch.equal(same.ratio, torch.ones(3)) and torch.equal(same.loss, -adv / dt.abs())


def test_guard_gradient_matches_finite_differences():
    mean_old, eps, x_next, mean_new, s = _gaussian_step(1)
    adv, dt = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([-0.1, -0.1, -0.1])

    def loss_at(m: torch.Tensor) -> torch.Tensor:
        lp = _log_prob(x_next.double(), m, s.double())
        return grpo_guard_terms(lp, _log_prob(x_next.double(), mean_old.double(), s.double()), adv.double(),
                                mean_new=m, mean_old=mean_old.double(), step_std=s.double(), dt=dt.double(),
                                clip_range=10.0).loss.sum()

    m0 = mean_new.detach().double().requires_grad_()
    loss_at(m0).backward()
    # the normalised log-ratio is linear in the mean: d loss / d mean = -A ratio eps / (D |dt|)
    d = m0[0].numel()
    ratio = grpo_guard_terms(_log_prob(x_next.double(), m0, s.double()),
                             _log_prob(x_next.double(), mean_old.double(), s.double()), adv.double(),
                             mean_new=m0, mean_old=mean_old.double(), step_std=s.double(), dt=dt.double(),
                             clip_range=10.0).ratio.detach()
    noise = (x_next.double() - mean_old.double()) / 0.2  # the recorded step's eps, in float64
    analytic = -(adv.double() * ratio).reshape(-1, 1, 1, 1) * noise / (d * 0.1)
    torch.testing.assert_close(m0.grad, analytic, rtol=1e-6, atol=1e-9)
    h, base, fd = 1e-4, m0.detach().flatten(), torch.zeros(m0.numel(), dtype=torch.float64)
    for i in range(0, base.numel(), 7):
        e = torch.zeros_like(base)
        e[i] = h
        fd[i] = (loss_at((base + e).reshape(m0.shape)) - loss_at((base - e).reshape(m0.shape))) / (2 * h)
    idx = torch.arange(0, base.numel(), 7)
    torch.testing.assert_close(m0.grad.flatten()[idx], fd[idx], rtol=1e-5, atol=1e-9)


# -- Flow-DPPO: the maths --------------------------------------------------------------------------------


def test_dppo_divergence_is_the_exact_gaussian_kl_and_the_mask_is_asymmetric():
    mean_old, _, _, mean_new, s = _gaussian_step(2)
    div = trust_region_divergence("x", mean_new=mean_new, mean_old=mean_old, step_std=s)
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mean_new.detach(), 0.2),
                                           torch.distributions.Normal(mean_old, 0.2)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(div, kl, rtol=1e-5, atol=1e-7)
    v = torch.randn(3, 2, 2, 2)
    assert torch.equal(trust_region_divergence("v", v_new=v, v_old=v + 1), torch.ones(3))
    # pairs: (log-ratio, advantage, divergence) -> masked?
    cases = [(+0.1, +1.0, 1.0, True),  # outside and moving further in A's direction
             (-0.1, -1.0, 1.0, True),
             (-0.1, +1.0, 1.0, False),  # outside but moving back: kept
             (+0.1, -1.0, 1.0, False),
             (+0.1, +1.0, 0.0, False)]  # inside the trust region: kept
    new = torch.tensor([c[0] for c in cases], requires_grad=True)
    adv = torch.tensor([c[1] for c in cases])
    terms = dppo_terms(new, torch.zeros(5), adv, divergence=torch.tensor([c[2] for c in cases]), threshold=0.5)
    assert terms.masked.tolist() == [c[3] for c in cases]
    terms.loss.sum().backward()
    expected = torch.where(terms.masked, torch.zeros(5), -adv * torch.exp(new.detach()))  # d(-A e^x)/dx
    torch.testing.assert_close(new.grad, expected)
    assert torch.equal(terms.policy_loss[terms.masked], torch.zeros(2))


# -- the objectives in the loop ------------------------------------------------------------------------


def _loop(tmp_path_factory, preset, *extra):
    lp = build_loop(tiny_config(*extra, preset=preset), tmp_path_factory.mktemp(preset), progress=False)
    lp.backend.push_weights(0)
    return lp


@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    lp = _loop(tmp_path_factory, "tiny-cpu-grpo-guard", "algorithm.kl_beta=0.01")
    traj, active, _ = lp.backend.score(lp.backend.rollout(0))
    yield lp, traj, active
    lp.close()


@pytest.fixture(scope="module")
def dppo(tmp_path_factory):
    lp = _loop(tmp_path_factory, "tiny-cpu-dppo", "algorithm.kl_beta=0.01", "algorithm.kl_space=v")
    traj, active, _ = lp.backend.score(lp.backend.rollout(0))
    yield lp, traj, active
    lp.close()


def _stats(loop, traj, active, micro=None):
    if micro:
        traj = dataclasses.replace(traj, micro_batch_size=micro)
    objective = loop.backend.worker.objective
    stats = UpdateStats()
    units = objective.units(traj, traj.micro_batches(), active, np.random.default_rng(0))
    with torch.no_grad():
        for unit in units:
            _, unit_stats = unit.compute()
            for key, value in unit_stats.items():
                stats.add(key, float(value), unit.count)
    return stats.means()


def _grads(loop, traj, active, micro):
    traj = dataclasses.replace(traj, micro_batch_size=micro)
    trainer, objective = loop.backend.worker.trainer, loop.backend.worker.objective
    trainer.optimizer.zero_grad(set_to_none=True)
    assert trainer.accumulate(objective.units(traj, traj.micro_batches(), active, np.random.default_rng(0)),
                              UpdateStats())
    grads = {n: p.grad.detach().clone() for n, p in loop.backend.worker.policy.params.items()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def _relative_split_error(loop, traj, active):
    one, many = _grads(loop, traj, active, 8 if traj.batch_size % 8 == 0 else 4), _grads(loop, traj, active, 2)
    num = max(float((one[n] - many[n]).norm()) for n in one)
    den = max(float(one[n].norm()) for n in one)
    assert den > 0
    return num / den


@pytest.mark.parametrize("fixture", ["guard", "dppo"])
def test_before_the_first_update_the_ratio_is_one_and_nothing_is_clipped(fixture, request):
    loop, traj, active = request.getfixturevalue(fixture)
    m = _stats(loop, traj, active)
    assert m["train/ratio_abs_minus_1"] == 0.0 and m["train/clipfrac"] == 0.0 and m["train/approx_kl"] == 0.0
    if fixture == "guard":
        assert m["train/guard_ratio_mean"] == 1.0 and m["train/guard_bias"] == 0.0
    else:
        assert m["train/dppo_kl"] == 0.0
    assert m["train/kl_loss"] == 0.0  # LoRA B starts at 0: the policy is the reference


@pytest.mark.parametrize("fixture", ["guard", "dppo"])
def test_gradient_does_not_depend_on_the_micro_batch_split(fixture, request):
    loop, traj, active = request.getfixturevalue(fixture)
    assert _relative_split_error(loop, traj, active) <= 1e-5


def test_the_old_forward_reproduces_the_rollout_step_and_moves_with_the_old_weights(guard):
    loop, traj, active = guard
    objective, policy = loop.backend.worker.objective, loop.backend.worker.policy
    sl, j = traj.micro_batches()[0], int(torch.nonzero(traj.sde_mask[0])[0])
    with torch.no_grad():
        live = objective.evaluate(traj, sl, j)
        objective.old_state = policy.lora_state()  # the swap path with the rollout's own weights
        swapped = objective.evaluate(traj, sl, j)
        objective.old_state = {n: p + 0.05 for n, p in policy.lora_state().items()}
        moved = objective.evaluate(traj, sl, j)
        objective.old_state = None
    assert torch.equal(swapped.mean_old, live.out.mean) and torch.equal(swapped.v_old, live.v)
    assert not torch.equal(moved.mean_old, live.out.mean)
    assert torch.equal(moved.out.mean, live.out.mean)  # live weights restored


def test_dppo_masks_recorded_pairs_by_the_formula_once_the_policy_has_moved(dppo):
    loop, traj, active = dppo
    objective, policy = loop.backend.worker.objective, loop.backend.worker.policy
    objective.old_state = policy.lora_state()
    with torch.no_grad():  # move the live policy away from the rollout policy
        for p in policy.params.values():
            p.add_(0.02 * torch.randn_like(p))
    try:
        sl, j = traj.micro_batches()[0], int(torch.nonzero(traj.sde_mask[0])[0])
        with torch.no_grad():
            ev = objective.evaluate(traj, sl, j)
            terms = objective.pair_terms(ev, traj.log_probs[sl, j], traj.advantages[sl])
        ratio = torch.exp(ev.out.log_prob - traj.log_probs[sl, j])
        kl = ((ev.out.mean - ev.mean_old) ** 2).mean(dim=(1, 2, 3)) / (2 * ev.out.step_std**2)
        adv = traj.advantages[sl]
        expected = (kl > 1e-6) & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
        assert torch.equal(terms.extra["clipfrac"].bool(), expected) and (kl > 0).all()
        torch.testing.assert_close(terms.extra["dppo_kl"], kl)
        torch.testing.assert_close(terms.policy_loss, torch.where(expected, torch.zeros_like(adv), -adv * ratio))
    finally:
        policy.load_lora_state(objective.old_state)
        objective.old_state = None


# -- Dance-SDE rollouts, end to end, checkpoints, configuration --------------------------------------------


def test_dance_rollouts_recompute_exactly_and_train(tmp_path):
    cfg = tiny_config(preset="tiny-cpu-dance")
    loop = build_loop(cfg, tmp_path / "dance", progress=False)
    loop.backend.push_weights(0)
    traj = loop.backend.rollout(0)
    assert traj.sde_type == "dance" and traj.noise_level == pytest.approx(0.3)
    diff, count = loop.backend.worker.objective.recompute_log_prob_diff(traj)
    assert count == int(traj.sde_mask.sum()) and diff <= 1e-6
    loop.close()
    result = train(cfg, tmp_path / "run", resume=None)
    assert result.steps_done == 2 and all(np.isfinite(m["train/loss"]) for m in result.metrics)


@pytest.mark.parametrize("preset", ["tiny-cpu-grpo-guard", "tiny-cpu-dppo"])
def test_preset_trains_two_steps_and_another_objective_cannot_resume_it(preset, tmp_path):
    result = train(tiny_config(preset=preset), tmp_path, resume=None)
    assert result.steps_done == 2
    for m in result.metrics:
        assert m["train/log_prob_mean_abs_diff"] <= 1e-6 and m["train/skipped_updates"] == 0
        assert all(np.isfinite(m[f"train/{k}"]) for k in ("loss", "policy_loss", "approx_kl", "clipfrac"))
    other = tiny_config("train.steps=3", "algorithm.name=flow_grpo", preset=preset)
    with pytest.raises(CheckpointMismatch, match="algorithm"):
        train(other, tmp_path, resume="auto")


def test_configuration_fails_closed():
    with pytest.raises(ConfigError, match="exact Gaussian"):
        tiny_config("sampling.sde_type=cps", preset="tiny-cpu-grpo-guard")
    with pytest.raises(ConfigError, match="stochastic rollouts"):
        tiny_config("sampling.sde_type=ode", preset="tiny-cpu-dppo")
    with pytest.raises(ConfigError, match="sglang"):
        tiny_config("sampling.engine=sglang", preset="tiny-cpu-dance")
    with pytest.raises(ConfigError, match="kl_space=x"):
        tiny_config("algorithm.kl_space=x", preset="tiny-cpu-nft")
    assert tiny_config("sampling.sde_type=dance", preset="tiny-cpu-grpo-guard").algorithm.name == "grpo_guard"


def test_dance_steps_are_refused_by_the_sglang_engine():
    from diffusionrl.rollout.base import SamplingSpec
    from diffusionrl.rollout.sglang.engine import SGLangRolloutEngine

    engine = SGLangRolloutEngine.__new__(SGLangRolloutEngine)  # no server: the check comes first
    spec = SamplingSpec(resolution=32, num_steps=4, guidance_scale=1.0, sde_type="dance")
    with pytest.raises(NotImplementedError, match="Dance-SDE"):
        engine.generate(["a"], [0], [1], spec)


def test_dance_is_not_flow_sde():
    x, v = torch.ones(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)
    sde = step_with_logprob(v, x, 0.5, 0.4, sde_type="sde", noise_level=0.3, x_next=x)
    dance = step_with_logprob(v, x, 0.5, 0.4, sde_type="dance", noise_level=0.3, x_next=x)
    assert dance.std.item() == pytest.approx(0.3) and sde.std.item() == pytest.approx(0.3)  # equal only at sigma 1/2
    sde2 = step_with_logprob(v, x, 0.8, 0.7, sde_type="sde", noise_level=0.3, x_next=x)
    dance2 = step_with_logprob(v, x, 0.8, 0.7, sde_type="dance", noise_level=0.3, x_next=x)
    assert sde2.std.item() == pytest.approx(0.6) and dance2.std.item() == pytest.approx(0.3)
