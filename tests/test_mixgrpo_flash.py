"""MixGRPO-Flash's time-step compression (``sampling.post_window_ode_steps``): the training rollouts take
fewer, larger ODE steps after the SDE window (docs/algorithms.md 3). The window's steps, their log-probs and
their recompute are those of the uncompressed rollout; the trajectory records the steps actually taken;
evaluation samples the full schedule; the option is refused where there is no window to compress after."""

import dataclasses

import numpy as np
import pytest
import torch

from diffusionrl.algorithms.sde import compressed_steps
from diffusionrl.config import ConfigError
from diffusionrl.evaluation import eval_spec
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.trajectory import read_trajectory, write_step

from .conftest import started_loop, tiny_config
from .family_checks import recompute_diff, split_rel_diff

# 8 steps, a 2-step window sliding over [0, 5) every RL step, the 6 (at step 0) ODE steps after it -> 2
FLASH = ["sampling.num_steps=8", "sampling.window_range=[0, 5]", "sampling.window_shift_interval=1",
         "sampling.post_window_ode_steps=2"]


def test_the_compressed_schedule_keeps_every_step_to_the_windows_end_then_fewer_ending_at_zero():
    mask = np.zeros((3, 10), dtype=bool)
    mask[:, 2:4] = True  # the window: steps 2-3, ends at index 4
    keep = compressed_steps(mask, 10, 3)
    assert keep.tolist() == [0, 1, 2, 3, 4, 6, 8, 10]  # 6 ODE steps after the window -> 3, sigma index 10 = 0 last
    for steps in range(1, 6):
        keep = compressed_steps(mask, 10, steps)
        assert len(keep) == 4 + steps + 1 and keep[0] == 0 and keep[-1] == 10
        assert keep[:5].tolist() == [0, 1, 2, 3, 4] and np.all(np.diff(keep) > 0)
    # nothing to compress: off, as many steps as remain or more, no stochastic step
    for steps, m in ((0, mask), (6, mask), (9, mask), (2, np.zeros(10, dtype=bool))):
        assert compressed_steps(m, 10, steps).tolist() == list(range(11))
    # per-sample masks: compression starts after the last SDE step of any sample
    mask[1, 6] = True
    assert compressed_steps(mask, 10, 1).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10]


@pytest.fixture(scope="module", params=["euler", "dpm2m"])
def loop(request, tmp_path_factory):
    cfg = tiny_config(*FLASH, "algorithm.kl_beta=0.04", f"sampling.ode_solver={request.param}",
                      preset="tiny-cpu-mixgrpo")
    with started_loop(cfg, tmp_path_factory.mktemp("flash")) as lp:
        yield lp


@pytest.fixture(scope="module")
def scored(loop):
    traj, active, _ = loop.backend.score(loop.backend.rollout(1))  # window: steps 1-2
    return traj, active


def test_the_trajectory_records_the_compressed_steps_and_the_window_is_the_uncompressed_rollouts(loop, scored):
    traj, _ = scored
    backend = loop.backend
    prompts, group_ids, seeds, mask, metadata = backend.sample_batch(1)
    full_spec = dataclasses.replace(backend.spec, post_window_ode_steps=0)
    full = backend.worker.generate(prompts, group_ids, seeds, full_spec, mask, metadata)
    keep = [0, 1, 2, 3, 6, 8]  # steps 0-2 (ODE, then the window 1-2), then 5 ODE steps -> 2: sigma indices 3, 6, 8
    assert full.num_steps == 8 and traj.num_steps == 5
    assert torch.equal(traj.sigmas, full.sigmas[keep]) and float(traj.sigmas[-1]) == 0.0
    assert torch.equal(traj.timesteps, full.timesteps[keep[:-1]])
    assert traj.sde_mask[:, [1, 2]].all() and not traj.sde_mask[:, [0, 3, 4]].any()
    assert traj.latents.shape[1] == 6 and traj.log_probs.shape == (traj.batch_size, 5)
    # up to the window's end the compressed rollout is the uncompressed one, bit for bit
    assert torch.equal(traj.latents[:, :4], full.latents[:, :4])
    assert torch.equal(traj.log_probs[:, :3], full.log_probs[:, :3]) and (traj.log_probs[:, [1, 2]] != 0).all()
    assert (traj.log_probs[:, 3:] == 0).all()
    # the larger ODE steps end elsewhere (close: both integrate the same ODE from the same state)
    assert not torch.equal(traj.latents[:, -1], full.latents[:, -1])


