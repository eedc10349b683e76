"""The Flyte workflow end to end, in-process (real local Flyte execution, real local Ray)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from diffusionrl.trajectory_store import BASE_COLUMNS, read_trajectories

from .conftest import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
SMALL = TINY_OVERRIDES + ["train.steps=2", "data.num_prompts=24", "data.test_fraction=0.2", "eval.num_prompts=2"]


@pytest.fixture(scope="module")
def grpo():
    sys.path.insert(0, str(ROOT))
    from workflows.grpo import grpo as wf

    return wf


@pytest.fixture(scope="module")
def run(grpo, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("run")
    out = grpo(overrides=SMALL, checkpoint_dir=str(ckpt))
    return out, ckpt


def test_outputs_exist_and_report_links_artifacts(run):
    out, ckpt = run
    html = Path(out.report.path).read_text()
    assert "Training curves" in html and "base (top) vs tuned (bottom)" in html and str(ckpt) in html
    assert (Path(out.lora.path) / "adapter_model.safetensors").is_file()
    assert (ckpt / "metrics.jsonl").is_file() and (ckpt / "checkpoints").is_dir()


def test_trajectory_parquet_matches_the_metrics_table(run):
    out, _ = run
    files = sorted(Path(out.trajectories.path).glob("step-*.parquet"))
    assert [f.name for f in files] == ["step-000001.parquet", "step-000002.parquet"]
    df = pd.read_parquet(files[0])  # plain pandas
    assert set(BASE_COLUMNS) <= set(df.columns) and len(df) == 8  # one row per sample
    assert pq.read_metadata(files[0]).metadata[b"diffusionrl.schema_version"] == b"1"
    metrics = out.metrics
    for i, f in enumerate(files):
        d = pd.read_parquet(f)
        row = metrics.iloc[i]
        assert abs(d["reward"].mean() - row["rollout/reward/raw_mean"]) < 1e-6
        assert abs(d["reward"].std(ddof=0) - row["rollout/reward/raw_std"]) < 1e-6
        # advantages recomputed from the stored rewards and group ids
        g = d.groupby("group_id")["reward"].transform("mean")
        expected = ((d["reward"] - g) / (d["reward"].std(ddof=0) + 1e-4)).clip(-5, 5)
        assert (expected - d["advantage"]).abs().max() < 1e-4
    trajs = read_trajectories(out.trajectories.path)
    assert len(trajs) == 2 and trajs[0].latents.shape[0] == 8 and trajs[0].images.shape == (8, 32, 32, 3)


def test_eval_compares_base_and_tuned_on_the_same_seeds(run):
    out, _ = run
    table = out.eval_table
    assert {"prompt", "seed", "base_reward", "tuned_reward", "win"} <= set(table.columns)
    assert table["seed"].tolist() == [1234, 1235]
    assert {"eval/win_rate", "eval/reward_mean", "eval/base_reward_mean"} <= set(out.eval_summary)


def test_second_run_hits_the_cache_for_prompts_and_checkpoint(grpo, tmp_path, monkeypatch):
    import flytekit.core.local_cache as local_cache
    from flytekit.core.local_cache import LocalTaskCache

    from tasks.grpo import fetch_checkpoint, fingerprint_prompts, prepare_prompts

    # A private cache folder: the user's ~/.flyte/local-cache (e.g. from `make demo`) must not count.
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "true")
    monkeypatch.setattr(local_cache, "CACHE_LOCATION", str(tmp_path / "cache"))
    monkeypatch.setattr(LocalTaskCache, "_initialized", False, raising=False)
    LocalTaskCache.initialize()
    from diffusionrl.config import get_preset

    cfg = get_preset("tiny-cpu")
    calls = {"n": 0}
    import diffusionrl.data as data_mod
    import diffusionrl.models.fetch as fetch_mod

    real_fetch, real_load = fetch_mod.fetch_model, data_mod.load_prompts

    def count_fetch(*a, **k):
        calls["n"] += 1
        return real_fetch(*a, **k)

    def count_load(*a, **k):
        calls["n"] += 1
        return real_load(*a, **k)

    monkeypatch.setattr(fetch_mod, "fetch_model", count_fetch)
    monkeypatch.setattr("tasks.grpo.load_prompts", count_load)
    for _ in range(2):
        prepare_prompts(data=cfg.data, reward=cfg.reward, fingerprint=fingerprint_prompts(data=cfg.data))
        fetch_checkpoint(reference=cfg.model.name, revision=cfg.model.revision)
    assert calls["n"] == 2  # the second round came from the cache
    LocalTaskCache.clear()
    monkeypatch.setattr(LocalTaskCache, "_initialized", False, raising=False)


def test_malformed_prompt_file_fails_with_file_and_line(grpo, tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "a cat"}\n{"prompt": "a dog"\n')
    with pytest.raises(Exception, match=r"prompts.jsonl:2: invalid JSON"):
        grpo(overrides=SMALL + [f"data.source={bad}"])


def test_killed_train_resumes_at_step_k_and_matches_uninterrupted(grpo, run, tmp_path, monkeypatch):
    uninterrupted, _ = run
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("DIFFUSIONRL_FAULT_AFTER_STEPS", "1")
    with pytest.raises(Exception, match="injected fault after 1 steps"):
        grpo(overrides=SMALL, checkpoint_dir=str(ckpt))
    assert (ckpt / "checkpoints" / "step-000001" / "state.json").is_file()
    # the failure handler closed the execution's MLflow runs (workflow + stage runs) as FAILED
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("diffusionrl").experiment_id
    failed = [r for r in client.search_runs([exp], "attributes.status = 'FAILED'")
              if "injected fault" in r.data.tags.get("failure", "")]
    assert {r.data.tags["diffusionrl.stage"] for r in failed} >= {"workflow", "train"}
    assert not client.search_runs([exp], "attributes.status = 'RUNNING'")
    monkeypatch.delenv("DIFFUSIONRL_FAULT_AFTER_STEPS")
    resumed = grpo(overrides=SMALL, checkpoint_dir=str(ckpt))
    steps = [json.loads(x)["step"] for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1.0, 2.0]
    a = load_file(str(Path(uninterrupted.lora.path) / "adapter_model.safetensors"))
    b = load_file(str(Path(resumed.lora.path) / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pyflyte_run_with_a_config_file_and_an_override(tmp_path):
    from diffusionrl.config import load_config

    cfg = load_config("tiny-cpu", overrides=SMALL + ["train.steps=1"])
    path = tmp_path / "cfg.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg.to_dict()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLYTE_LOCAL_CACHE_ENABLED": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "flytekit.clis.sdk_in_container.pyflyte", "run", "workflows/grpo.py", "grpo",
         "--config", str(path), "--overrides", json.dumps(["eval.num_prompts=1"])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/win_rate" in proc.stdout


def test_scheduled_launch_plan_is_importable_with_its_schedule_and_inputs(grpo):
    from workflows.grpo import grpo_nightly

    assert grpo_nightly.schedule.cron_schedule.schedule == "0 3 * * *"
    assert grpo_nightly.schedule.kickoff_time_input_arg == "run_date"
    assert "overrides" in grpo_nightly.parameters.parameters
    assert grpo_nightly.name == "grpo_nightly"
