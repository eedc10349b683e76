"""The Flyte workflow end to end, in-process (real local Flyte execution, real local Ray)."""

import json
import math
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

from diffusionrl.config import get_preset
from diffusionrl.trajectory.store import BASE_COLUMNS, SCHEMA_VERSION, read_trajectories

from .conftest import TINY_OVERRIDES

# The workflow's default is tiny-cpu-shapes (the demo); these tests run the faster JPEG task.
TINY_CPU = get_preset("tiny-cpu")

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
    out = grpo(config=TINY_CPU, overrides=SMALL, checkpoint_dir=str(ckpt))
    return out, ckpt


def test_outputs_exist_and_report_links_artifacts(run):
    out, ckpt = run
    html = Path(out.report.path).read_text()
    assert 'alt="training curve"' in html and "Held-out prompts: base | tuned" in html and str(ckpt) in html
    assert (Path(out.lora.path) / "adapter_model.safetensors").is_file()
    assert (ckpt / "metrics.jsonl").is_file() and (ckpt / "checkpoints").is_dir()


def test_trajectory_parquet_matches_the_metrics_table(run):
    out, _ = run
    files = sorted(Path(out.trajectories.path).glob("step-*.parquet"))
    assert [f.name for f in files] == ["step-000001.parquet", "step-000002.parquet"]
    df = pd.read_parquet(files[0])  # plain pandas
    assert set(BASE_COLUMNS) <= set(df.columns) and len(df) == 8  # one row per sample
    assert pq.read_metadata(files[0]).metadata[b"diffusionrl.schema_version"] == str(SCHEMA_VERSION).encode()
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


def test_second_run_hits_the_cache_for_prompts_and_base_weights(grpo, tmp_path, monkeypatch):
    import flytekit.core.local_cache as local_cache
    from flytekit.core.local_cache import LocalTaskCache

    from tasks.grpo import fetch_base_weights, fingerprint_prompts, prepare_prompts

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
        fetch_base_weights(reference=cfg.model.name, revision=cfg.model.revision)
    assert calls["n"] == 2  # the second round came from the cache
    LocalTaskCache.clear()
    monkeypatch.setattr(LocalTaskCache, "_initialized", False, raising=False)


