"""DiffusionNFT: the loss by hand, its gradient, the old policy, and the loop invariants."""

import dataclasses

import numpy as np
import pytest
import torch

from diffusionrl.algorithms.nft import nft_optimality, nft_terms, noisy_latents, old_policy_eta
from diffusionrl.config import ConfigError, load_config
from diffusionrl.run import CheckpointMismatch
from diffusionrl.train import build_loop
from diffusionrl.training.nft import TimestepPlan
from diffusionrl.training.trainer import UpdateStats

from .conftest import run_interrupted_and_uninterrupted, saved_lora, started_loop, tiny_config

NFT = "tiny-cpu-nft"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the loss, by hand ---------------------------------------------------------------------------------


def _hand_case():
    """One sample, two elements: x0 = [1, -1], eps = [1, 1], t = 0.5 -> x_t = [1, 0].

    v_theta = [4, 0], v_old = [2, 0], b = 1:
      x0_pos = x_t - t v_theta           = [-1, 0], error [-2, 1], w_pos = 1.5, positive = 2.5 / 1.5 = 5/3
      x0_neg = x_t - t (2 v_old - v_theta) = [1, 0], error [0, 1],  w_neg = 0.5, negative = 0.5 / 0.5 = 1
    """
    x0 = torch.tensor([[[[1.0, -1.0]]]])
    eps = torch.tensor([[[[1.0, 1.0]]]])
    x_t = noisy_latents(x0, eps, 0.5)
    v_old = torch.tensor([[[[2.0, 0.0]]]])
    v_theta = torch.tensor([[[[4.0, 0.0]]]], requires_grad=True)
    return x0, eps, x_t, v_theta, v_old


def test_hand_worked_loss_r1_pulls_only_the_positive_branch_and_r0_only_the_negative():
    x0, eps, x_t, v, v_old = _hand_case()
    assert torch.equal(x_t, torch.tensor([[[[1.0, 0.0]]]]))
    cases = {5.0: (25 / 3, [10 / 3, -5 / 3]), -5.0: (5.0, [0.0, 5.0]), 0.0: (20 / 3, None)}
    for adv, (loss, grad) in cases.items():
        v.grad = None
        terms = nft_terms(v, v_old, x0, x_t, 0.5, torch.tensor([adv]), beta=1.0, adv_clip=5.0)
        assert terms.positive.item() == pytest.approx(5 / 3) and terms.negative.item() == pytest.approx(1.0)
        assert terms.w_pos.item() == pytest.approx(1.5) and terms.w_neg.item() == pytest.approx(0.5)
        assert terms.loss.item() == pytest.approx(loss, rel=1e-6)
        terms.loss.sum().backward()
        if grad is not None:  # d/dv of 5 * mean((x_t - t v - x0)^2) / w, the one live branch
            assert v.grad.flatten().tolist() == pytest.approx(grad, rel=1e-6)
    # r = 1 with b = 1: the old policy does not enter; -grad points at the target velocity eps - x0.
    for other_old in (v_old, v_old + 3.0):
        v.grad = None
        nft_terms(v, other_old, x0, x_t, 0.5, torch.tensor([5.0])).loss.sum().backward()
        target = eps - x0
        cos = torch.nn.functional.cosine_similarity((-v.grad).flatten(), (target - v.detach()).flatten(), dim=0)
        assert cos.item() == pytest.approx(1.0, abs=1e-6)
    assert nft_optimality(torch.tensor([-9.0, -5.0, 0.0, 2.5, 5.0, 9.0]), 5.0).tolist() == [0, 0, 0.5, 0.75, 1, 1]


