"""MLflow lineage and registry against a real ``mlflow server`` on loopback (SQLite backend,
temporary artifact root), driven by the real workflow (local Flyte execution, local Ray)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from diffusionrl import serving, tracking
from diffusionrl.config import get_preset

from .cluster_harness import http_ok, spawn, wait_until
from .conftest import TINY_OVERRIDES, tiny_config

# The workflow's default is tiny-cpu-shapes (the demo); these tests run the faster JPEG task.
TINY_CPU = get_preset("tiny-cpu")

ROOT = Path(__file__).resolve().parents[1]
SECRET = "secret-value-7f3a9c"
SMALL = TINY_OVERRIDES + ["data.num_prompts=24", "data.test_fraction=0.2", "eval.num_prompts=2"]
GOOD = SMALL + ["train.steps=3", "train.log_images_every=1"]
# ~ the base model; without the base-model bar (a decision setting, same eval_key) so it meets the champion
WORSE = SMALL + ["train.steps=1", "train.learning_rate=1e-12", "eval.champion_over_base=false"]
SECTION_10 = [
    "rollout/reward/raw_mean", "rollout/reward/raw_std", "rollout/reward/raw_min", "rollout/reward/raw_max",
    "rollout/reward/raw_median", "rollout/reward/num_samples", "rollout/reward/jpeg_compressibility_mean",
    "rollout/zero_std/count", "train/loss", "train/policy_loss", "train/kl_loss", "train/approx_kl", "train/clipfrac",
    "train/ratio_abs_minus_1", "train/log_prob_mean_abs_diff", "train/grad_norm", "train/lr", "perf/rollout_time",
    "perf/reward_time", "perf/train_time", "perf/update_weights_time", "perf/step_time",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real MLflow tracking + registry server: SQLite backend, local artifact root."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
           "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    # its own session, so stopping it stops the workers it spawns; a slow /health (a loaded machine) is waited for
    svc = spawn("mlflow server", cmd, dict(os.environ), root, root / "server.log")
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_until("mlflow server /health", lambda: http_ok(uri + "/health"), 180, [svc])
        yield uri, root
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def grpo():
    sys.path.insert(0, str(ROOT))
    from workflows.grpo import grpo as wf

    return wf


@pytest.fixture(scope="module")
def runs(server, grpo, tmp_path_factory):
    """Two executions against the server: a trained one (with HF_TOKEN set), then a worse one."""
    uri, _ = server
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    mp.setenv("HF_TOKEN", SECRET)
    try:
        good_dir = tmp_path_factory.mktemp("good")
        good = grpo(config=TINY_CPU, overrides=GOOD, checkpoint_dir=str(good_dir))
        mp.delenv("HF_TOKEN")
        worse = grpo(config=TINY_CPU, overrides=WORSE, checkpoint_dir=str(tmp_path_factory.mktemp("worse")))
    finally:
        mp.undo()
    return good, worse, good_dir


def _client(server) -> MlflowClient:
    return MlflowClient(tracking_uri=server[0], registry_uri=server[0])


def _children(client, parent):
    runs = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return {r.data.tags[tracking.STAGE_TAG]: r for r in runs}


def test_run_tree_tags_params_metrics_datasets_images_and_report(server, runs):
    good, _, _ = runs
    client = _client(server)
    mv = client.get_model_version(good.registered.name, good.registered.version)
    parent = client.get_run(mv.run_id)
    tags = parent.data.tags
    assert parent.info.status == "FINISHED"
    for key in ("flyte_execution_id", "workflow_version", "git_sha", "config_digest", "base_model",
                "base_model_digest", "dataset_digest"):
        assert tags.get(key), key
    assert tags["base_model"] == "builtin:tiny-sd3" and len(tags["base_model_digest"]) == 64
    assert tags["flyte_execution_id"].startswith("local-")
    # params: the whole flattened config
    assert parent.data.params["train.steps"] == "3" and parent.data.params["sampling.resolution"] == "32"
    assert len(parent.data.params) >= 60
    stages = _children(client, parent)
    assert set(stages) == {"prepare", "train", "evaluate"}
    assert all(r.info.status == "FINISHED" for r in stages.values())
    assert all(r.data.tags["config_digest"] == tags["config_digest"] for r in stages.values())
    # every section-10 metric, once per step
    train_run = stages["train"].info.run_id
    for key in SECTION_10:
        assert [m.step for m in client.get_metric_history(train_run, key)] == [1, 2, 3], key
    assert good.metrics["rollout/reward/raw_mean"].tolist() == pytest.approx(
        [m.value for m in client.get_metric_history(train_run, "rollout/reward/raw_mean")])
    # sample images every step (log_images_every=1)
    images = [a.path for a in client.list_artifacts(train_run, "images")]
    assert len([p for p in images if p.endswith(".png")]) >= 3
    # eval metrics on the evaluate run and the workflow run
    assert stages["evaluate"].data.metrics["eval/reward_mean"] == pytest.approx(good.eval_summary["eval/reward_mean"])
    assert parent.data.metrics["eval/reward_mean"] == pytest.approx(good.eval_summary["eval/reward_mean"])
    # datasets with digests; the Parquet they name is an artifact of the prepare run
    inputs = stages["prepare"].inputs.dataset_inputs
    by_name = {d.dataset.name: d for d in inputs}
    assert set(by_name) == {"prompts-train", "prompts-test"}
    contexts = {d.dataset.name: {t.key: t.value for t in d.tags}["mlflow.data.context"] for d in inputs}
    assert contexts == {"prompts-train": "training", "prompts-test": "evaluation"}
    local = Path(client.download_artifacts(stages["prepare"].info.run_id, "data"))
    for split in ("train", "test"):
        df = pd.read_parquet(local / f"prompts-{split}.parquet")
        assert by_name[f"prompts-{split}"].dataset.digest == tracking.frame_digest(df)
    # report and trajectories on the workflow run
    top = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.html", "trajectories"} <= top
    traj = {a.path for a in client.list_artifacts(parent.info.run_id, "trajectories")}
    assert "trajectories/step-000003.parquet" in traj
    html = Path(client.download_artifacts(parent.info.run_id, "report.html")).read_text()
    assert f"{good.registered.name} v{good.registered.version}" in html
    # the logged model belongs to the run's experiment (not MLflow's Default one)
    model = client.get_logged_model(mv.source.removeprefix("models:/"))
    assert model.experiment_id == parent.info.experiment_id and model.source_run_id == parent.info.run_id


def test_registered_versions_candidate_and_champion(server, runs):
    good, worse, _ = runs
    client = _client(server)
    name = good.registered.name
    assert good.registered.aliases == ["candidate", "champion"] and good.registered.promoted
    good_tags = client.get_model_version(name, good.registered.version).tags
    assert good_tags["champion_metric"] == "eval/reward_mean"  # above the base model's on the same evaluation
    assert float(good_tags["base_score"]) == pytest.approx(good.eval_summary["eval/base_reward_mean"])
    assert float(good_tags["base_score"]) < good.registered.score
    assert worse.registered.score < good.registered.score  # the precondition of "worse"
    assert not worse.registered.promoted and worse.registered.champion_version == good.registered.version
    assert client.get_model_version_by_alias(name, "champion").version == good.registered.version
    assert client.get_model_version_by_alias(name, "candidate").version == worse.registered.version
    tags = client.get_model_version(name, worse.registered.version).tags
    assert tags["promoted"] == "false" and tags["decision"].startswith("kept champion")
    assert float(tags["eval_score"]) == pytest.approx(worse.registered.score)
    assert float(tags["champion_score_compared"]) == pytest.approx(good.registered.score)
    assert tags["champion_before"] == good.registered.version and tags["eval_key"]


def test_a_registered_version_has_a_description_and_a_model_card(server, runs):
    """The version says what it is (base model, objective, reward, steps, held-out score vs base, run),
    and its model card is the adapter folder's README.md and an artifact of the run."""
    import mlflow
    from mlflow.artifacts import download_artifacts, load_text

    good, _, _ = runs
    client = _client(server)
    mv = client.get_model_version(good.registered.name, good.registered.version)
    for fact in ("LoRA of builtin:tiny-sd3", "flow_grpo", "reward jpeg_compressibility 1", "3 steps",
                 f"Held-out reward {good.registered.score:.4g} vs base", f"MLflow run {mv.run_id}"):
        assert fact in mv.description, (fact, mv.description)
    mlflow.set_tracking_uri(server[0])
    mlflow.set_registry_uri(server[0])
    card = load_text(f"runs:/{mv.run_id}/model_card/README.md")
    assert "More Information Needed" not in card and "library_name: diffusers" in card
    assert f"| reward_mean | {good.registered.score:.4g} |" in card and "Training steps: 3" in card
    assert f'mlflow.pyfunc.load_model("models:/{good.registered.name}@champion")' in card
    model = Path(download_artifacts(f"models:/{good.registered.name}/{good.registered.version}"))
    assert (model / "adapter_weights" / "README.md").read_text() == card
    assert "library_name: peft" in (model / "adapter_weights" / serving.PEFT_SUBDIR / "README.md").read_text()


