"""Checkpoints you can trust (docs/architecture.md "The training run"): damaged checkpoints are found
by their manifest and skipped for the previous intact one, a fresh run never mixes with an older run,
a resume cannot silently change what is optimised, a torn metrics line does not block a resume, and
a run without a progress bar prints one line per step. A toy backend (a linear layer and AdamW)
drives the ``RunLoop`` so that these run in a second; tests/test_resume_real.py repeats the
user-facing cases with the tiny SD3 model and the CLI."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from diffusionrl.run.checkpoint import (
    CheckpointDamaged,
    CheckpointMismatch,
    CheckpointState,
    ConfigChanged,
    latest_checkpoint,
    load_checkpoint,
)
from diffusionrl.run.loop import RUN_CONTROL_KEYS, MetricsFileError, RunLoop, Schedule, read_metrics

FREE = RUN_CONTROL_KEYS + ("train.steps",)


class ToyBackend:
    progress_label = "toy"
    restore_rng = False

    def __init__(self, config, out_dir):
        torch.manual_seed(0)
        self.out_dir = out_dir
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=config["train"]["learning_rate"])

    def metadata(self):
        return {"objective": "toy"}

    def start(self):
        pass

    def run_step(self, step):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return None, {"step": float(step + 1), "rollout/reward/raw_mean": -loss.item()}

    def state(self, step):
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return CheckpointState(step=step, policy_version=step, metadata=self.metadata(), lora=weights,
                               optimizer=self.opt.state_dict())

    def load_state(self, state):
        self.model.load_state_dict(state.lora)
        self.opt.load_state_dict(state.optimizer)

    def save_outputs(self, step):
        out = self.out_dir / "model"
        out.mkdir(exist_ok=True)
        save_file(self.model.state_dict(), str(out / "weights.safetensors"))
        return out, {}

    def close(self):
        pass


def toy(out_dir, steps=3, keep=0, progress=False, inputs=None, **train):
    config = {"train": {"steps": steps, "learning_rate": 1e-2, "seed": 0, **train}, "data": {"source": "a.jsonl"},
              "eval": {"num_prompts": 2}, "preset": "toy"}
    return RunLoop(ToyBackend(config, out_dir), out_dir, Schedule(steps, 1, keep), config, progress=progress,
                   free_keys=FREE, **({"inputs": inputs} if inputs is not None else {}))


def weights(loop):
    return {k: v.clone() for k, v in loop.backend.model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def zero_bytes(path, at=0.5, n=16):
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i:i + n] = bytes(n)
    path.write_bytes(bytes(data))


def warnings_about(caplog, text):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


@pytest.fixture
def full(tmp_path):
    loop = toy(tmp_path / "full")
    loop.run(resume=None)
    return weights(loop)


# -- case 8: damaged checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["zeroed", "truncated", "missing"])
def test_a_damaged_latest_checkpoint_is_reported_and_the_previous_one_resumed(tmp_path, full, caplog, damage):
    run = tmp_path / "part"
    toy(run).run(resume=None)  # checkpoints 1, 2, 3
    lora = run / "checkpoints" / "step-000003" / "lora.safetensors"
    if damage == "zeroed":
        zero_bytes(lora)
    elif damage == "truncated":
        lora.write_bytes(lora.read_bytes()[:-7])
    else:
        lora.unlink()
    caplog.set_level(logging.WARNING)
    with pytest.raises(CheckpointDamaged, match=r"step-000003 is damaged: lora.safetensors"):
        load_checkpoint(run / "checkpoints" / "step-000003")
    assert latest_checkpoint(run / "checkpoints").name == "step-000002"
    caplog.clear()
    resumed = toy(run)
    result = resumed.run(resume="auto")
    [line] = warnings_about(caplog, "damaged")
    assert "step-000003" in line and "lora.safetensors" in line and "\n" not in line
    assert result.steps_done == 3 and same(weights(resumed), full)  # step 3 re-run from step 2's state
    load_checkpoint(run / "checkpoints" / "step-000003")  # and rewritten whole


def test_an_explicitly_requested_damaged_checkpoint_fails_in_one_line_naming_the_file(tmp_path):
    toy(tmp_path).run(resume=None)
    zero_bytes(tmp_path / "checkpoints" / "step-000002" / "optimizer.safetensors")
    with pytest.raises(CheckpointDamaged) as err:
        toy(tmp_path).run(resume=tmp_path / "checkpoints" / "step-000002")
    message = str(err.value)
    assert "\n" not in message
    assert "step-000002 is damaged: optimizer.safetensors does not match its SHA-256" in message


def test_every_checkpoint_damaged_fails_closed_instead_of_starting_over(tmp_path):
    toy(tmp_path, keep=1).run(resume=None)
    (tmp_path / "checkpoints" / "step-000003" / "state.json").write_text("{")
    with pytest.raises(CheckpointDamaged, match=r"no intact checkpoint in .*step-000003: state.json") as err:
        toy(tmp_path).run(resume="auto")
    assert "\n" not in str(err.value)


def as_format_1(ckpt):
    """A checkpoint in a format this version does not write: state.json format 1, no config or inputs,
    no manifest.json."""
    (ckpt / "manifest.json").unlink()
    record = json.loads((ckpt / "state.json").read_text())
    record["format_version"] = 1
    del record["config"], record["inputs"]
    (ckpt / "state.json").write_text(json.dumps(record))


def test_a_checkpoint_without_its_manifest_is_damaged_naming_the_folder_and_the_fix(tmp_path):
    toy(tmp_path, steps=1).run(resume=None)
    ckpt = tmp_path / "checkpoints" / "step-000001"
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointDamaged) as err:
        load_checkpoint(ckpt)
    message = str(err.value)
    assert "\n" not in message and f"checkpoint {ckpt} is damaged: manifest.json is missing" in message
    assert "copy the whole folder again or resume from another checkpoint" in message


def test_a_newest_checkpoint_without_manifest_is_skipped_for_the_previous_one(tmp_path, full, caplog):
    run = tmp_path / "part"
    toy(run).run(resume=None)  # checkpoints 1, 2, 3
    as_format_1(run / "checkpoints" / "step-000003")
    caplog.set_level(logging.WARNING)
    assert latest_checkpoint(run / "checkpoints").name == "step-000002"
    caplog.clear()
    resumed = toy(run)
    assert resumed.run(resume="auto").steps_done == 3 and same(weights(resumed), full)
    [line] = warnings_about(caplog, "skipping damaged checkpoint step-000003")
    assert "manifest.json is missing" in line
    load_checkpoint(run / "checkpoints" / "step-000003")  # rewritten whole by the resumed run


def test_only_checkpoints_without_manifest_fail_in_one_line_saying_what_to_do(tmp_path):
    toy(tmp_path).run(resume=None)
    for step in (1, 2, 3):
        as_format_1(tmp_path / "checkpoints" / f"step-{step:06d}")
    with pytest.raises(CheckpointDamaged, match=r"no intact checkpoint in .*step-000003: manifest.json is missing.*"
                                                 r"start over with --fresh") as err:
        toy(tmp_path).run(resume="auto")
    assert "\n" not in str(err.value) and "step-000001: manifest.json is missing" in str(err.value)


@pytest.mark.parametrize("edit", [{"format_version": 1}, {"config": None}, {"inputs": None}])
def test_a_verified_state_json_of_another_format_is_refused_in_one_line(tmp_path, edit):
    """Intact files (the manifest rewritten to match) in a format this version does not write: no
    fallback to an older checkpoint (written by the same code), one line naming state.json."""
    from diffusionrl.run.manifest import write_manifest

    toy(tmp_path, steps=1).run(resume=None)
    ckpt = tmp_path / "checkpoints" / "step-000001"
    record = json.loads((ckpt / "state.json").read_text())
    for key, value in edit.items():
        if value is None:
            del record[key]
        else:
            record[key] = value
    (ckpt / "state.json").write_text(json.dumps(record))
    write_manifest(ckpt)
    with pytest.raises(CheckpointMismatch) as err:
        toy(tmp_path, steps=2).run(resume="auto")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{ckpt / 'state.json'}: checkpoint format ")
    assert "this version reads; resume from a checkpoint it wrote or start over (--fresh)" in message
    assert ("format 1," in message) if "format_version" in edit else (f"without {next(iter(edit))}," in message)


@pytest.mark.parametrize("copied", [[], ["lora.safetensors", "optimizer.safetensors"]])
def test_an_empty_or_half_copied_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, full, caplog, copied):
    """A ``step-N/`` without its manifest.json (an interrupted copy, a mkdir) is damaged like any
    other: skipped with one warning, not a FileNotFoundError for every resume."""
    run = tmp_path / "part"
    toy(run).run(resume=None, stop_after=2)
    ckpts = run / "checkpoints"
    (ckpts / "step-000003").mkdir()
    for name in copied:
        (ckpts / "step-000003" / name).write_bytes((ckpts / "step-000002" / name).read_bytes())
    caplog.set_level(logging.WARNING)
    assert latest_checkpoint(ckpts).name == "step-000002"
    resumed = toy(run)
    assert resumed.run(resume="auto").steps_done == 3 and same(weights(resumed), full)
    skipped = warnings_about(caplog, "skipping damaged checkpoint step-000003")
    assert skipped and all("manifest.json is missing" in w for w in skipped)
    load_checkpoint(ckpts / "step-000003")  # rewritten whole by the resumed run


def test_only_empty_checkpoints_fail_in_one_line_instead_of_a_traceback(tmp_path):
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    with pytest.raises(CheckpointDamaged, match=r"no intact checkpoint in .*step-000001: manifest.json is mis") as err:
        toy(tmp_path).run(resume="auto")
    assert "\n" not in str(err.value)


# -- case 9: a fresh run in a folder holding another run -------------------------------------------


def test_a_fresh_run_moves_the_previous_run_aside_and_a_later_resume_continues_the_fresh_one(tmp_path, caplog):
    toy(tmp_path, steps=5, keep=2).run(resume=None)  # the longer, older run: checkpoints 4, 5
    caplog.set_level(logging.WARNING)
    toy(tmp_path, steps=2, keep=2).run(resume=None)  # fresh: checkpoints 1, 2 must survive pruning
    [aside] = list(tmp_path.glob("previous-run-*"))
    assert [p.name for p in sorted((aside / "checkpoints").iterdir())] == ["step-000004", "step-000005"]
    assert len((aside / "metrics.jsonl").read_text().splitlines()) == 5 and (aside / "config.json").is_file()
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step-000001", "step-000002"]
    assert len(warnings_about(caplog, "moved to")) == 1
    again = toy(tmp_path, steps=3, keep=2)
    again.run(resume="auto")
    assert [r["step"] for r in again.history] == [1.0, 2.0, 3.0]  # the fresh run's, not the old one's
    toy(tmp_path, steps=1).run(resume=None)
    assert len(list(tmp_path.glob("previous-run-*"))) == 2  # nothing is ever deleted


# -- case 10: a resume with other objective-relevant settings --------------------------------------


def test_a_changed_objective_setting_fails_in_one_line_listing_the_keys(tmp_path):
    toy(tmp_path, steps=1).run(resume=None)
    loop = toy(tmp_path, steps=2, learning_rate=0.5, seed=7)
    loop.config["data"]["source"] = "b.jsonl"
    loop.config["eval"]["num_prompts"] = 9  # free: evaluation settings
    with pytest.raises(ConfigChanged) as err:
        loop.run(resume="auto")
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, CheckpointMismatch)
    assert 'data.source "a.jsonl" -> "b.jsonl", train.learning_rate 0.01 -> 0.5, train.seed 0 -> 7' in message
    assert "eval.num_prompts" not in message
    assert "--allow-config-change" in message
    assert not (tmp_path / "config_changes.jsonl").exists()
    assert json.loads((tmp_path / "config.json").read_text())["train"]["learning_rate"] == 0.01  # not overwritten


def test_more_steps_resume_without_a_word(tmp_path):
    toy(tmp_path, steps=1).run(resume=None)
    assert toy(tmp_path, steps=2).run(resume="auto").steps_done == 2
    assert not (tmp_path / "config_changes.jsonl").exists()


def test_an_allowed_change_is_recorded_and_takes_effect(tmp_path, caplog):
    toy(tmp_path, steps=2).run(resume=None)
    caplog.set_level(logging.WARNING)
    loop = toy(tmp_path, steps=3, learning_rate=0.5)  # 50x
    loop.run(resume="auto", allow_config_change=True)
    assert loop.backend.opt.param_groups[0]["lr"] == 0.5  # not the checkpoint's 0.01
    [row] = [json.loads(x) for x in (tmp_path / "config_changes.jsonl").read_text().splitlines()]
    assert row["step"] == 2 and row["checkpoint"] == "step-000002"
    assert row["changes"] == {"train.learning_rate": {"old": 0.01, "new": 0.5}}
    assert len(warnings_about(caplog, "changed settings")) == 1
    assert load_checkpoint(tmp_path / "checkpoints" / "step-000003").config["train"]["learning_rate"] == 0.5
    assert toy(tmp_path, steps=4, learning_rate=0.5).run(resume="auto").steps_done == 4  # the new baseline


# -- the data behind an unchanged path ------------------------------------------------------------


def test_changed_input_data_behind_an_unchanged_path_fails_naming_the_input(tmp_path):
    """Same config (same data.source), other prompts in the file: refused like a config change."""
    toy(tmp_path, steps=1, inputs={"prompts": "aaaa", "init_lora": "cccc"}).run(resume=None)
    assert load_checkpoint(tmp_path / "checkpoints" / "step-000001").inputs == {"prompts": "aaaa", "init_lora": "cccc"}
    with pytest.raises(ConfigChanged) as err:
        toy(tmp_path, steps=2, inputs={"prompts": "bbbb", "init_lora": "cccc"}).run(resume="auto")
    message = str(err.value)
    assert "\n" not in message and 'inputs.prompts "aaaa" -> "bbbb"' in message and "init_lora" not in message
    assert "rewritten" in message and "--allow-config-change" in message
    assert not (tmp_path / "config_changes.jsonl").exists()
    assert toy(tmp_path, steps=2, inputs={"prompts": "aaaa", "init_lora": "cccc"}).run(resume="auto").steps_done == 2


def test_an_allowed_data_change_is_recorded_and_becomes_the_new_baseline(tmp_path, caplog):
    toy(tmp_path, steps=1, inputs={"prompts": "aaaa"}).run(resume=None)
    caplog.set_level(logging.WARNING)
    toy(tmp_path, steps=2, inputs={"prompts": "bbbb"}).run(resume="auto", allow_config_change=True)
    [row] = [json.loads(x) for x in (tmp_path / "config_changes.jsonl").read_text().splitlines()]
    assert row["checkpoint"] == "step-000001" and row["changes"] == {"inputs.prompts": {"old": "aaaa", "new": "bbbb"}}
    assert len(warnings_about(caplog, "changed settings")) == 1
    assert load_checkpoint(tmp_path / "checkpoints" / "step-000002").inputs == {"prompts": "bbbb"}
    assert toy(tmp_path, steps=3, inputs={"prompts": "bbbb"}).run(resume="auto").steps_done == 3


def test_an_input_only_the_resumed_run_records_is_not_compared(tmp_path):
    toy(tmp_path, steps=1).run(resume=None)  # records no inputs
    assert toy(tmp_path, steps=2, inputs={"prompts": "bbbb"}).run(resume="auto").steps_done == 2


# -- metrics.jsonl ---------------------------------------------------------------------------------


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
    toy(tmp_path).run(resume=None, stop_after=2)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 3.0, "rollout/rew')  # killed mid-write
    caplog.set_level(logging.WARNING)
    loop = toy(tmp_path)
    loop.run(resume="auto")
    [line] = warnings_about(caplog, "torn last line 3")
    assert "metrics.jsonl" in line
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1.0, 2.0, 3.0]


def test_a_malformed_metrics_line_fails_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1.0}\nnot json\n{"step": 2.0}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl line 2: not a metrics row") as err:
        read_metrics(path, upto=2)
    assert "\n" not in str(err.value)


# -- progress ------------------------------------------------------------------------------------------


def test_without_a_bar_each_step_prints_one_progress_line(tmp_path, capsys):
    toy(tmp_path / "a", progress=None).run(resume=None)  # stderr is no terminal under pytest
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in lines] == ["toy step 1/3", "toy step 2/3", "toy step 3/3"]
    assert all(" reward -" in line and line.endswith(" s") for line in lines)
    toy(tmp_path / "b", progress=False).run(resume=None)
    assert capsys.readouterr().err == ""


def test_progress_lines_go_to_the_log_when_it_logs_info(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="diffusionrl.run.loop")
    toy(tmp_path, steps=2, progress=None).run(resume=None)
    assert [r.getMessage().split(":")[0] for r in caplog.records if "toy step" in r.getMessage()] == [
        "toy step 1/2", "toy step 2/2"]
    assert "toy step" not in capsys.readouterr().err
