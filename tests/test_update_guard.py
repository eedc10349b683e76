"""Runs that train nothing stop in one line (``training.guard``), and configs that can form no
advantage or pair are refused before any model loads (``config.objectives.check_objective_fit``)."""

from __future__ import annotations

import pytest

from diffusionrl.config import ConfigError
from diffusionrl.training.guard import stall_reason

from .conftest import TINY_OVERRIDES, tiny_config


def rows(*counts):
    """Metric rows of steps with (optimizer steps, skipped updates)."""
    return [{"train/optimizer_steps": float(d), "train/skipped_updates": float(s)} for d, s in counts]


def test_idle_steps_in_a_row_stop_the_run_and_one_idle_step_does_not():
    assert stall_reason(rows((1, 0), (0, 1), (1, 0), (0, 0)), 40, 3, 1.0) == ""
    why = stall_reason(rows((1, 0), (0, 1), (0, 0), (0, 2)), 40, 3, 1.0)
    assert why.startswith("3 steps in a row (to step 4) made no optimizer step")
    assert "2 skipped every update for a non-finite" in why and "1 had no update to make" in why
    assert "train.max_idle_steps=3" in why and "\n" not in why
    assert stall_reason(rows((0, 1), (0, 1), (0, 1)), 40, 0, 1.0) == ""  # 0: never


def test_a_run_that_never_updated_stops_at_its_last_step():
    assert stall_reason(rows((0, 0)), 2, 3, 1.0) == ""  # not the last step yet
    why = stall_reason(rows((0, 0), (0, 1)), 2, 3, 1.0)
    assert why.startswith("the run reached its last step (2) without one optimizer step")
    assert stall_reason(rows((1, 0), (0, 1)), 2, 3, 1.0) == ""  # it did update once


def test_a_large_share_of_non_finite_updates_stops_the_run_from_step_5():
    half = rows(*[(1, 1)] * 4)
    assert stall_reason(half, 40, 3, 0.2) == ""  # too early to judge
    why = stall_reason(half + rows((1, 1)), 40, 3, 0.2)
    assert why.startswith("5 of the 10 updates of steps 1-5 were skipped") and "max_skipped_fraction=0.2" in why
    assert stall_reason(half + rows((1, 1)), 40, 3, 1.0) == ""  # 1: never
    assert stall_reason(rows(*[(4, 0)] * 4, (3, 1)), 40, 3, 0.2) == ""  # 1 in 20


def test_a_dpo_run_whose_every_update_overflows_exits_2_in_one_line(tmp_path, capsys):
    """dpo_beta=1e38 makes every loss non-finite: the run used to save its untrained LoRA and exit 0."""
    from diffusionrl.train import main

    sets = [*TINY_OVERRIDES, "algorithm.dpo_beta=1e38", "train.steps=1", "train.group_size=2",
            "train.micro_batch_size=4", "eval.every=0"]
    out = tmp_path / "run"
    args = ["--preset", "tiny-cpu-dpo", "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("training stalled:")]
    assert len(err) == 1 and "without one optimizer step" in err[0] and "1 skipped every update" in err[0]
    assert not (out / "lora").exists() and not (out / "checkpoints").exists()
    assert (out / "metrics.jsonl").read_text().count("\n") == 1  # the step that tripped it is recorded


@pytest.mark.parametrize("preset, overrides, match", [
    ("tiny-cpu-dpo", ["train.group_size=1"], "algorithm.name=dpo pairs samples of the same prompt"),
    ("tiny-cpu", ["train.group_size=1", "train.prompts_per_step=1"], "a step of .* = 1 sample has none"),
    ("tiny-cpu-nft", ["train.group_size=1", "train.prompts_per_step=1"], "algorithm.name=nft learns"),
    ("tiny-cpu", ["train.max_idle_steps=-1"], "train.max_idle_steps=-1 must be >= 0"),
    ("tiny-cpu", ["train.max_skipped_fraction=0"], r"train.max_skipped_fraction=0.0 must be in \(0, 1\]"),
])
def test_configs_that_cannot_train_are_refused_at_validation(preset, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config("train.micro_batch_size=1", *overrides, preset=preset)


def test_one_sample_per_group_is_still_a_batch_z_score_for_flow_grpo():
    cfg = tiny_config("train.group_size=1", "train.prompts_per_step=4", preset="tiny-cpu")
    assert cfg.train.group_size == 1  # docs/algorithms.md section 4: the batch is z-scored instead