def test_champion_loads_through_pyfunc_and_generates(server, runs):
    import mlflow.pyfunc
    from PIL import Image

    good, _, _ = runs
    mlflow.set_tracking_uri(server[0])
    mlflow.set_registry_uri(server[0])
    model = mlflow.pyfunc.load_model(f"models:/{good.registered.name}@champion")
    out = model.predict(pd.DataFrame({"prompt": ["a red apple on a table"]}), params={"num_inference_steps": 3})
    assert len(out) == 1
    img = Image.open(io.BytesIO(out[0]))
    assert img.size == (32, 32) and np.asarray(img).std() > 0


def test_registered_adapter_equals_the_trained_lora(server, runs):
    """diffusers' load_lora_weights on the registered adapter gives our peft model's exact output."""
    import mlflow.diffusers
    from peft import PeftModel

    from diffusionrl.models import build_tiny_sd3_pipeline

    good, _, _ = runs
    mlflow.set_registry_uri(server[0])
    pipe = mlflow.diffusers.load_model(f"models:/{good.registered.name}@champion").load_pipeline(device="cpu")
    ours = PeftModel.from_pretrained(build_tiny_sd3_pipeline().transformer, good.lora.path).eval()
    c = pipe.transformer.config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, c.in_channels, 4, 4, generator=gen)
    enc = torch.randn(2, 12, c.joint_attention_dim, generator=gen)
    pooled = torch.randn(2, c.pooled_projection_dim, generator=gen)
    t = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        a = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=enc, pooled_projections=pooled).sample
        b = ours(hidden_states=x, timestep=t, encoder_hidden_states=enc, pooled_projections=pooled).sample
        with ours.disable_adapter():
            base = ours(hidden_states=x, timestep=t, encoder_hidden_states=enc, pooled_projections=pooled).sample
    assert (a - b).abs().max().item() <= 1e-6
    assert (a - base).abs().max().item() > 1e-4  # the adapter is really applied