def test_gradient_at_the_reference_settings_matches_finite_differences():
    g = torch.Generator().manual_seed(0)
    shape = (3, 2, 2, 2)
    x0, eps, v_old, v_ref = (torch.randn(shape, generator=g) for _ in range(4))
    v = (v_old + 0.3 * torch.randn(shape, generator=g)).requires_grad_()
    t = torch.tensor([0.9, 0.5, 0.2])
    adv = torch.tensor([2.0, -1.0, 7.0])
    x_t = noisy_latents(x0, eps, t)
    kw = dict(beta=1.0, adv_clip=5.0, kl_beta=1e-4, v_ref=v_ref)  # the reference's settings
    terms = nft_terms(v, v_old, x0, x_t, t, adv, **kw)
    terms.loss.mean().backward()
    grad = v.grad.flatten()
    weights = (terms.w_pos, terms.w_neg)  # detached in the loss: hold them fixed

    def loss_at(x: torch.Tensor) -> float:
        return float(nft_terms(x, v_old, x0, x_t, t, adv, weights=weights, **kw).loss.double().mean())

    h = 1e-2  # the loss is quadratic in v for fixed weights: central differences are exact but for rounding
    fd = torch.zeros_like(grad)
    base = v.detach().flatten()
    for i in range(base.numel()):
        e = torch.zeros_like(base)
        e[i] = h
        fd[i] = (loss_at((base + e).reshape(shape)) - loss_at((base - e).reshape(shape))) / (2 * h)
    cos = torch.nn.functional.cosine_similarity(grad, fd, dim=0)
    assert cos.item() > 1 - 1e-6
    assert float((grad - fd).norm() / fd.norm()) < 1e-3


# -- the objective in the loop ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    cfg = tiny_config("algorithm.old_policy_rate=0.1", preset=NFT)
    with started_loop(cfg, tmp_path_factory.mktemp("nft")) as lp:
        yield lp


def test_timestep_plan_is_per_sample_and_independent_of_the_batch():
    plan = TimestepPlan.draw(0, 3, 0, np.arange(8), num_steps=4, shape=(2, 2, 2))
    assert plan.indices.shape == (8, 3)
    assert all(len(set(row)) == 3 and set(row) <= {0, 1, 2, 3} for row in plan.indices.tolist())
    small = TimestepPlan.draw(0, 3, 0, np.arange(4), num_steps=4, shape=(2, 2, 2))
    assert np.array_equal(plan.indices[:4], small.indices)
    assert torch.equal(plan.noise(range(2, 4), 1), small.noise(range(2, 4), 1))
    assert not np.array_equal(plan.indices, TimestepPlan.draw(0, 4, 0, np.arange(8), 4, (2, 2, 2)).indices)


def test_group_keys_share_noise_levels_and_noise_within_a_group_only():
    groups = np.repeat(np.arange(10, 13), 4)  # three prompt groups of four samples
    plan = TimestepPlan.draw(0, 3, 0, groups, num_steps=6, shape=(2, 2, 2))
    noise = plan.noise(range(12), 2)
    for g in range(3):
        rows = slice(4 * g, 4 * g + 4)
        assert (plan.indices[rows] == plan.indices[4 * g]).all()
        assert torch.equal(noise[rows], noise[4 * g].expand(4, -1, -1, -1))
    assert not torch.equal(noise[0], noise[4]) and not np.array_equal(plan.indices[0], plan.indices[8])


def test_group_renoise_keeps_the_gradient_independent_of_the_micro_batch_split(tmp_path):
    cfg = tiny_config("algorithm.group_renoise=true", preset=NFT)
    lp = build_loop(cfg, tmp_path, progress=False)
    try:
        lp.backend.push_weights(0)
        traj, active, _ = lp.backend.score(lp.backend.rollout(0))
        obj = lp.backend.worker.objective
        plan = obj.plan(traj, 0, 0)
        first = traj.group_ids == traj.group_ids[0]
        assert (plan.indices[first.numpy()] == plan.indices[0]).all()
        one, many = _grads(lp, traj, active, micro=8), _grads(lp, traj, active, micro=2)
        num = max(float((one[n] - many[n]).norm()) for n in one)
        assert num / max(float(one[n].norm()) for n in one) <= 1e-5
    finally:
        lp.close()