def test_recomputed_log_probs_equal_the_rollouts_and_the_split_is_exact(loop, scored):
    diff = recompute_diff(loop, scored[0])
    assert diff <= 1e-6, diff
    assert split_rel_diff(loop, *scored) <= 1e-5


def test_a_compressed_step_trains_and_its_parquet_file_holds_the_steps_taken(loop, scored, tmp_path):
    traj, active = scored
    metrics = loop.backend.update(traj, active, 1)
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and all(np.isfinite(v) for v in metrics.values())
    back = read_trajectory(write_step(tmp_path, traj, run_id="run", step=1, images=False, latents=True))
    assert torch.equal(back.sigmas, traj.sigmas) and torch.equal(back.sde_mask, traj.sde_mask)
    assert torch.equal(back.latents, traj.latents)


def test_evaluation_samples_the_full_schedule(loop):
    cfg = loop.backend.cfg
    spec = eval_spec(cfg)
    assert spec.post_window_ode_steps == 0 and loop.backend.spec.post_window_ode_steps == 2
    assert SamplingSpec.from_config(cfg).post_window_ode_steps == 0
    traj = loop.backend.worker.generate(["a red cat"], [0], [3], spec, None, None)
    assert traj.num_steps == cfg.eval.num_steps


def one_line(*overrides, preset="tiny-cpu-mixgrpo") -> str:
    with pytest.raises(ConfigError) as err:
        tiny_config(*overrides, preset=preset)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_the_option_is_refused_where_there_is_no_window_to_compress_after():
    assert "needs sampling.step_strategy=mix_window" in one_line("sampling.post_window_ode_steps=2", preset="tiny-cpu")
    assert "step_strategy=all" in one_line("sampling.post_window_ode_steps=2", "sampling.step_strategy=all",
                                           preset="tiny-cpu")
    assert "sde_type=ode" in one_line(*FLASH, "sampling.sde_type=ode")
    assert "rollouts are all ODE" in one_line(*FLASH, "algorithm.name=nft", "algorithm.kl_beta=0.0")
    # 8 steps, window from step 0, 2 SDE steps: at most 6 ODE steps follow it
    assert "never compresses: at most 6" in one_line(*FLASH[:3], "sampling.post_window_ode_steps=6")
    assert "mix_window is not available with sampling.engine=sglang" in one_line(*FLASH, "sampling.engine=sglang")
    tiny_config(*FLASH[:3], "sampling.post_window_ode_steps=5", preset="tiny-cpu-mixgrpo")  # 6 -> 5 is allowed


def test_the_sglang_engine_refuses_a_compressed_schedule():
    from diffusionrl.rollout.sglang.engine import SGLangRolloutEngine

    engine = SGLangRolloutEngine.__new__(SGLangRolloutEngine)
    spec = SamplingSpec(resolution=32, num_steps=4, guidance_scale=1.0, post_window_ode_steps=1)
    with pytest.raises(NotImplementedError, match="post_window_ode_steps"):
        engine.generate(["a"], [0], [1], spec)


def test_the_planner_times_the_compressed_rollout_at_the_windows_last_position():
    """plan.model.rollout_steps: the steps to the window's end at its last position in window_range plus the
    compressed ones (what compressed_steps keeps there), and the plan's rollout time scales with them."""
    from diffusionrl.config import Config, apply_overrides, get_preset
    from diffusionrl.plan.model import plan, rollout_steps

    def cfg(*extra):
        return Config.from_dict(apply_overrides(get_preset("tiny-cpu-mixgrpo").to_dict(), [*FLASH[:3], *extra]))

    full, flash = cfg(), cfg("sampling.post_window_ode_steps=2")
    assert rollout_steps(full) == 8
    last = np.zeros(8, dtype=bool)
    last[3:5] = True  # the 2-step window at its last position in [0, 5)
    assert rollout_steps(flash) == len(compressed_steps(last, 8, 2)) - 1 == 7
    assert rollout_steps(cfg("sampling.post_window_ode_steps=3")) == 8  # 3 steps after index 5: nothing saved
    a, b = plan(full, "H200"), plan(flash, "H200")
    assert b.rollout_s / a.rollout_s == pytest.approx(7 / 8)
    assert any("compression" in n for n in b.notes) and not any("compression" in n for n in a.notes)
