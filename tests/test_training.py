"""Exactness invariants of the trainer and the loop (docs/architecture.md "Testing")."""

import dataclasses
import json

import pytest
import torch

from diffusionrl.run import CheckpointMismatch
from diffusionrl.train import build_loop
from diffusionrl.training.trainer import UpdateStats

from .conftest import run_interrupted_and_uninterrupted, saved_lora, started_loop, tiny_config


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    cfg = tiny_config("algorithm.kl_beta=0.04")
    with started_loop(cfg, tmp_path_factory.mktemp("loop")) as lp:
        yield lp


def _grads(loop, traj, active, micro):
    traj = dataclasses.replace(traj, micro_batch_size=micro)
    trainer, objective = loop.backend.worker.trainer, loop.backend.worker.objective
    trainer.optimizer.zero_grad(set_to_none=True)
    rng = __import__("numpy").random.default_rng(0)
    units = objective.units(traj, traj.micro_batches(), active, rng)
    assert trainer.accumulate(units, UpdateStats())
    grads = {n: p.grad.detach().clone() for n, p in loop.backend.worker.policy.params.items()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def test_recomputed_log_probs_equal_rollout_log_probs_before_the_update(loop, scored):
    traj, active = scored
    rng = __import__("numpy").random.default_rng(0)
    units = loop.backend.worker.objective.units(traj, traj.micro_batches(), torch.ones_like(active), rng,
                                                {"open": True})  # the probe's flag: units report the difference
    with torch.no_grad():
        total = sum(float(unit.compute()[1]["log_prob_mean_abs_diff"]) for unit in units)
    count = sum(unit.count for unit in units)
    assert count == int(traj.sde_mask.sum())
    assert total / count <= 1e-6
    assert loop.backend.worker.objective.recompute_log_prob_diff(traj) == (total / count, count)


def test_gradient_does_not_depend_on_the_micro_batch_split(loop, scored):
    traj, active = scored
    one = _grads(loop, traj, active, micro=8)
    many = _grads(loop, traj, active, micro=2)
    num = max(float((one[n] - many[n]).norm()) for n in one)
    den = max(float(one[n].norm()) for n in one)
    assert den > 0 and num / den <= 1e-5


def test_every_lora_parameter_changes_after_a_step_and_the_loss_is_finite(loop, scored):
    traj, active = scored
    before = loop.backend.worker.policy.lora_state()
    metrics = loop.backend.update(traj, active, step=0)
    after = loop.backend.worker.policy.lora_state()
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"{len(unchanged)} LoRA tensors did not change, e.g. {unchanged[:2]}"
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and metrics["train/clipfrac"] == 0.0
    assert metrics["train/optimizer_steps"] == 1 and metrics["train/skipped_updates"] == 0


def test_a_nan_loss_skips_the_update_and_is_counted(loop, scored):
    traj, active = scored
    bad = dataclasses.replace(traj, advantages=torch.full_like(traj.advantages, float("nan")))
    before = loop.backend.worker.policy.lora_state()
    metrics = loop.backend.update(bad, active, step=1)
    assert metrics["train/skipped_updates"] == 1 and metrics["train/optimizer_steps"] == 0
    assert all(torch.equal(before[n], p) for n, p in loop.backend.worker.policy.lora_state().items())


def test_resume_equals_uninterrupted(tmp_path):
    """With a cosine learning rate (a step's rate is a function of the step: the resumed run must
    step at the rates of the uninterrupted one) and an EMA."""
    cfg = tiny_config("train.steps=3", "train.checkpoint_every=1", "train.ema=true", "train.lr_schedule=cosine",
                      "train.lr_warmup_steps=1", "train.lr_min_ratio=0.25")
    full, resumed, result = run_interrupted_and_uninterrupted(cfg, tmp_path)

    assert result.steps_done == 3
    a, b = saved_lora(tmp_path / "full"), saved_lora(tmp_path / "part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/reward/raw_mean"] for m in ma] == [m["rollout/reward/raw_mean"] for m in mb]
    # one warm-up step at the full rate (1 / lr_warmup_steps), then cosine from 1 to 0.25: halfway, then the floor
    lr = cfg.train.learning_rate
    expected = [lr, lr * (0.25 + 0.75 * 0.5), lr * 0.25]
    assert [m["train/lr"] for m in ma] == pytest.approx(expected, rel=1e-6)
    assert [m["train/lr"] for m in mb] == [m["train/lr"] for m in ma]
    assert (tmp_path / "part" / "lora_ema" / "adapter_model.safetensors").is_file()
    for name in ("lora/README.md", "lora/adapter_config.json", "lora_ema/README.md"):  # the cards: no time, no path
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "part" / name).read_bytes(), name