def test_a_unit_feeds_t_times_1000_and_uses_old_live_and_reference_weights(loop, scored, monkeypatch):
    traj, active = scored
    obj, policy = loop.backend.worker.objective, loop.backend.worker.policy
    name = next(n for n in policy.params if "lora_B" in n)
    saved_old = obj.old.shadow
    obj.old.shadow = {n: p.detach().clone() + 0.01 for n, p in policy.params.items()}  # old != live
    calls = []
    real = loop.backend.worker.adapter.velocity

    def spy(model, x, timestep, cond, g, g2=None):
        calls.append((timestep.clone(), policy.params[name].detach().clone(), torch.is_grad_enabled()))
        return real(model, x, timestep, cond, g, g2)

    monkeypatch.setattr(loop.backend.worker.adapter, "velocity", spy)
    live = policy.lora_state()
    plan = obj.plan(traj, step=0, epoch=0)
    units = obj.units(traj, traj.micro_batches(), active, plan)
    assert len(units) == len(traj.micro_batches()) * (traj.num_steps - 1)
    units[1].compute()
    obj.old.shadow = saved_old
    sl = traj.micro_batches()[0]
    expected_t = traj.sigmas[torch.as_tensor(plan.indices[sl, 1])] * 1000
    assert len(calls) == 3  # old, trained, reference (kl_beta > 0)
    assert all(torch.equal(c[0], expected_t) for c in calls)
    assert torch.equal(calls[0][1], live[name] + 0.01) and not calls[0][2]  # old weights, no grad
    assert torch.equal(calls[1][1], live[name]) and calls[1][2]  # live weights, with grad
    assert not calls[2][2]
    assert all(torch.equal(live[n], p) for n, p in policy.lora_state().items())  # live restored


