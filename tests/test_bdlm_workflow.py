"""The block-diffusion LM workflow end to end (local Flyte execution, the session's MLflow store):
data -> warm start -> GRPO -> evaluation -> registration -> report, and resume across runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from diffusionrl import tracking

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["warm_start.steps=40", "grpo.steps=3", "grpo.prompts_per_step=4", "grpo.group_size=4",
         "grpo.micro_batch_size=8", "grpo.checkpoint_every=1", "task.num_train=200", "task.num_test=20",
         "tracking.registered_model=test-bdlm"]


@pytest.fixture(scope="module")
def bdlm_wf():
    sys.path.insert(0, str(ROOT))
    from workflows.bdlm import bdlm

    return bdlm


@pytest.fixture(scope="module")
def run(bdlm_wf, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("bdlm")
    return bdlm_wf(overrides=SMALL, checkpoint_dir=str(ckpt)), ckpt


def test_outputs_run_tree_and_registered_version(run):
    out, ckpt = run
    assert len(out.metrics) == 3 and (ckpt / "grpo" / "checkpoints").is_dir()
    assert sorted(p.name for p in Path(out.traces.path).glob("step-*.parquet"))[-1] == "step-000003.parquet"
    assert "block-diffusion LM report" in Path(out.report.path).read_text()
    uri = os.environ["MLFLOW_TRACKING_URI"]
    client = MlflowClient(uri, uri)
    mv = client.get_model_version("test-bdlm", out.registered.version)
    assert mv.tags["task"] == "sort" and mv.tags["base_model"] == "builtin:tiny-bdlm"
    assert float(mv.tags["eval_score"]) == pytest.approx(out.eval_summary["eval/reward_mean"])
    parent = client.get_run(mv.run_id)
    assert parent.data.tags["algorithm"] == "bdlm_grpo_exact_trace" and parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{mv.run_id}'")
    stages = {r.data.tags[tracking.STAGE_TAG]: r.info.run_id for r in children}
    assert set(stages) == {"prepare", "warm_start", "train", "evaluate"}
    assert [m.step for m in client.get_metric_history(stages["train"], "train/approx_kl")] == [1, 2, 3]
    assert len(client.get_metric_history(stages["warm_start"], "warmstart/loss")) == 40
    assert {"report.html", "traces"} <= {a.path for a in client.list_artifacts(mv.run_id)}


def test_registered_model_decodes_like_the_trained_policy(run):
    """pyfunc predict on the registered version equals greedy decoding with the trained weights."""
    import mlflow.pyfunc

    from diffusionrl.bdlm import load_bdlm, load_bdlm_config
    from diffusionrl.bdlm.evaluation import decode_answers
    from diffusionrl.bdlm.task import make_splits

    out, _ = run
    cfg = load_bdlm_config("tiny-bdlm", overrides=SMALL)
    examples = make_splits(cfg.task).test[:10]
    expected = decode_answers(cfg, load_bdlm(out.model.path, cfg.model), examples)
    mlflow.set_registry_uri(os.environ["MLFLOW_TRACKING_URI"])
    model = mlflow.pyfunc.load_model(f"models:/test-bdlm/{out.registered.version}")
    got = model.predict(pd.DataFrame({"prompt": [e.prompt for e in examples]}))
    assert list(got) == expected


def test_rerun_with_more_steps_resumes_and_only_adds_steps(bdlm_wf, run):
    """Same checkpoint_dir, grpo.steps 3 -> 4: the first 3 steps are the old run's, one step is new."""
    out, ckpt = run
    more = bdlm_wf(overrides=SMALL[:1] + ["grpo.steps=4"] + SMALL[2:], checkpoint_dir=str(ckpt))
    assert len(more.metrics) == 4
    cols = ["rollout/reward/raw_mean", "train/loss"]
    pd.testing.assert_frame_equal(more.metrics[cols].iloc[:3].reset_index(drop=True),
                                  out.metrics[cols].reset_index(drop=True))


def test_diffusiongemma_preset_through_the_workflow_registers_and_serves(bdlm_wf, tmp_path):
    """``--config '{"preset": "tiny-diffusiongemma"}'``: the workflow trains the DiffusionGemma
    through the stock pipeline, registers it, and the registered pyfunc decodes through it too."""
    import mlflow.pyfunc

    from diffusionrl.bdlm import BDLMConfig, load_bdlm, load_bdlm_config
    from diffusionrl.bdlm.evaluation import decode_answers
    from diffusionrl.bdlm.task import make_splits

    small = ["warm_start.steps=20", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4",
             "grpo.micro_batch_size=8", "task.num_train=100", "task.num_test=8", "grpo.objective=dr_grpo",
             "tracking.registered_model=test-bdlm-gemma"]
    config = BDLMConfig.from_dict({"preset": "tiny-diffusiongemma"})
    out = bdlm_wf(config=config, overrides=small, checkpoint_dir=str(tmp_path / "ckpt"))
    assert len(out.metrics) == 2 and out.metrics["train/log_prob_mean_abs_diff"].max() <= 1e-6
    uri = os.environ["MLFLOW_TRACKING_URI"]
    client = MlflowClient(uri, uri)
    mv = client.get_model_version("test-bdlm-gemma", out.registered.version)
    assert mv.tags["base_model"] == "builtin:tiny-diffusiongemma"
    assert client.get_run(mv.run_id).data.tags["algorithm"] == "bdlm_dr_grpo_exact_trace"
    cfg = load_bdlm_config("tiny-diffusiongemma", small)
    examples = make_splits(cfg.task).test
    expected = decode_answers(cfg, load_bdlm(out.model.path), examples)
    mlflow.set_registry_uri(uri)
    got = mlflow.pyfunc.load_model(f"models:/test-bdlm-gemma/{out.registered.version}").predict(
        pd.DataFrame({"prompt": [e.prompt for e in examples]}))
    assert list(got) == expected


def test_a_bad_on_config_change_or_an_owned_run_folder_fails_the_first_task(bdlm_wf, tmp_path):
    """Both were refused only by train_bdlm, after the data and the warm start."""
    from diffusionrl.run import hold_run_folder

    first = r"Error encountered while executing 'tasks.bdlm.resolve_bdlm_config':\s+"
    with pytest.raises(Exception, match=first + r"on_config_change='bogus' is not one of \['fail', 'record'\]"):
        bdlm_wf(overrides=SMALL, on_config_change="bogus")
    with hold_run_folder(tmp_path / "grpo"):  # the GRPO stage's run folder
        with pytest.raises(Exception, match=first + rf"run folder {tmp_path / 'grpo'} is in use by another run"):
            bdlm_wf(overrides=SMALL, checkpoint_dir=str(tmp_path))
