"""What every objective shares: the registry, presets and docs table agree; the KL spaces; training at
one resolution and evaluating at another."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusionrl.config import ALGORITHMS, PRESETS, load_config
from diffusionrl.train import build_loop, train
from diffusionrl.training.objective import objective_class

from .conftest import tiny_config

DOCS = Path(__file__).resolve().parents[1] / "docs" / "algorithms.md"


def preset_of(name: str) -> str:
    return {"flow_grpo": "tiny-cpu"}.get(name, f"tiny-cpu-{name.replace('_', '-')}")


def test_every_algorithm_has_an_objective_a_preset_and_a_row_in_the_docs_table():
    table = DOCS.read_text().split("### 14.1", 1)[1].split("###", 1)[0]
    for name in ALGORITHMS:
        assert objective_class(name).name == name
        assert preset_of(name) in PRESETS and load_config(preset_of(name)).algorithm.name == name
        assert re.search(rf"^\| `{name}` ", table, re.M), f"docs/algorithms.md 14.1 has no row for {name}"


def test_each_algorithm_key_is_declared_once_and_the_section_is_the_registered_options():
    """``AlgorithmConfig`` is the shared keys plus every registered objective's options: a key declared
    twice would be merged silently by the dataclass composition."""
    from dataclasses import fields

    from diffusionrl.config import AlgorithmConfig
    from diffusionrl.config.objectives import OBJECTIVES, option_classes
    from diffusionrl.config.sections import AlgorithmKeys

    declared = [f.name for cls in (AlgorithmKeys, *option_classes()) for f in fields(cls)]
    assert len(declared) == len(set(declared)), sorted(k for k in declared if declared.count(k) > 1)
    assert [f.name for f in fields(AlgorithmConfig)] == declared
    assert [o.name for o in OBJECTIVES] == list(ALGORITHMS)
    assert all(o.rollouts in ("sde", "ode", "data") for o in OBJECTIVES)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    torch.set_num_threads(1)
    lp = build_loop(tiny_config("algorithm.kl_beta=0.04"), tmp_path_factory.mktemp("kl"), progress=False)
    lp.backend.push_weights(0)
    traj, active, _ = lp.backend.score(lp.backend.rollout(0))
    yield lp, traj, active
    lp.close()


def test_x_and_v_kl_agree_through_the_step_mean(loop):
    """On an sde step, mean - mean_ref = c dt (v - v_ref) with c = 1 + std^2 (1 - sigma) / (2 sigma), so
    section 5's x-space term is (c dt)^2 / (2 std^2) times the v-space one, pair by pair."""
    lp, traj, _ = loop
    objective, policy = lp.backend.worker.objective, lp.backend.worker.policy
    live = policy.lora_state()
    with torch.no_grad():
        for p in policy.params.values():  # move the policy off the reference (LoRA B starts at 0)
            p.add_(0.05 * torch.randn_like(p))
    try:
        sl, j = traj.micro_batches()[0], int(torch.nonzero(traj.sde_mask[0])[0])
        with torch.no_grad():
            ev = objective.evaluate(traj, sl, j)
            objective.kl_space = "x"
            kl_x = objective.reference_kl(ev)
            objective.kl_space = "v"
            kl_v = objective.reference_kl(ev)
    finally:
        objective.kl_space = "x"
        policy.load_lora_state(live)
    sigma, dt = float(traj.sigmas[j]), float(traj.sigmas[j + 1] - traj.sigmas[j])
    std = ev.out.std
    c = 1 + std**2 * (1 - sigma) / (2 * sigma)
    assert (kl_v > 0).all()
    torch.testing.assert_close(kl_x, (c * dt) ** 2 / (2 * std**2) * kl_v, rtol=1e-3, atol=0)
    exact = ((ev.out.mean - ev.mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * ev.out.step_std**2)
    torch.testing.assert_close(kl_x, exact * abs(dt), rtol=1e-5, atol=0)  # section 5: the exact KL times |dt|


def test_a_unit_adds_kl_beta_times_the_kl_in_the_configured_space(loop):
    lp, traj, active = loop
    objective = lp.backend.worker.objective
    units = objective.units(traj, traj.micro_batches()[:1], torch.ones_like(active), np.random.default_rng(0))
    with torch.no_grad():
        loss, stats = units[0].compute()
    assert float(loss) == pytest.approx(float(stats["policy_loss"] + 0.04 * stats["kl_loss"]), rel=1e-6, abs=1e-9)


def test_training_and_evaluation_resolutions_are_separate(tmp_path):
    from diffusionrl.evaluation import eval_spec, evaluate_lora
    from diffusionrl.serving import eval_key

    cfg = tiny_config("train.steps=1", "sampling.eval_resolution=64", "eval.num_prompts=1")
    assert (cfg.sampling.resolution, eval_spec(cfg).resolution) == (32, 64)
    assert eval_spec(tiny_config()).resolution == 32  # 0: evaluate at the training resolution
    assert eval_key(cfg, "t", "b") != eval_key(tiny_config("eval.num_prompts=1"), "t", "b")
    result = train(cfg, tmp_path, resume=None)
    assert result.metrics[0]["rollout/reward/num_samples"] == 8
    rows = [{"prompt": "a red cube"}]
    ev = evaluate_lora(cfg, rows, result.model_dir)
    assert ev.base_images.shape == (1, 64, 64, 3) and ev.tuned_images.shape == (1, 64, 64, 3)
    assert math.isfinite(ev.summary["eval/reward_mean"])
    with pytest.raises(Exception, match="eval_resolution"):
        tiny_config("sampling.eval_resolution=40")
