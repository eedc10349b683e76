"""Block-diffusion LM stages: warm start, GRPO (resume, metadata), evaluation and configs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffusionrl.bdlm import (
    BDLMConfig,
    TraceGRPO,
    evaluate,
    load_bdlm,
    load_bdlm_config,
    read_traces,
    train_grpo,
    warm_start,
)
from diffusionrl.bdlm.backend import build_grpo_loop
from diffusionrl.config import ConfigError
from diffusionrl.run import CheckpointMismatch, ConfigChanged
from diffusionrl.run.manifest import write_manifest

# Two groups of four, two GRPO steps, a 2-layer 32-wide model: a whole run takes about a second.
TINY = [
    "model.dim=32", "model.layers=2", "model.heads=2", "model.ff_dim=64",
    "task.num_train=64", "task.num_test=16", "warm_start.steps=30", "warm_start.batch_size=16",
    "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=4",
    "grpo.checkpoint_every=1", "grpo.lr=1e-3", "grpo.kl_beta=0.05",
]


def tiny_cfg(*extra: str) -> BDLMConfig:
    return load_bdlm_config("tiny-bdlm", TINY + list(extra))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    return warm_start(tiny_cfg(), tmp_path_factory.mktemp("warm"), progress=False)


def _weights(model_dir):
    return load_bdlm(model_dir).module.state_dict()


def test_warm_start_then_grpo_end_to_end(init_dir, tmp_path):
    cfg = tiny_cfg()
    before = _weights(init_dir)
    result = train_grpo(cfg, tmp_path / "run", init_dir, resume=None, progress=False)
    assert result.steps_done == 2 and len(result.metrics) == 2
    m = result.metrics[0]
    for key in ("rollout/reward/raw_mean", "rollout/zero_std/count", "train/loss", "train/policy_loss", "train/kl_loss",
                "train/approx_kl", "train/clipfrac", "train/log_prob_mean_abs_diff", "train/grad_norm",
                "perf/step_time"):
        assert key in m and math.isfinite(m[key]), key
    # the rollout policy is the start-of-step policy: replayed old log-probs equal the sampler's
    assert m["train/log_prob_mean_abs_diff"] < 1e-6
    assert m["train/first_approx_kl"] == 0.0 and m["train/first_ratio_abs_minus_1"] == 0.0
    after = _weights(result.model_dir)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before), "every parameter must be trained"
    traces = read_traces(tmp_path / "run" / "traces")
    assert len(traces) == 2 and traces[0].batch_size == 8
    info = json.loads((result.model_dir / "bdlm_run.json").read_text())
    assert info["objective"] == "bdlm_grpo_exact_trace" and info["step"] == 2
    ev = evaluate(cfg, result.model_dir)
    assert 0.0 <= ev["eval/exact_match"] <= 1.0 and ev["eval/num_samples"] == 16.0
    assert ev["eval/reward_mean"] >= ev["eval/exact_match"]  # reward = exact + 0.5 * partial >= exact


def test_evaluation_is_deterministic(init_dir):
    cfg = tiny_cfg()
    assert evaluate(cfg, init_dir) == evaluate(cfg, init_dir)


def test_resumed_run_matches_uninterrupted(init_dir, tmp_path):
    cfg = tiny_cfg("grpo.steps=3", "grpo.inner_iterations=2")
    full = train_grpo(cfg, tmp_path / "full", init_dir, resume=None, progress=False)
    train_grpo(cfg, tmp_path / "part", init_dir, resume=None, stop_after=1, progress=False)  # "crash" after one step
    resumed = train_grpo(cfg, tmp_path / "part", init_dir, resume="auto", progress=False)
    assert resumed.steps_done == 3 and len(resumed.metrics) == 3
    a, b = _weights(full.model_dir), _weights(resumed.model_dir)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    drop = ("perf/",)
    for ma, mb in zip(full.metrics, resumed.metrics):
        assert ({k: v for k, v in ma.items() if not k.startswith(drop)}
                == {k: v for k, v in mb.items() if not k.startswith(drop)})


def test_resume_with_another_task_or_objective_fails(init_dir, tmp_path):
    run = tmp_path / "run"
    train_grpo(tiny_cfg(), run, init_dir, resume=None, stop_after=1, progress=False)
    with pytest.raises(CheckpointMismatch, match="task"):
        train_grpo(tiny_cfg("task.kind=reverse"), run, init_dir, resume="auto", progress=False)
    state = run / "checkpoints" / "step-000001" / "state.json"
    record = json.loads(state.read_text())
    record["metadata"]["objective"] = "masked_diffusion_sft"
    state.write_text(json.dumps(record))
    write_manifest(state.parent)  # a whole checkpoint of another objective, not a damaged one
    with pytest.raises(CheckpointMismatch, match="objective"):
        train_grpo(tiny_cfg(), run, init_dir, resume="auto", progress=False)


def test_resume_with_another_learning_rate_fails_unless_allowed(init_dir, tmp_path):
    """The config rule of ``RunLoop`` for GRPO runs too: more steps are fine, a 50x learning rate
    is refused in one line, and when allowed it is recorded and used."""
    run = tmp_path / "run"
    train_grpo(tiny_cfg(), run, init_dir, resume=None, stop_after=1, progress=False)
    with pytest.raises(ConfigChanged, match=r"grpo.lr 0.001 -> 0.05") as err:
        train_grpo(tiny_cfg("grpo.lr=5e-2"), run, init_dir, resume="auto", progress=False)
    assert "\n" not in str(err.value)
    assert train_grpo(tiny_cfg("grpo.steps=3"), run, init_dir, resume="auto", progress=False).steps_done == 3
    loop = build_grpo_loop(tiny_cfg("grpo.steps=4", "grpo.lr=5e-2"), run, init_dir, progress=False)
    assert loop.run(resume="auto", allow_config_change=True).steps_done == 4
    assert loop.backend.optimizer.param_groups[0]["lr"] == 5e-2
    row = json.loads((run / "config_changes.jsonl").read_text())
    assert row["step"] == 3 and row["changes"] == {"grpo.lr": {"old": 1e-3, "new": 5e-2}}


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.sequence_packing=true", "sequence_packing"),
        ("grpo.group_size=1", ">= 2 samples"),
        ("grpo.micro_batch_size=3", "use micro_batch_size=2"),
        ("model.gen_length=4", "gen_length >= 7"),
        ("model.block_size=3", "multiple of model.block_size"),
        ("model.threshold=0", "threshold"),
        ("model.max_length=8", "raise model.max_length"),
        ("task.kind=copy", "not one of"),
        ("grpo.clip_rnage=0.1", "did you mean 'clip_range'"),
        ("model.temperature=0", "temperature"),
    ],
)
def test_bad_configs_fail_closed(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_cfg(override)


def test_kl_without_a_reference_fails(init_dir):
    cfg = tiny_cfg()
    with pytest.raises(ValueError, match="reference"):
        TraceGRPO(cfg.grpo, load_bdlm(init_dir), None)


def test_config_round_trip_and_digest():
    cfg = tiny_cfg()
    again = BDLMConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.digest() == cfg.digest()
    assert tiny_cfg("grpo.lr=2e-3").digest() != cfg.digest()
    assert cfg.canvas_length == cfg.task.prompt_length + cfg.model.gen_length == 15


def test_a_run_that_never_updates_stops_in_one_line(init_dir, tmp_path):
    """A temperature so small that every sample of a group is the same: no reward spread, no optimizer step.
    The image runs' update guard stops it (exit 2 from the CLI) instead of ending and being registered."""
    from diffusionrl.training.guard import TrainingStalled

    cfg = tiny_cfg("model.temperature=1e-30", "grpo.steps=4", "grpo.max_idle_steps=3")
    with pytest.raises(TrainingStalled,
                       match=r"3 steps in a row \(to step 3\) made no optimizer step.*raise grpo\.max_idle_steps"):
        train_grpo(cfg, tmp_path / "run", init_dir, resume=None, progress=False)
    assert not (tmp_path / "run" / "model").exists()
    cfg = tiny_cfg("model.temperature=1e-30", "grpo.steps=2", "grpo.max_idle_steps=3")
    with pytest.raises(TrainingStalled,
                       match=r"reached its last step \(2\) without one optimizer step.*set grpo\.max_idle_steps=0"):
        train_grpo(cfg, tmp_path / "run2", init_dir, resume=None, progress=False)
    with pytest.raises(ConfigError, match="grpo.max_skipped_fraction=0.0 must be in"):
        tiny_cfg("grpo.max_skipped_fraction=0")
