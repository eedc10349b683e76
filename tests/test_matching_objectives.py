"""Advantage Weighted Matching and online Diffusion-DPO: the maths by hand, finite differences, and the
loop invariants (docs/algorithms.md section 14)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from diffusionrl.algorithms.awm import awm_terms, flow_matching_error
from diffusionrl.algorithms.dpo import dpo_terms, preference_pairs
from diffusionrl.config import ConfigError
from diffusionrl.run import CheckpointMismatch
from diffusionrl.train import build_loop, train
from diffusionrl.training.trainer import UpdateStats

from .conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _fd_check(loss_at, x0: torch.Tensor, grad: torch.Tensor, h: float = 1e-3) -> None:
    base = x0.detach().flatten()
    fd = torch.zeros_like(base)
    for i in range(base.numel()):
        e = torch.zeros_like(base)
        e[i] = h
        fd[i] = (loss_at((base + e).reshape(x0.shape)) - loss_at((base - e).reshape(x0.shape))) / (2 * h)
    torch.testing.assert_close(grad.flatten(), fd, rtol=1e-6, atol=1e-9)


# -- AWM: the maths ------------------------------------------------------------------------------------


def test_awm_hand_worked_loss_and_gradient():
    """x0 = [1, -1], eps = [1, 1]: the target velocity eps - x0 = [0, 2]; v = [1, 1] -> error 1."""
    x0, eps = torch.tensor([[[[1.0, -1.0]]]]), torch.tensor([[[[1.0, 1.0]]]])
    v = torch.tensor([[[[1.0, 1.0]]]], requires_grad=True)
    terms = awm_terms(v, x0, eps, torch.tensor([2.0]), kl_beta=0.5, v_ref=torch.zeros(1, 1, 1, 2))
    assert terms.fm_error.item() == 1.0 and terms.policy_loss.item() == 2.0 and terms.kl.item() == 1.0
    assert terms.loss.item() == 2.5
    terms.loss.sum().backward()
    # d/dv: A * 2 (v - target) / D + kl_beta * 2 (v - v_ref) / D = [2, -2] + [0.5, 0.5]
    assert v.grad.flatten().tolist() == [2.5, -1.5]
    for adv, sign in ((1.0, 1.0), (-1.0, -1.0)):  # A > 0 pulls v to eps - x0, A < 0 pushes it away
        v.grad = None
        awm_terms(v, x0, eps, torch.tensor([adv])).loss.sum().backward()
        cos = torch.nn.functional.cosine_similarity((-v.grad).flatten(), (eps - x0 - v.detach()).flatten(), dim=0)
        assert cos.item() == pytest.approx(sign, abs=1e-6)


def test_awm_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(0)
    x0, eps, v_ref = (torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64) for _ in range(3))
    v = torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.5, -0.5, 0.0], dtype=torch.float64)

    def loss_at(x):
        return float(awm_terms(x, x0, eps, adv, kl_beta=0.1, v_ref=v_ref).loss.sum())

    awm_terms(v, x0, eps, adv, kl_beta=0.1, v_ref=v_ref).loss.sum().backward()
    _fd_check(loss_at, v, v.grad)


# -- DPO: the maths --------------------------------------------------------------------------------------


def test_dpo_pairs_are_formed_inside_groups_from_the_advantages():
    adv = torch.tensor([0.5, -1.0, 2.0, -1.5, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3, 5, 5])
    assert preference_pairs(adv, groups, "best_worst").tolist() == [[2, 3], [8, 9]]  # the all-equal group: none
    assert preference_pairs(adv, groups, "all").tolist() == [[0, 1], [0, 3], [2, 1], [2, 3], [8, 9]]
    assert preference_pairs(torch.zeros(2), torch.tensor([0, 0]), "all").shape == (0, 2)


def test_dpo_hand_worked_loss_and_gradient():
    err_w, err_l = torch.tensor([1.0], requires_grad=True), torch.tensor([2.0], requires_grad=True)
    terms = dpo_terms(err_w, err_l, torch.tensor([1.5]), torch.tensor([1.8]), beta=2.0)
    # inside = -beta/2 [(1 - 1.5) - (2 - 1.8)] = 0.7, loss = log(1 + e^-0.7)
    assert terms.inside.item() == pytest.approx(0.7)
    assert terms.loss.item() == pytest.approx(math.log1p(math.exp(-0.7)), rel=1e-6)
    terms.loss.sum().backward()
    sig = 1 / (1 + math.exp(0.7))  # d loss / d err_w = sigmoid(-inside) * beta/2, the loser's the negative
    assert err_w.grad.item() == pytest.approx(sig, rel=1e-6) and err_l.grad.item() == pytest.approx(-sig, rel=1e-6)
    same = dpo_terms(torch.ones(3), torch.full((3,), 2.0), torch.ones(3), torch.full((3,), 2.0), beta=5000.0)
    assert torch.equal(same.loss, torch.full((3,), math.log(2.0)))  # policy == reference: log 2


def test_dpo_gradient_through_the_velocities_matches_finite_differences():
    g = torch.Generator().manual_seed(1)
    x0w, x0l, eps, vr_w, vr_l = (torch.randn(2, 2, 2, 2, generator=g, dtype=torch.float64) for _ in range(5))
    vw = (vr_w + 0.1 * torch.randn(2, 2, 2, 2, generator=g, dtype=torch.float64)).requires_grad_()
    vl = vr_l + 0.1 * torch.randn(2, 2, 2, 2, generator=g, dtype=torch.float64)

    def loss(v):
        return dpo_terms(flow_matching_error(v, x0w, eps), flow_matching_error(vl, x0l, eps),
                         flow_matching_error(vr_w, x0w, eps), flow_matching_error(vr_l, x0l, eps), beta=3.0).loss.sum()

    loss(vw).backward()
    _fd_check(lambda v: float(loss(v)), vw, vw.grad)


# -- the objectives in the loop ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def awm(tmp_path_factory):
    lp = build_loop(tiny_config(preset="tiny-cpu-awm"), tmp_path_factory.mktemp("awm"), progress=False)
    lp.backend.push_weights(0)
    traj, active, _ = lp.backend.score(lp.backend.rollout(0))
    yield lp, traj, active
    lp.close()


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    lp = build_loop(tiny_config("algorithm.dpo_pairs=all", preset="tiny-cpu-dpo"), tmp_path_factory.mktemp("dpo"),
                    progress=False)
    lp.backend.push_weights(0)
    traj, active, _ = lp.backend.score(lp.backend.rollout(0))
    yield lp, traj, active
    lp.close()


def _units(loop, traj, active, micro):
    objective = loop.backend.worker.objective
    if objective.name == "awm":
        traj = dataclasses.replace(traj, micro_batch_size=micro)
        return objective.units(traj, traj.micro_batches(), active, objective.plan(traj, step=0, epoch=0))
    return objective.units(traj, objective.chunks(objective.pairs(traj, active), micro), step=0, epoch=0)


def _grads(loop, traj, active, micro):
    trainer = loop.backend.worker.trainer
    trainer.optimizer.zero_grad(set_to_none=True)
    assert trainer.accumulate(_units(loop, traj, active, micro), UpdateStats())
    grads = {n: p.grad.detach().clone() for n, p in loop.backend.worker.policy.params.items()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("fixture", ["awm", "dpo"])
def test_gradient_does_not_depend_on_the_micro_batch_split(fixture, request):
    loop, traj, active = request.getfixturevalue(fixture)
    one, many = _grads(loop, traj, active, 8), _grads(loop, traj, active, 2)
    num = max(float((one[n] - many[n]).norm()) for n in one)
    den = max(float(one[n].norm()) for n in one)
    assert den > 0 and num / den <= 1e-5


def test_awm_rollouts_are_ode_and_a_unit_is_the_formula_on_the_recorded_latents(awm):
    loop, traj, active = awm
    objective, adapter = loop.backend.worker.objective, loop.backend.worker.adapter
    assert traj.sde_type == "ode" and not traj.sde_mask.any() and loop.backend.metadata()["sde_type"] == "ode"
    plan = objective.plan(traj, step=0, epoch=0)
    sl, slot = traj.micro_batches()[0], 1
    with torch.no_grad():
        loss_sum, stats = objective._make(traj, sl, slot, active[sl], plan)()
        x0 = traj.latents[sl, -1]
        t = traj.sigmas[torch.as_tensor(plan.indices[sl, slot])]
        eps = plan.noise(range(sl.start, sl.stop), slot)
        x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        v = adapter.velocity(objective.policy.model, x_t, t * 1000, traj.conditioning.select(sl), 1.0)
        error = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
        with objective.policy.reference():
            v_ref = adapter.velocity(objective.policy.model, x_t, t * 1000, traj.conditioning.select(sl), 1.0)
        expected = (active[sl] * (traj.advantages[sl] * error + 1e-3 * ((v - v_ref) ** 2).mean(dim=(1, 2, 3)))).sum()
    torch.testing.assert_close(loss_sum, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats["awm_fm_error"], (active[sl] * error).sum(), rtol=1e-6, atol=1e-7)


def test_dpo_pairs_share_timestep_and_noise_and_start_at_log_2(dpo, monkeypatch):
    loop, traj, active = dpo
    objective, adapter = loop.backend.worker.objective, loop.backend.worker.adapter
    assert traj.sde_type == "ode"
    pairs = objective.pairs(traj, active)
    assert len(pairs) > 0 and all(traj.group_ids[w] == traj.group_ids[lo] for w, lo in pairs.tolist())
    assert all(traj.advantages[w] > 0 > traj.advantages[lo] for w, lo in pairs.tolist())
    calls = []
    real = adapter.velocity

    def spy(model, x, timestep, cond, g, g2=None):
        calls.append((x.clone(), timestep.clone()))
        return real(model, x, timestep, cond, g, g2)

    monkeypatch.setattr(adapter, "velocity", spy)
    stats = UpdateStats()
    with torch.no_grad():
        for unit in _units(loop, traj, active, 4):
            _, unit_stats = unit.compute()
            for key, value in unit_stats.items():
                stats.add(key, float(value), unit.count)
    m = stats.means()
    assert m["train/loss"] == pytest.approx(math.log(2.0), abs=1e-7)  # the policy starts as the reference
    assert m["train/dpo_margin"] == 0.0 and m["train/dpo_accuracy"] == 0.0
    x, timestep = calls[0]
    p = x.shape[0] // 2
    assert torch.equal(timestep[:p], timestep[p:])  # shared noise level
    chunk = objective.chunks(pairs, 4)[0]
    t = (timestep[:p] / 1000)[:, None, None, None]
    x0 = traj.latents[torch.cat([chunk[:, 0], chunk[:, 1]]), -1]
    noise = (x - (1 - torch.cat([t, t])) * x0) / torch.cat([t, t])
    torch.testing.assert_close(noise[:p], noise[p:], rtol=1e-4, atol=1e-4)  # shared noise


def test_dpo_preset_beta_keeps_the_margin_out_of_saturation_after_an_adam_step(dpo):
    """An Adam step moves each pair's (err_w - ref_w) - (err_l - ref_l) by an amount set by lr, not by beta
    (Adam normalises the gradient): the preset's beta keeps beta/2 times it in the sigmoid's linear range,
    where Diffusion-DPO's 5000 at the same lr saturates it after one step (algorithms/dpo.py)."""
    loop, traj, active = dpo
    objective, trainer, policy = loop.backend.worker.objective, loop.backend.worker.trainer, loop.backend.worker.policy
    beta, lr = objective.cfg.algorithm.dpo_beta, objective.cfg.train.learning_rate
    assert beta * lr <= 0.1
    start = policy.lora_state()
    try:
        assert trainer.apply(_units(loop, traj, active, 4), UpdateStats())
        diffs = []
        with torch.no_grad():
            for chunk in objective.chunks(objective.pairs(traj, active), 4):
                plan = [objective.slots(traj, (w, lo), 0, 0) for w, lo in chunk.tolist()]
                for slot in range(traj.num_steps - 1):
                    err_w, err_l, ref_w, ref_l = objective.errors(traj, chunk, plan, slot, 0, 0)
                    diffs.append(((err_w - ref_w) - (err_l - ref_l)).abs())
        step = float(torch.cat(diffs).max())
        assert beta / 2 * step < 1.0  # the preset: linear range
        assert 5000.0 / 2 * step > 5.0  # Diffusion-DPO's beta: saturated
    finally:
        policy.load_lora_state(start)


