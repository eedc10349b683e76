"""The user-facing resume cases with the tiny SD3 model (tests/test_checkpoint_trust.py has them
all with a toy backend): a damaged latest checkpoint of a real run, ``python -m diffusionrl.train
--fresh`` in a folder holding a longer run, a changed learning rate refused in one line and, when
allowed, in effect."""

from __future__ import annotations

import json

import pytest
import torch

from diffusionrl.train import build_loop, main

from .conftest import TINY_OVERRIDES, saved_lora, tiny_config


def test_a_zeroed_lora_in_the_latest_checkpoint_resumes_from_the_previous_one(tmp_path):
    cfg = tiny_config("train.steps=3")
    build_loop(cfg, tmp_path / "full", progress=False).run(resume=None)
    part = build_loop(cfg, tmp_path / "part", progress=False)
    part.run(resume=None, stop_after=2)
    part.close()
    lora = tmp_path / "part" / "checkpoints" / "step-000002" / "lora.safetensors"
    data = bytearray(lora.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    lora.write_bytes(bytes(data))
    resumed = build_loop(cfg, tmp_path / "part", progress=False)
    result = resumed.run(resume="auto")
    resumed.close()
    assert result.steps_done == 3
    a, b = saved_lora(tmp_path / "full"), saved_lora(tmp_path / "part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_fresh_keeps_the_longer_run_and_a_later_resume_continues_the_fresh_one(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--preset", "tiny-cpu", "--out", str(out)] + [a for o in TINY_OVERRIDES for a in ("--set", o)]
    assert main(args + ["--steps", "2"]) == 0
    assert main(args + ["--steps", "1", "--fresh"]) == 0
    [aside] = out.glob("previous-run-*")
    assert (aside / "checkpoints" / "step-000002").is_dir() and len((aside / "metrics.jsonl").read_text().split()) > 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    capsys.readouterr()
    assert main(args + ["--steps", "2", "--set", "train.learning_rate=0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot resume from") and "train.learning_rate 0.01 -> 0.5" in err[-1]
    assert main(args + ["--steps", "2"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0]  # the fresh run continued, the old one stayed aside
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "moved to <out>/previous-run-<time>/ (never deleted)" in help_text
    assert "--allow-config-change" in help_text and "config_changes.jsonl" in help_text


def test_an_allowed_learning_rate_change_reaches_the_optimizer(tmp_path):
    build_loop(tiny_config("train.steps=1"), tmp_path, progress=False).run(resume=None)
    loop = build_loop(tiny_config("train.steps=1", "train.learning_rate=0.5"), tmp_path, progress=False)
    loop.run(resume="auto", allow_config_change=True)
    assert loop.backend.worker.trainer.lr() == 0.5
    row = json.loads((tmp_path / "config_changes.jsonl").read_text())
    assert row["changes"] == {"train.learning_rate": {"old": 0.01, "new": 0.5}} and row["step"] == 1


def test_a_prompt_file_rewritten_at_the_same_path_is_refused_on_resume_and_recorded_when_allowed(tmp_path, capsys):
    """The config is unchanged (same data.source) but the file holds other prompts: the resume
    compares the prompts' digest recorded in the checkpoint, not the path."""
    prompts, out = tmp_path / "prompts.txt", tmp_path / "run"
    prompts.write_text("".join(f"a red cube number {i}\n" for i in range(12)))
    overrides = TINY_OVERRIDES + [f"data.source={prompts}", "train.group_size=2", "train.micro_batch_size=2",
                                  "sampling.num_steps=3", "sampling.window_range=[0, 2]", "eval.num_steps=3",
                                  "eval.every=0"]
    args = ["--preset", "tiny-cpu", "--out", str(out)] + [a for o in overrides for a in ("--set", o)]
    assert main(args + ["--steps", "1"]) == 0
    digest = json.loads((out / "checkpoints" / "step-000001" / "state.json").read_text())["inputs"]["prompts"]
    prompts.write_text("".join(f"a blue sphere number {i}\n" for i in range(12)))
    capsys.readouterr()
    assert main(args + ["--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: cannot resume from") and f'inputs.prompts "{digest}" -> "' in err
    assert not (out / "checkpoints" / "step-000002").exists()
    assert main(args + ["--steps", "2", "--allow-config-change"]) == 0
    [row] = [json.loads(x) for x in (out / "config_changes.jsonl").read_text().splitlines()]
    assert list(row["changes"]) == ["inputs.prompts"] and row["changes"]["inputs.prompts"]["old"] == digest