def test_malformed_prompt_file_fails_with_file_and_line(grpo, tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "a cat"}\n{"prompt": "a dog"\n')
    with pytest.raises(Exception, match=r"prompts.jsonl:2: invalid JSON"):
        grpo(config=TINY_CPU, overrides=SMALL + [f"data.source={bad}"])


def test_killed_train_resumes_at_step_k_and_matches_uninterrupted(grpo, run, tmp_path, monkeypatch):
    uninterrupted, _ = run
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("DIFFUSIONRL_FAULT_AFTER_STEPS", "1")
    with pytest.raises(Exception, match="injected fault after 1 steps"):
        grpo(config=TINY_CPU, overrides=SMALL, checkpoint_dir=str(ckpt))
    assert (ckpt / "checkpoints" / "step-000001" / "state.json").is_file()
    # the failure handler closed the execution's MLflow runs (workflow + stage runs) as FAILED
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("diffusionrl").experiment_id
    failed = [r for r in client.search_runs([exp], "attributes.status = 'FAILED'")
              if "injected fault" in r.data.tags.get("failure", "")]
    assert {r.data.tags["diffusionrl.stage"] for r in failed} >= {"workflow", "train"}
    assert not client.search_runs([exp], "attributes.status = 'RUNNING'")
    monkeypatch.delenv("DIFFUSIONRL_FAULT_AFTER_STEPS")
    resumed = grpo(config=TINY_CPU, overrides=SMALL, checkpoint_dir=str(ckpt))
    steps = [json.loads(x)["step"] for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1.0, 2.0]
    a = load_file(str(Path(uninterrupted.lora.path) / "adapter_model.safetensors"))
    b = load_file(str(Path(resumed.lora.path) / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_warm_start_runs_sft_then_rl_from_its_lora(grpo, tmp_path):
    ckpt = tmp_path / "ckpt"
    out = grpo(config=TINY_CPU, overrides=SMALL + ["train.steps=1", "algorithm.sft_source=builtin:shapes:16"],
               checkpoint_dir=str(ckpt), sft_steps=2, sft_overrides=["train.learning_rate=0.003"])
    sft_rows = [json.loads(x) for x in (ckpt / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft_rows] == [1.0, 2.0] and all(r["train/loss"] > 0 for r in sft_rows)
    sft_cfg = json.loads((ckpt / "sft" / "config.json").read_text())
    assert sft_cfg["algorithm"]["name"] == "sft" and sft_cfg["train"]["learning_rate"] == 0.003
    rl_cfg = json.loads((ckpt / "config.json").read_text())  # the RL run started from the SFT stage's LoRA
    assert rl_cfg["algorithm"]["name"] == "flow_grpo" and rl_cfg["algorithm"]["init_lora"] == str(ckpt / "sft" / "lora")
    assert rl_cfg["train"]["learning_rate"] != 0.003  # the SFT-only override stayed in the SFT stage
    assert (ckpt / "sft" / "lora" / "adapter_model.safetensors").is_file() and Path(out.lora.path).is_dir()
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("diffusionrl").experiment_id
    tagged = client.search_runs([exp], f"tags.warm_start_lora = '{ckpt / 'sft' / 'lora'}'")
    assert {"sft", "workflow"} <= {r.data.tags["diffusionrl.stage"] for r in tagged}  # later stages inherit the tag
    stage = next(r for r in tagged if r.data.tags["diffusionrl.stage"] == "sft")
    assert len(client.get_metric_history(stage.info.run_id, "train/loss")) == 2


@pytest.mark.parametrize("preset", ["tiny-cpu-dance", "tiny-cpu-grpo-guard", "tiny-cpu-dppo", "tiny-cpu-awm",
                                    "tiny-cpu-dpo", "tiny-cpu-sft"])
def test_every_objective_preset_runs_through_the_workflow(grpo, preset, tmp_path):
    from diffusionrl.config import get_preset

    cfg = get_preset(preset)
    ckpt = tmp_path / "ckpt"
    out = grpo(config=cfg, overrides=SMALL + ["train.steps=1", "eval.num_prompts=1"], checkpoint_dir=str(ckpt))
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0] and math.isfinite(rows[0]["train/policy_loss"])
    assert json.loads((ckpt / "config.json").read_text())["algorithm"]["name"] == cfg.algorithm.name
    assert (Path(out.lora.path) / "adapter_model.safetensors").is_file() and out.registered.version
    assert {"eval/reward_mean", "eval/base_reward_mean"} <= set(out.eval_summary)


def test_two_rank_diffusionnft_runs_through_the_workflow(grpo, tmp_path):
    """DiffusionNFT on 2 FSDP ranks (the local engine on rank 0): train, evaluate, register, report. The Ray the
    ranks start is sized for them and stops with them: a later run in the same process starts its own."""
    import ray

    assert not ray.is_initialized()
    ckpt = tmp_path / "ckpt"
    ranks = ["train.world_size=2", "train.rollout_engines=1"]
    out = grpo(config=get_preset("tiny-cpu-nft"), checkpoint_dir=str(ckpt),
               overrides=SMALL + ["train.steps=1", "eval.num_prompts=1", *ranks])
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0] and math.isfinite(rows[0]["train/nft_loss"])
    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["algorithm"]["name"] == "nft" and saved["train"]["world_size"] == 2
    assert (Path(out.lora.path) / "adapter_model.safetensors").is_file() and out.registered.version
    assert {"eval/reward_mean", "eval/base_reward_mean"} <= set(out.eval_summary)
    assert not ray.is_initialized(), "the Ray the trainer ranks started outlived the run"


def test_a_full_fine_tune_runs_through_the_workflow_and_serves(grpo, tmp_path):
    """model.finetune=full: train every weight, evaluate the model folder, register it as a pyfunc model that
    loads the base pipeline with the trained transformer and generates PNGs, report."""
    import mlflow

    ckpt = tmp_path / "ckpt"
    out = grpo(config=TINY_CPU, checkpoint_dir=str(ckpt),
               overrides=SMALL + ["train.steps=1", "eval.num_prompts=1", "model.finetune=full",
                                  "tracking.registered_model=tiny-sd3-full"])
    model = Path(out.lora.path)
    assert json.loads((model / "diffusionrl.json").read_text())["finetune"] == "full"
    assert (model / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert {"eval/reward_mean", "eval/base_reward_mean"} <= set(out.eval_summary) and out.registered.version
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    version = client.get_model_version("tiny-sd3-full", out.registered.version)
    assert version.description.startswith("Full fine-tune of ")
    assert not (ROOT / "mlruns").exists()  # the model is logged beside its run, not into a local default store
    served = mlflow.pyfunc.load_model(f"models:/tiny-sd3-full/{out.registered.version}")
    png = served.predict(pd.DataFrame({"prompt": ["a red cat"]}),
                         params={"num_inference_steps": 2, "height": 32, "width": 32})
    assert len(png) == 1 and png[0][:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_warm_start_setting_fails_before_anything_runs(grpo):
    with pytest.raises(Exception, match=r"unknown key 'lerning_rate'"):
        grpo(config=TINY_CPU, overrides=SMALL, sft_steps=1, sft_overrides=["train.lerning_rate=0.1"])
    with pytest.raises(Exception, match=r"algorithm.name=sft needs algorithm.sft_source"):
        grpo(config=TINY_CPU, overrides=SMALL, sft_steps=1)


def _pyflyte_run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLYTE_LOCAL_CACHE_ENABLED": "false", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "flytekit.clis.sdk_in_container.pyflyte", "run", "workflows/grpo.py", "grpo", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_pyflyte_run_with_a_partial_config_file_and_an_override(tmp_path):
    """A YAML with only the keys it changes is laid over its preset (tiny-cpu's learning rate and LoRA
    targets, not the bare dataclass defaults), exactly as ``load_config`` lays it."""
    import yaml

    from diffusionrl.config import get_preset, load_config

    cfg = load_config("tiny-cpu", overrides=SMALL + ["train.steps=1", "tracking.experiment=pyflyte-partial"])
    preset = get_preset("tiny-cpu").to_dict()
    partial = {section: {k: v for k, v in values.items() if preset[section][k] != v}
               for section, values in cfg.to_dict().items() if isinstance(values, dict)}
    partial = {section: values for section, values in partial.items() if values}
    assert "learning_rate" not in partial["train"] and "model" not in partial
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"preset": "tiny-cpu", **partial}))
    proc = _pyflyte_run("--config", str(path), "--overrides", json.dumps(["eval.num_prompts=1"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/win_rate" in proc.stdout
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("pyflyte-partial").experiment_id
    (run,) = client.search_runs([exp], "tags.`diffusionrl.stage` = 'workflow'")
    expected = load_config("tiny-cpu", overrides=SMALL + ["train.steps=1", "tracking.experiment=pyflyte-partial",
                                                         "eval.num_prompts=1"])
    params = run.data.params
    assert (params["preset"], params["train.learning_rate"], params["train.steps"]) == ("tiny-cpu", "0.01", "1")
    assert expected.train.learning_rate == 0.01  # tiny-cpu's, where the bare default is 3e-4
    assert json.loads(params["model.lora_targets"]) == expected.model.lora_targets


def test_pyflyte_run_rejects_a_misspelt_key_in_one_line(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("preset: tiny-cpu\ntrain:\n  lerning_rate: 0.001\n")
    proc = _pyflyte_run("--config", str(path), timeout=300)
    assert proc.returncode != 0
    out = (proc.stdout + proc.stderr).strip().splitlines()
    # pyflyte prints every error below a traceback box; the box holds one frame, the message is the last line
    assert out[-1] == "ConfigError: unknown key 'lerning_rate' in config.train; did you mean 'learning_rate'?"
    assert len(out) < 15, "\n".join(out)


def test_pyflyte_run_reports_a_prompt_data_error_in_one_line(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n')
    proc = _pyflyte_run("--overrides", json.dumps([f"data.source={tmp_path}"]), timeout=300)
    assert proc.returncode != 0
    out = proc.stdout.strip().splitlines()  # (MLflow's own log lines go to stderr)
    assert out[-2:] == ["PromptDataError: Error encountered while executing 'tasks.grpo.prepare_prompts':",
                        f"  {tmp_path}: no test split in this folder; put one of test.txt, test.jsonl, test.parquet "
                        "beside train.jsonl"]
    assert not [line for line in out if "diffusionrl/data/" in line]  # no library frames in the box


def test_a_partial_or_misspelt_tree_from_the_console_is_completed_or_rejected():
    """What the Flyte console or a remote client sends (a JSON struct or msgpack, possibly partial) is
    decoded by flytekit with mashumaro; ``ConfigTree.__pre_deserialize__`` runs ``from_dict`` first."""
    import msgpack
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Binary, Literal, Scalar
    from google.protobuf import json_format, struct_pb2

    from diffusionrl.config import Config, ConfigError, get_preset

    ctx = FlyteContextManager.current_context()

    def struct(data):
        return Literal(scalar=Scalar(generic=json_format.Parse(json.dumps(data), struct_pb2.Struct())))

    def packed(data):
        return Literal(scalar=Scalar(binary=Binary(value=msgpack.dumps(data), tag="msgpack")))

    full = get_preset("tiny-cpu-nft")
    assert TypeEngine.to_python_value(ctx, TypeEngine.to_literal(ctx, full, Config, TypeEngine.to_literal_type(Config)),
                                      Config) == full
    assert TypeEngine.to_python_value(ctx, struct(full.to_dict()), Config) == full  # JSON numbers: ints come back
    partial = {"preset": "tiny-cpu-nft", "train": {"steps": 3}}
    for literal in (struct(partial), packed(partial)):
        cfg = TypeEngine.to_python_value(ctx, literal, Config)
        assert cfg == Config.from_dict({**full.to_dict(), "train": {**full.to_dict()["train"], "steps": 3}})
    with pytest.raises(ConfigError, match=r"unknown key 'stepz' in config.train; did you mean 'steps'\?"):
        TypeEngine.to_python_value(ctx, packed({"train": {"stepz": 3}}), Config)
    with pytest.raises(ConfigError, match=r"^algorithm.kl_beta=nan must be a finite number$"):
        TypeEngine.to_python_value(ctx, packed({"algorithm": {"kl_beta": float("nan")}}), Config)


def test_prompts_are_validated_before_the_model_is_fetched(grpo, tmp_path):
    def name(node):  # a branch node (the warm start) has no entity of its own
        return node.flyte_entity.name if node.flyte_entity is not None else node.id

    upstream = {name(n): {name(u) for u in n.upstream_nodes} for n in grpo.nodes}
    assert "tasks.grpo.prepare_prompts" in upstream["tasks.grpo.fetch_base_weights"]
    from diffusionrl.config import DataConfig, RewardConfig
    from diffusionrl.data import PromptDataError
    from tasks.grpo import prepare_prompts

    (tmp_path / "train.txt").write_text("a\nb\n")
    with pytest.raises(PromptDataError, match=r"no test split in this folder") as err:
        prepare_prompts(data=DataConfig(source=str(tmp_path)), reward=RewardConfig(), fingerprint="x")
    import traceback

    frames = {Path(f.filename).name for f in traceback.extract_tb(err.value.__traceback__)}
    assert "prompts.py" not in frames and "common.py" in frames  # the task's own frame, not the library's


def test_scheduled_launch_plan_is_importable_with_its_schedule_and_inputs(grpo):
    from workflows.grpo import grpo_nightly

    assert grpo_nightly.schedule.cron_schedule.schedule == "0 3 * * *"
    assert grpo_nightly.schedule.kickoff_time_input_arg == "run_date"
    assert "overrides" in grpo_nightly.parameters.parameters
    assert grpo_nightly.name == "grpo_nightly"


def test_a_bad_on_config_change_or_an_owned_run_folder_fails_the_first_task(grpo, tmp_path, monkeypatch):
    """on_config_change=bogus was refused only by train, and a second execution on a checkpoint_dir another run
    holds only in train, after the prompts were prepared and the weights fetched: both stop resolve_config."""
    from diffusionrl.run import hold_run_folder
    from diffusionrl.run.lock import Lease

    first = r"Error encountered while executing 'tasks.grpo.resolve_config':\s+"
    with pytest.raises(Exception, match=first + r"on_config_change='bogus' is not one of \['fail', 'record'\]"):
        grpo(config=TINY_CPU, overrides=SMALL, on_config_change="bogus")
    ckpt = tmp_path / "run"
    for held, sft_steps in ((ckpt, 0), (ckpt / "sft", 1)):  # the train stage's folder, the warm start's
        with hold_run_folder(held):
            with pytest.raises(Exception, match=first + rf"run folder {held} is in use by another run: "
                                                        rf"pid {os.getpid()}@"):
                grpo(config=TINY_CPU, overrides=SMALL, checkpoint_dir=str(ckpt), sft_steps=sft_steps,
                     sft_overrides=["algorithm.sft_source=builtin:shapes:4"])
    monkeypatch.setenv("DIFFUSIONRL_ALLOW_MEMORY_STORE", "1")  # memory:// stands in for s3:// (one process)
    uri = f"memory://runs/{tmp_path.name}"
    owner = Lease(uri, ttl_s=30, settle_s=0.01, tags={"execution": "another"}).acquire()
    try:
        with pytest.raises(Exception, match=first + rf"run folder {uri} is in use by another run"):
            grpo(config=TINY_CPU, overrides=SMALL, checkpoint_dir=uri)
    finally:
        owner.release()
