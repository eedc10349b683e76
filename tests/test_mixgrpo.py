"""MixGRPO (``sampling.step_strategy=mix_window``) and MixGRPO-Flash (``sampling.ode_solver=dpm2m``):
one SDE window for every group that slides with training, ODE steps outside it; only the window's
steps carry log-probs; recompute, micro-batch split and resume are exact (docs/algorithms.md 2-3)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from diffusionrl.algorithms.sde import dpm_solver_2m_step, mix_window_start, sde_step_mask
from diffusionrl.config import ConfigError
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.train import build_loop

from .conftest import run_interrupted_and_uninterrupted, saved_lora, tiny_config
from .family_checks import recompute_diff, split_rel_diff


def test_the_window_is_shared_contiguous_and_slides_every_interval_then_restarts():
    starts = []
    for step in range(14):
        mask = sde_step_mask("mix_window", 10, [5, 9, 11], num_sde_steps=3, window_range=[1, 8], epoch=step,
                             shift_interval=2, stride=2)
        assert (mask == mask[0]).all()  # one window for every group
        idx = np.flatnonzero(mask[0])
        assert len(idx) == 3 and np.all(np.diff(idx) == 1) and idx[0] >= 1 and idx[-1] < 8
        starts.append(int(idx[0]))
    # positions 1, 3, 5 ((8 - 1 - 3) // 2 + 1 = 3), each held for 2 steps, then back to 1
    assert starts == [1, 1, 3, 3, 5, 5, 1, 1, 3, 3, 5, 5, 1, 1]
    assert mix_window_start(5, 3, [1, 8], 2, 2) == 5 and mix_window_start(7, 3, [1, 8], 2, 2) == 1
    with pytest.raises(ValueError, match="no window"):
        mix_window_start(0, 4, [0, 3])


def test_dpm_solver_2m_matches_diffusers_multistep_scheduler():
    """Our DPM-Solver++(2M) on the flow ODE against diffusers' DPMSolverMultistepScheduler (flow sigmas,
    data prediction, 2nd order, first order on the first and the last step), on a smooth velocity field."""
    from diffusers import DPMSolverMultistepScheduler

    sched = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0,
                                        algorithm_type="dpmsolver++", solver_order=2, final_sigmas_type="zero")
    sched.set_timesteps(8)
    sigmas = sched.sigmas.tolist()

    def velocity(x, s):
        return torch.tanh(x) * (1 + s) - 0.3 * x + s

    x0 = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0))
    ref, ours, hist = x0.clone(), x0.clone(), (None, None, None)
    for i, t in enumerate(sched.timesteps):
        ref = sched.step(velocity(ref, sigmas[i]), t, ref).prev_sample
        ours, x0_pred = dpm_solver_2m_step(ours, velocity(ours, sigmas[i]), sigmas[i], sigmas[i + 1], *hist)
        hist = (x0_pred, sigmas[i], None)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # and it is not Euler: a second-order step moves differently from the first-order one
    euler = x0.clone()
    for i in range(len(sigmas) - 1):
        euler = euler + velocity(euler, sigmas[i]) * (sigmas[i + 1] - sigmas[i])
    assert (euler - ref).abs().max() > 1e-3


def test_without_history_the_dpm_step_is_the_euler_step():
    g = torch.Generator().manual_seed(1)
    x, v, prev = (torch.randn(3, 4, 5, 5, generator=g) for _ in range(3))
    euler = x + v * (0.4 - 0.6)
    torch.testing.assert_close(dpm_solver_2m_step(x, v, 0.6, 0.4)[0], euler, rtol=1e-6, atol=1e-6)
    # history only where use_prev holds (a sample whose previous step was stochastic restarts at first order)
    out, _ = dpm_solver_2m_step(x, v, 0.6, 0.4, prev, 0.8, torch.tensor([True, False, True]))
    torch.testing.assert_close(out[1], euler[1], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[0], euler[0])


def test_a_samples_dpm_trajectory_does_not_depend_on_its_micro_batch(tiny_adapter):
    """Per-sample solver history: a sample whose SDE window differs from its batch mates' gets the same
    trajectory alone as beside them."""
    import copy

    spec = SamplingSpec(resolution=32, num_steps=4, guidance_scale=4.5, max_sequence_length=16, ode_solver="dpm2m")
    engine = LocalRolloutEngine(tiny_adapter, copy.deepcopy(tiny_adapter.transformer), micro_batch_size=2)
    mask = np.zeros((2, 4), dtype=bool)
    mask[0, 0], mask[1, 2] = True, True
    both = engine.generate(["a red cat", "a red cat"], [0, 0], [1, 2], spec, mask)
    alone = engine.generate(["a red cat"], [0], [2], spec, mask[1:])
    torch.testing.assert_close(both.latents[1], alone.latents[0], rtol=1e-5, atol=1e-5)
    assert (both.log_probs[0, 1:] == 0).all() and (both.log_probs[1, [0, 1, 3]] == 0).all()


@pytest.fixture(scope="module", params=["euler", "dpm2m"])
def loop(request, tmp_path_factory):
    cfg = tiny_config("algorithm.kl_beta=0.04", "sampling.window_shift_interval=1",
                      f"sampling.ode_solver={request.param}", preset="tiny-cpu-mixgrpo")
    lp = build_loop(cfg, tmp_path_factory.mktemp("mix"), progress=False)
    lp.backend.push_weights(0)
    yield lp
    lp.close()


def test_only_the_windows_steps_carry_log_probs_and_train_exactly(loop):
    # step 1 of a 4-step schedule, window_range [0, 3), 2 SDE steps moving every step: the window is
    # steps 1-2, an ODE step before it and one after it
    traj, active, _ = loop.backend.score(loop.backend.rollout(1))
    assert traj.sde_mask[:, [1, 2]].all() and not traj.sde_mask[:, [0, 3]].any()
    assert (traj.log_probs[:, [1, 2]] != 0).all() and (traj.log_probs[:, [0, 3]] == 0).all()
    units = loop.backend.worker.objective.units(traj, traj.micro_batches(), torch.ones_like(active),
                                                np.random.default_rng(0))
    assert len(units) == 2 * len(traj.micro_batches())  # one unit per (micro-batch, window step)
    assert recompute_diff(loop, traj) <= 1e-6
    assert split_rel_diff(loop, traj, active) <= 1e-5


def test_resume_takes_the_same_windows(tmp_path):
    cfg = tiny_config("train.steps=2", "sampling.window_shift_interval=1", "sampling.ode_solver=dpm2m",
                      preset="tiny-cpu-mixgrpo")
    full, resumed, result = run_interrupted_and_uninterrupted(cfg, tmp_path)  # resumed after step 1
    assert result.steps_done == 2
    a, b = saved_lora(tmp_path / "full"), saved_lora(tmp_path / "part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/reward/raw_mean"] for m in ma] == [m["rollout/reward/raw_mean"] for m in mb]
    masks = [resumed.backend.sample_batch(s)[3] for s in range(3)]
    assert [int(np.flatnonzero(m[0])[0]) for m in masks] == [0, 1, 0]  # windows 0-1, 1-2, then back to 0-1
    # had the resumed step 2 sampled another window than 1-2, the LoRA tensors above would differ


def test_configuration_fails_closed():
    with pytest.raises(ConfigError, match="mix_window is not available with sampling.engine=sglang"):
        tiny_config("sampling.engine=sglang", preset="tiny-cpu-mixgrpo")
    with pytest.raises(ConfigError, match="ode_solver=dpm2m is not available with sampling.engine=sglang"):
        tiny_config("sampling.engine=sglang", "sampling.ode_solver=dpm2m")
    with pytest.raises(ConfigError, match="narrower than num_sde_steps"):
        tiny_config("sampling.num_sde_steps=4", preset="tiny-cpu-mixgrpo")
    with pytest.raises(ConfigError, match="window_stride"):
        tiny_config("sampling.window_stride=0", preset="tiny-cpu-mixgrpo")


def test_the_sglang_engine_refuses_a_second_order_solver_outside_the_window():
    from diffusionrl.rollout.sglang.engine import SGLangRolloutEngine

    engine = SGLangRolloutEngine.__new__(SGLangRolloutEngine)
    spec = dataclasses.replace(SamplingSpec(resolution=32, num_steps=4, guidance_scale=1.0), ode_solver="dpm2m")
    with pytest.raises(NotImplementedError, match="Euler only"):
        engine.generate(["a"], [0], [1], spec)