def _grads(loop, traj, active, micro):
    traj = dataclasses.replace(traj, micro_batch_size=micro)
    trainer, objective = loop.backend.worker.trainer, loop.backend.worker.objective
    trainer.optimizer.zero_grad(set_to_none=True)
    units = objective.units(traj, traj.micro_batches(), active, objective.plan(traj, step=0, epoch=0))
    assert trainer.accumulate(units, UpdateStats())
    grads = {n: p.grad.detach().clone() for n, p in loop.backend.worker.policy.params.items()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def test_gradient_does_not_depend_on_the_micro_batch_split(loop, scored):
    traj, active = scored
    one = _grads(loop, traj, active, micro=8)
    many = _grads(loop, traj, active, micro=2)
    num = max(float((one[n] - many[n]).norm()) for n in one)
    den = max(float(one[n].norm()) for n in one)
    assert den > 0 and num / den <= 1e-5


def test_nft_timesteps_trains_the_first_k_levels_of_the_same_plan_and_keeps_the_split_exact(loop, scored, monkeypatch):
    """``algorithm.nft_timesteps = k``: each sample's first k noise levels (and noises) of the order
    the full plan draws, k units per micro-batch, the gradient still independent of the split."""
    traj, active = scored
    obj = loop.backend.worker.objective
    full = obj.plan(traj, step=0, epoch=0)
    monkeypatch.setattr(obj.cfg.algorithm, "nft_timesteps", 2)
    part = obj.plan(traj, step=0, epoch=0)
    assert part.slots == 2 < full.slots == traj.num_steps - 1
    assert np.array_equal(part.indices, full.indices[:, :2])
    assert all(torch.equal(part.noise(range(8), j), full.noise(range(8), j)) for j in range(2))
    assert len(obj.units(traj, traj.micro_batches(), active, part)) == 2 * len(traj.micro_batches())
    one, many = _grads(loop, traj, active, micro=8), _grads(loop, traj, active, micro=2)
    assert max(float((one[n] - many[n]).norm()) for n in one) / max(float(one[n].norm()) for n in one) <= 1e-5
    monkeypatch.setattr(obj.cfg.algorithm, "nft_timesteps", 0)
    every = _grads(loop, traj, active, micro=8)
    assert any(not torch.allclose(every[n], one[n]) for n in one)  # another set of levels: another gradient


def test_a_step_trains_every_tensor_moves_the_old_policy_by_eta_and_pushes_it(loop, scored):
    traj, active = scored
    obj = loop.backend.worker.objective
    loop.backend.update(traj, active, step=0)  # now old != live
    old_before = obj.old.state()
    live_before = loop.backend.worker.policy.lora_state()
    metrics = loop.run_step(1)  # rollout with the old policy, update, old-policy EMA, weight push
    live = loop.backend.worker.policy.lora_state()
    eta = min(0.1 * 2, 0.5)  # rate 0.1, flat 0, cap 0.5, after 2 completed steps
    assert metrics["train/old_policy_eta"] == pytest.approx(eta)
    for n, value in live.items():
        assert not torch.equal(value, live_before[n]), n
        assert torch.equal(obj.old.shadow[n], old_before[n].mul(eta).add(value, alpha=1 - eta)), n
    engine = dict(loop.backend.worker.engine.transformer.named_parameters())
    assert all(torch.equal(engine[n], obj.old.shadow[n]) for n in live)  # the old policy, not the live one
    assert all(not torch.equal(engine[n], live[n]) for n in live)
    for key in ("nft_loss", "nft_pos", "nft_neg", "nft_r_mean", "kl_loss", "loss", "grad_norm", "lr",
                "skipped_updates"):
        assert np.isfinite(metrics[f"train/{key}"]), key
    assert metrics["train/optimizer_steps"] == 1 and metrics["train/skipped_updates"] == 0
    assert 0 <= metrics["train/nft_r_mean"] <= 1 and metrics["train/kl_loss"] > 0


def test_old_policy_eta_rule():
    assert [old_policy_eta(s, 0.001, 0, 0.5) for s in (0, 1, 10)] == pytest.approx([0.0, 0.001, 0.01])
    assert old_policy_eta(10_000, 0.001, 0, 0.5) == 0.5
    assert [old_policy_eta(s, 0.0075, 75, 0.999) for s in (10, 75, 76)] == pytest.approx([0.0, 0.0, 0.0075])


# -- checkpoints -------------------------------------------------------------------------------------


def test_resume_equals_uninterrupted(tmp_path):
    cfg = tiny_config("train.steps=3", "train.ema=true", "algorithm.old_policy_rate=0.2", preset=NFT)
    full, resumed, result = run_interrupted_and_uninterrupted(cfg, tmp_path)

    assert result.steps_done == 3
    a, b = saved_lora(tmp_path / "full"), saved_lora(tmp_path / "part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    old_a, old_b = full.backend.worker.objective.old.shadow, resumed.backend.worker.objective.old.shadow
    assert all(torch.equal(old_a[k], old_b[k]) for k in old_a)
    assert ([m["rollout/reward/raw_mean"] for m in full.history]
            == [m["rollout/reward/raw_mean"] for m in resumed.history])


def test_resume_across_algorithms_fails_closed(tmp_path):
    nft = tiny_config("train.steps=1", preset=NFT)
    grpo = tiny_config("train.steps=2", "algorithm.name=flow_grpo", preset=NFT)  # differs only in the algorithm
    build_loop(nft, tmp_path / "a", progress=False).run(resume=None)
    with pytest.raises(CheckpointMismatch, match="algorithm"):
        build_loop(grpo, tmp_path / "a", progress=False).run(resume="auto")
    build_loop(grpo, tmp_path / "b", progress=False).run(resume=None, stop_after=1)
    with pytest.raises(CheckpointMismatch, match="algorithm"):
        build_loop(tiny_config("train.steps=2", preset=NFT), tmp_path / "b", progress=False).run(resume="auto")


def test_missing_old_policy_tensors_are_rejected(loop):
    with pytest.raises(CheckpointMismatch, match="old-policy"):
        loop.backend.worker.objective.load_state_tensors({"ema": {}})


# -- configuration ---------------------------------------------------------------------------------------


def test_nft_presets_and_validation():
    tiny = load_config(NFT)
    assert (tiny.algorithm.name, tiny.sampling.guidance_scale, tiny.algorithm.nft_beta) == ("nft", 1.0, 1.0)
    ref = load_config("sd35m-pickscore-nft")
    assert (ref.train.prompts_per_step, ref.train.group_size, ref.train.minibatches,
            ref.train.inner_epochs, ref.train.world_size) == (48, 24, 1, 1, 8)  # the reference's 8 GPUs
    assert (ref.model.lora_rank, ref.model.lora_alpha, ref.sampling.resolution, ref.eval.num_steps) == (32, 64, 512, 40)
    assert ref.reward.weights == {"pickscore": 1.0} and ref.train.mixed_precision == "fp16"
    assert ref.sampling.guidance_scale == 1.0 and ref.algorithm.kl_beta == 1e-4
    with pytest.raises(ConfigError, match="nft_adv_clip"):
        load_config(NFT, overrides=["algorithm.nft_adv_clip=10"])
    with pytest.raises(ConfigError, match="old_policy_rate"):
        load_config(NFT, overrides=["algorithm.old_policy_rate=-0.1"])
    steps = tiny.sampling.num_steps
    assert load_config(NFT, overrides=[f"algorithm.nft_timesteps={steps - 1}"]).algorithm.nft_timesteps == steps - 1
    with pytest.raises(ConfigError, match=rf"nft_timesteps={steps} exceeds the rollout's {steps - 1} trainable"):
        load_config(NFT, overrides=[f"algorithm.nft_timesteps={steps}"])