def test_resume_with_another_objective_fails_closed(tmp_path):
    cfg = tiny_config("train.steps=1")
    build_loop(cfg, tmp_path, progress=False).run(resume=None)
    other = tiny_config("train.steps=2", "reward.weights={jpeg_incompressibility: 1.0}")
    with pytest.raises(CheckpointMismatch, match="reward"):
        build_loop(other, tmp_path, progress=False).run(resume="auto")


def test_ocr_recipe_runs_end_to_end_with_the_ray_actor_pool(tmp_path):
    """tiny-cpu-ocr: OCR prompts, the OCR reward scored by 2 Ray CPU actors, 2 steps."""
    from diffusionrl.rewards.pool import RewardActorPool

    # The tiny model writes no text on a CPU (every OCR reward is 0, no update to make): the preset
    # turns the idle-update guard off (train.max_idle_steps=0); this test is about the plumbing.
    cfg = tiny_config("train.steps=2", "sampling.resolution=64", preset="tiny-cpu-ocr")
    loop = build_loop(cfg, tmp_path, progress=False)
    try:
        assert isinstance(loop.backend.scorer, RewardActorPool) and len(loop.backend.scorer.actors) == 2
        assert all('"' in r["prompt"] for r in loop.backend.prompts.train)
        result = loop.run(resume=None)
    finally:
        loop.close()
    assert result.steps_done == 2
    for m in result.metrics:
        assert {"rollout/reward/ocr_mean", "rollout/reward/ocr_failures", "perf/reward_time"} <= set(m)
        assert 0.0 <= m["rollout/reward/ocr_mean"] <= 1.0


@pytest.mark.parametrize("schedule, expected", [
    # warm-up from learning_rate / lr_warmup_steps (no step at rate 0), then constant
    (("train.lr_warmup_steps=2",), [0.5, 1.0, 1.0, 1.0, 1.0]),
    # cosine over the steps after warm-up, its last step at the floor
    (("train.lr_schedule=cosine", "train.lr_warmup_steps=1", "train.lr_min_ratio=0.2"),
     [1.0, 0.2 + 0.8 * 0.5 * (1 + 2 ** -0.5), 0.6, 0.2 + 0.8 * 0.5 * (1 - 2 ** -0.5), 0.2]),
    ((), [1.0] * 5),
])
def test_the_learning_rate_of_each_step_follows_the_schedule(schedule, expected):
    from types import SimpleNamespace

    from diffusionrl.training.trainer import Trainer

    cfg = tiny_config("train.steps=5", "train.learning_rate=0.1", *schedule)
    param = torch.nn.Parameter(torch.zeros(3))
    policy = SimpleNamespace(parameters=lambda: [param], adapter=SimpleNamespace(device=torch.device("cpu")))
    trainer = Trainer(cfg, policy)
    rates = []
    for step in (4, 0, 1, 2, 3, 4):  # any order: a step's rate depends on the step alone
        trainer.begin_step(step)
        rates.append(trainer.lr())
    assert rates[1:] == pytest.approx([0.1 * f for f in expected], rel=1e-9) and rates[0] == rates[-1]