@pytest.mark.parametrize("preset", ["tiny-cpu-awm", "tiny-cpu-dpo"])
def test_preset_trains_two_steps_and_another_objective_cannot_resume_it(preset, tmp_path):
    result = train(tiny_config(preset=preset), tmp_path, resume=None)
    assert result.steps_done == 2
    for m in result.metrics:
        assert m["train/skipped_updates"] == 0 and m["train/optimizer_steps"] == 1
        assert np.isfinite(m["train/loss"]) and np.isfinite(m["train/policy_loss"])
    other = tiny_config("train.steps=3", "algorithm.name=nft", preset=preset)
    with pytest.raises(CheckpointMismatch, match="algorithm"):
        train(other, tmp_path, resume="auto")


def test_configuration_fails_closed():
    with pytest.raises(ConfigError, match="kl_space=x"):
        tiny_config("algorithm.kl_space=x", preset="tiny-cpu-awm")
    with pytest.raises(ConfigError, match="dpo_pairs"):
        tiny_config("algorithm.dpo_pairs=random", preset="tiny-cpu-dpo")
    with pytest.raises(ConfigError, match="dpo_beta"):
        tiny_config("algorithm.dpo_beta=0", preset="tiny-cpu-dpo")


@pytest.mark.parametrize("override", ["train.minibatches=2", "train.inner_epochs=2"])
def test_awm_refuses_more_than_one_optimizer_step_per_rollout(override):
    """AWM has no ratio or clip (docs/algorithms.md 14.4): an update after the first would be off-policy."""
    with pytest.raises(ConfigError, match=r"algorithm.name=awm .*no ratio or clip.*train.minibatches=1 and "
                                          r"train.inner_epochs=1"):
        tiny_config(override, preset="tiny-cpu-awm")
    tiny_config(override, preset="tiny-cpu-nft")  # the other re-noising objective takes it