def test_secret_never_reaches_the_store_or_artifacts(server, runs):
    _, _, good_dir = runs
    _, root = server
    needle = SECRET.encode()
    files = [p for p in list(root.rglob("*")) + list(good_dir.rglob("*")) if p.is_file() and p.name != "server.log"]
    assert any(p.suffix == ".db" for p in files) and any(p.name == "MLmodel" for p in files)
    leaked = [str(p) for p in files if needle in p.read_bytes()]
    assert leaked == []


def test_registry_show_cli(server, runs):
    good, worse, _ = runs
    env = {**os.environ, "MLFLOW_TRACKING_URI": server[0]}
    out = subprocess.run([sys.executable, "-m", "diffusionrl.serving", "show"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    view = json.loads(out.stdout)
    assert view["name"] == good.registered.name and view["champion"] == good.registered.version
    v1, v2 = view["versions"][:2]
    assert v1["aliases"] == ["champion"] and v2["aliases"] == ["candidate"]
    for v in (v1, v2):
        assert set(tracking.LINEAGE_KEYS) <= set(v) and all(v[k] for k in tracking.LINEAGE_KEYS)
        assert isinstance(v["eval_score"], float) and v["run_id"]
    assert v1["eval_score"] == pytest.approx(good.registered.score)


def test_champion_with_another_evaluation_is_re_evaluated(server, runs):
    """A version whose eval_key differs from the champion's compares against a re-score of the
    champion on its own evaluation, never against a number from another evaluation."""
    good, _, _ = runs
    uri = server[0]
    client = _client(server)
    mv = client.get_model_version(good.registered.name, good.registered.version)
    run = tracking.TrackingRun(uri, client.get_run(mv.run_id).info.experiment_id, mv.run_id)
    cfg = tiny_config(*SMALL)
    assert cfg.tracking.registered_model == good.registered.name
    info = serving.log_lora_model(run, cfg, good.lora.path, _base_ref(mv), example_prompt="a cat", metadata={})
    seen = []

    def rescore(model_dir: Path) -> float:
        seen.append(model_dir)
        assert (model_dir / "adapter_weights" / serving.PEFT_SUBDIR / "adapter_model.safetensors").is_file()
        return good.registered.score + 1.0  # the champion under the new evaluation

    lineage = {k: mv.tags[k] for k in tracking.LINEAGE_KEYS}
    reg = serving.register(run, cfg, info, good.registered.score + 0.5, "another-eval-key", lineage, rescore=rescore)
    assert len(seen) == 1 and not reg.promoted and "re-evaluated" in reg.decision
    assert reg.previous_champion_score == pytest.approx(good.registered.score + 1.0)
    assert client.get_model_version_by_alias(good.registered.name, "champion").version == good.registered.version


def _base_ref(mv) -> str:
    """The base-model reference the registered version's diffusers flavor recorded."""
    import mlflow.diffusers

    return mlflow.diffusers.load_model(f"models:/{mv.name}/{mv.version}").base_model


def test_decide_margin():
    assert serving.decide(1.0, None, 0.0)[0]
    assert serving.decide(1.0, 0.5, 0.1)[0]
    assert not serving.decide(1.0, 0.95, 0.1)[0]
    assert not serving.decide(1.0, 1.0, 0.0)[0]  # a tie does not move the champion


def test_unreachable_tracking_uri_fails_before_training(grpo, tmp_path):
    bad = f"http://127.0.0.1:{_free_port()}"
    ckpt = tmp_path / "run"
    with pytest.raises(Exception) as err:
        grpo(config=TINY_CPU, overrides=SMALL + [f"tracking.uri={bad}"], checkpoint_dir=str(ckpt))
    assert bad in str(err.value) and "unreachable" in str(err.value)
    assert not (ckpt / "checkpoints").exists()  # training never started


def test_metric_logger_buffers_through_an_outage(server):
    """A store that is down keeps metrics buffered; they arrive once it answers again."""
    from types import SimpleNamespace

    uri = server[0]
    exp = tracking.ensure_experiment(uri, "logger-test")
    run_id = _client(server).create_run(exp).info.run_id
    logger = tracking.MetricLogger(f"http://127.0.0.1:{_free_port()}", run_id, attempts=2, base_delay_s=0.01)
    traj = SimpleNamespace(images=None)
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        logger.on_step(None, 1, traj, {"train/loss": 0.5, "perf/step_time": 1.0})
        logger.on_step(None, 2, traj, {"train/loss": 0.25, "perf/step_time": 1.0})
    finally:
        os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    assert logger.failed_flushes == 1 and len(logger.buffer) == 4  # the lookup failed: no try before retry_after_s
    logger.uri = uri  # the store is back
    logger.on_end(SimpleNamespace(out_dir="."))
    assert logger.buffer == []
    assert ([(m.step, m.value) for m in _client(server).get_metric_history(run_id, "train/loss")]
            == [(1, 0.5), (2, 0.25)])


def test_preflight_names_the_uri():
    bad = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(tracking.TrackingUnavailable, match=bad.replace(".", r"\.")):
        tracking.preflight(bad, timeout_s=2)


def _mlflow_server(root: Path, port: int):
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
           "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    svc = spawn("mlflow server", cmd, dict(os.environ), root, root / "server.log")
    wait_until("mlflow server /health", lambda: http_ok(f"http://127.0.0.1:{port}/health"), 180, [svc])
    return svc


def test_an_mlflow_outage_costs_the_steps_no_time_and_its_metrics_arrive_when_it_is_back(tmp_path):
    """While the tracking server was down every training step took ~61 s (MLflow's retries per call, then ours,
    every step). A real server is stopped and started again on the same store: the first step that finds it down
    pays a bounded try, the next ones nothing (the store is tried again after retry_after_s), and once it answers
    every buffered step arrives, once. A resumed run's steps that never reached the store (its metrics.jsonl,
    loop.history) are replayed; a logger started while the store is down asks it what it holds once it answers."""
    import time
    from types import SimpleNamespace

    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    svc = _mlflow_server(tmp_path, port)
    try:
        run_id = MlflowClient(uri).create_run(tracking.ensure_experiment(uri, "outage")).info.run_id
        traj = SimpleNamespace(images=None)
        loop = SimpleNamespace(history=[], out_dir=tmp_path, step=0)

        def step(logger, s: int) -> float:
            row = {"train/loss": 1.0 / s, "perf/step_time": 1.0, "step": float(s)}
            loop.history.append(row)
            loop.step = s
            t0 = time.monotonic()
            logger.on_step(loop, s, traj, row)
            return time.monotonic() - t0

        logger = tracking.MetricLogger(uri, run_id, base_delay_s=0.01, retry_after_s=3, max_retry_after_s=3)
        step(logger, 1)
        svc.stop()
        spent = [step(logger, s) for s in (2, 3, 4, 5)]
        assert spent[0] < 10 and max(spent[1:]) < 0.5, spent  # one bounded try, then no call while it is down
        assert logger.failed_flushes == 1 and {m.step for m in logger.buffer} == {2, 3, 4, 5}
        svc = _mlflow_server(tmp_path, port)  # the store is back
        time.sleep(max(0.0, logger.down_until - time.monotonic()))
        step(logger, 6)
        assert logger.buffer == [] and logger.down_until is None
        losses = MlflowClient(uri).get_metric_history(run_id, "train/loss")
        assert sorted((m.step, m.value) for m in losses) == [(s, 1.0 / s) for s in range(1, 7)]

        # the attempt before ended during an outage: steps 7 and 8 are in its metrics.jsonl only
        loop.history += [{"train/loss": 1.0 / s, "perf/step_time": 1.0, "step": float(s)} for s in (7, 8)]
        resumed = tracking.MetricLogger(uri, run_id, base_delay_s=0.01)
        assert resumed.logged_upto == 6
        step(resumed, 9)
        losses = MlflowClient(uri).get_metric_history(run_id, "train/loss")
        assert sorted(m.step for m in losses) == list(range(1, 10))

        svc.stop()  # a logger that starts while the store is down
        t0 = time.monotonic()
        late = tracking.MetricLogger(uri, run_id, base_delay_s=0.01, retry_after_s=3, max_retry_after_s=3)
        assert late.logged_upto is None and time.monotonic() - t0 < 10
        spent = [step(late, s) for s in (10, 11)]
        assert max(spent) < 0.5, spent
        svc = _mlflow_server(tmp_path, port)
        time.sleep(max(0.0, late.down_until - time.monotonic()))
        late.on_end(loop)  # the final flush: asks what the store holds, then sends the rest, once
        assert late.logged_upto == 9 and late.buffer == []
        losses = MlflowClient(uri).get_metric_history(run_id, "train/loss")
        assert sorted(m.step for m in losses) == list(range(1, 12))
    finally:
        svc.stop()
