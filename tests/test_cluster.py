"""The ``grpo`` workflow run the way a Flyte cluster runs it (``tests/cluster_harness.py``).

``pyflyte package --fast`` serializes the workflow; a small propeller runs each node's serialized
command (``pyflyte-fast-execute`` -> ``pyflyte-execute``) in a fresh process with its own HOME,
working directory and TMPDIR, against an S3-compatible object store (moto), an MLflow server whose
artifacts live in that store, and a two-node Ray cluster. Tasks share nothing else.

One known limit is marked ``pytest.xfail``: the built-in CPU model has no hub id, so its registered
version names a folder on the register pod's disk.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from . import cluster_harness as ch
from .conftest import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = "workflows.grpo.grpo"
STEPS = 3
FAULT_AFTER = 2  # a train attempt fails (retryably) after this many steps of its own
# The config input: tiny-cpu with the test-sized settings; `overrides` (also an input) adds the rest.
CONFIG_OVERRIDES = TINY_OVERRIDES + ["data.num_prompts=24", "data.test_fraction=0.2"]
RUN_OVERRIDES = [f"train.steps={STEPS}", "train.checkpoint_every=1", "eval.num_prompts=2", "reward.num_actors=1",
                 "algorithm.sft_source=builtin:shapes:8"]
SFT_STEPS = 1  # the warm-start branch runs: RL then starts from the SFT LoRA's object-store URI
SECRET_GROUP, SECRET_KEY = "hf", "token"
TASKS_WITH_SECRET = ("fetch_base_weights", "train", "evaluate", "register")
TIMED_TASKS = ("train", "evaluate", "register")

for tool in ("moto_server", "mlflow", "ray", "pyflyte", "pyflyte-execute", "pyflyte-fast-execute"):
    if not (ch.VENV_BIN / tool).exists():
        pytest.skip(f"{tool} is not installed in {ch.VENV_BIN}", allow_module_level=True)
for module in ("boto3", "moto", "s3fs", "kubernetes"):
    pytest.importorskip(module, reason=f"{module} is needed (pip install -e .[test])")


# -- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return Path(tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def package(root, services):
    # Registered as docs/cluster.md says: the tracking server's URI goes into every task's environment.
    return ch.build_package(ROOT, root / "package", MLFLOW_TRACKING_URI=services["mlflow_url"])


@pytest.fixture(scope="module")
def services(root):
    """Object store, MLflow server and Ray cluster; stopped (by process group) at the end."""
    started: list[ch.Service] = []
    ray_root = Path(tempfile.mkdtemp(prefix="ctray", dir="/tmp"))  # Ray's socket paths must stay short
    try:
        store = ch.start_object_store(root / "s3", started)
        url, db, mlflow = ch.start_mlflow(root / "mlflow", store, started)
        ray_address = ch.start_ray(ray_root, started)  # meanwhile the MLflow server starts
        ch.wait_mlflow(url, mlflow)
        yield {"store": store, "mlflow_url": url, "mlflow_db": db, "ray_address": ray_address,
               "ray_dirs": [ray_root], "services": started}
    finally:
        for svc in reversed(started):
            svc.stop()
        shutil.rmtree(ray_root, ignore_errors=True)


@pytest.fixture(scope="module")
def token():
    return f"hf_ctest_{secrets.token_hex(16)}"


@pytest.fixture(scope="module")
def propeller(package, services, root, token):
    env = {
        **ch.s3_env(services["store"]),  # no MLFLOW_TRACKING_URI: the tasks carry it from registration
        "RAY_ADDRESS": services["ray_address"],
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    version = _git("rev-parse", "--short", "HEAD") or "dev"
    return ch.MiniPropeller(package, services["store"], root / "pods", env, {(SECRET_GROUP, SECRET_KEY): token},
                            version=version)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _config():
    from diffusionrl.config import load_config

    return load_config("tiny-cpu", overrides=CONFIG_OVERRIDES)


def workflow_inputs(package, checkpoint_dir: str = "") -> dict:
    from diffusionrl.config import Config

    iface = package.workflows[WORKFLOW].template.interface.inputs.variables
    values = {"config": (_config(), Config), "overrides": (RUN_OVERRIDES, list[str]),
              "checkpoint_dir": (checkpoint_dir, str), "on_config_change": ("fail", str),
              "sft_steps": (SFT_STEPS, int), "sft_overrides": ([], list[str])}
    assert set(values) == set(iface), f"the workflow's inputs changed: {sorted(iface)}"
    return {k: ch.to_literal(v, t, iface[k].type) for k, (v, t) in values.items()}


@pytest.fixture(scope="module")
def execution(propeller, package, services):
    """The whole DAG, node by node, and (from the moment ``train`` succeeds, alongside the rest
    of the DAG) the retry scenario of ``retried``. Afterwards every pod's folder is deleted (a
    pod's disk does not outlive it): later checks see only the object store and the MLflow server."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        probe = pool.submit(propeller.probe, ["diffusionrl", "tasks.grpo", "workflows.grpo"], "tasks.grpo.train")
        side: dict[str, concurrent.futures.Future] = {}

        def on_node_done(ex, node):
            if node.task.endswith(".train") and node.ok:
                side["retried"] = pool.submit(run_retry_scenario, propeller, ex.name, node, services["store"])

        ex = propeller.run_workflow(WORKFLOW, workflow_inputs(package), on_node_done=on_node_done)
        ex.probe = probe.result()
        ex.side = {k: f.exception() or f.result() for k, f in side.items()}
    propeller.remove_workdirs()
    return ex


def _require_dag(execution):
    if execution.failed is not None:
        pytest.fail(f"the DAG did not complete: {execution.failed.final.failure()}")


@dataclass
class Retried:
    result: ch.NodeResult  # the train node, retried as propeller does
    checkpoint_dir: str  # the checkpoint_dir input of that run
    s3_checkpoint_dir: str
    s3_result: ch.NodeResult  # the run with checkpoint_dir in the object store (the same run if it worked)


def _train_inputs(train: ch.NodeResult, checkpoint_dir: str):
    inputs = type(train.inputs)()
    inputs.CopyFrom(train.inputs)
    inputs.literals["checkpoint_dir"].scalar.primitive.string_value = checkpoint_dir
    return inputs


def _injected(attempt: ch.Attempt) -> bool:
    return attempt.error is not None and f"injected fault after {FAULT_AFTER} steps" in attempt.error.error.message


def run_retry_scenario(propeller, execution_name: str, train: ch.NodeResult, store) -> Retried:
    """A second execution of the train node with a fault injected after 2 steps of every attempt
    (the variable stays set on every attempt, as a pod spec's env does): attempt 0 fails
    retryably and the next attempt resumes from its Flyte checkpoint. Once with ``checkpoint_dir``
    an object-store prefix, once with ``''`` (the default)."""
    fault = {"DIFFUSIONRL_FAULT_AFTER_STEPS": str(FAULT_AFTER)}
    s3_dir = store.uri("checkpoint-dirs", "retry")
    s3 = propeller.run_node(f"{execution_name}r", train.node, train.task, _train_inputs(train, s3_dir), extra_env=fault)
    # The default (checkpoint_dir=''): the run folder lies under attempt 0's raw output prefix, and
    # the retry finds it through the Flyte checkpoint (run.json) alone.
    local = propeller.run_node(f"{execution_name}l", train.node, train.task, _train_inputs(train, ""), extra_env=fault)
    return Retried(local, "", s3_dir, s3)


@pytest.fixture(scope="module")
def retried(execution):
    if "retried" not in execution.side:
        _require_dag(execution)
        pytest.fail("the retry scenario did not run")
    out = execution.side["retried"]
    if isinstance(out, BaseException):
        raise out
    return out


# -- helpers ---------------------------------------------------------------------------------------------------


def _read_parquet_folder(store, uri: str) -> pd.DataFrame:
    keys = sorted(k for k in store.keys(uri) if not k.endswith("/"))
    bucket, _ = store.split(uri)
    frames = [pd.read_parquet(io.BytesIO(store.get(f"s3://{bucket}/{k}"))) for k in keys]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _lora_tensors(store, lora_uri: str, tmp: Path) -> dict:
    from safetensors.torch import load_file

    store.download_folder(lora_uri, tmp)
    return load_file(str(tmp / "adapter_model.safetensors"))


def _bitwise_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- 1. the serialized templates (package only, no servers) -------------------------------------------------


def test_serialized_templates_declare_images_resources_secrets_retries(package):
    """Every task the cluster would run says what it needs: image, resources, secrets, retries,
    timeouts, interruptibility, cache versions."""
    names = {t.split(".")[-1] for t in package.tasks if t.startswith("tasks.grpo.")}
    assert {"resolve_config", "start_run", "prepare_prompts", "fetch_base_weights", "track_inputs", "train",
            "evaluate", "register", "report", "fingerprint_prompts"} <= names
    assert package.fast_tarball is not None, "pyflyte package --fast wrote no code tarball"
    import tarfile

    with tarfile.open(package.fast_tarball) as tf:
        members = set(tf.getnames())
    assert {"diffusionrl/__init__.py", "tasks/grpo.py", "workflows/grpo.py", "images/__init__.py"} <= members
    for name in sorted(names):
        tmpl = package.task(name).template
        assert tmpl.container.image and ":" in tmpl.container.image, f"{name}: no image"
        assert tmpl.container.args[0] == "pyflyte-fast-execute", f"{name}: {tmpl.container.args[:3]}"

    from google.protobuf.json_format import MessageToDict

    def requests(tmpl) -> dict[str, str]:
        names = {1: "cpu", 2: "gpu", 3: "memory", 4: "storage", 5: "ephemeral_storage"}
        return {names.get(r.name, str(r.name)): r.value for r in tmpl.container.resources.requests}

    train = package.task("train").template
    assert train.type == "ray"
    head = MessageToDict(train.custom)["rayCluster"]["headGroupSpec"]
    head_requests = head["k8sPod"]["podSpec"]["containers"][0]["resources"]["requests"]
    assert head_requests.get("nvidia.com/gpu") not in (None, "0"), f"train head requests no GPU: {head_requests}"
    cluster = MessageToDict(train.custom)["rayCluster"]
    assert cluster.get("enableAutoscaling") is True, "train-gpu workers would never start past the head's GPUs"
    for pod in [head["k8sPod"], *(g["k8sPod"] for g in cluster["workerGroupSpec"] if g["groupName"] == "train-gpu")]:
        shm = {v["name"]: v for v in pod["podSpec"].get("volumes", [])}.get("dshm", {})
        assert shm.get("emptyDir", {}).get("medium") == "Memory", f"no memory-backed /dev/shm: {pod['podSpec']}"
        disk = pod["podSpec"]["containers"][0]["resources"]["requests"].get("ephemeral-storage")
        assert disk, "a pod that downloads the model requests no ephemeral storage"
    reward = [g for g in cluster["workerGroupSpec"] if g["groupName"] == "reward-cpu"]
    assert reward and "reward-cpu" in reward[0]["rayStartParams"]["resources"]
    for name in ("evaluate", "register"):
        assert requests(package.task(name).template).get("gpu") not in (None, "0"), f"{name}: no GPU request"
    for name in ("prepare_prompts", "fetch_base_weights"):
        md = package.task(name).template.metadata
        assert md.discoverable and md.discovery_version, f"{name}: not cached with a version"
    assert train.metadata.retries.retries >= 3, f"train retries={train.metadata.retries.retries}"
    assert train.metadata.interruptible, "train is not interruptible"

    problems = []
    for name in TASKS_WITH_SECRET:
        declared = {(s.group, s.key): s.env_var for s in package.task(name).template.security_context.secrets}
        if (SECRET_GROUP, SECRET_KEY) not in declared:
            problems.append(f"{name} declares no Secret(group={SECRET_GROUP!r}, key={SECRET_KEY!r}) "
                            f"(security_context.secrets={sorted(declared)})")
        elif declared[(SECRET_GROUP, SECRET_KEY)] != "HF_TOKEN":
            problems.append(f"{name}: the hf/token secret is not mounted as env_var HF_TOKEN")
    for name in TIMED_TASKS:
        md = package.task(name).template.metadata
        if not (md.HasField("timeout") and md.timeout.ToTimedelta().total_seconds() > 0):
            problems.append(f"{name} has no timeout")
    assert not problems, "; ".join(problems)
    env = {kv.key: kv.value for kv in package.task("start_run").template.container.env}
    assert env.get("MLFLOW_TRACKING_URI", "").startswith("http://127.0.0.1:"), env


# -- 2. the DAG ------------------------------------------------------------------------------------------------


def test_dag_completes(execution, token):
    _require_dag(execution)
    assert all(r.ok for r in execution.nodes.values())
    assert {r.task.split(".")[-1] for r in execution.nodes.values()} == {
        "resolve_config", "plan_resources", "start_run", "fingerprint_prompts", "prepare_prompts",
        "fetch_base_weights", "track_inputs", "sft", "train", "evaluate", "register", "report"}
    assert all(len(r.attempts) == 1 for r in execution.nodes.values()), "a node needed a retry"
    # The tasks ran the packaged code (the fast-registration tarball), not this checkout, and the
    # secret reaches flytekit's secrets manager in a pod.
    probe = execution.probe
    assert all(probe[m].startswith(probe["cwd"] + "/") for m in ("diffusionrl", "tasks.grpo", "workflows.grpo")), probe
    assert probe["secret_sha256"] == {f"{SECRET_GROUP}/{SECRET_KEY}": hashlib.sha256(token.encode()).hexdigest()}
    print(f"DAG: {execution.seconds:.0f} s; " + ", ".join(
        f"{r.task.split('.')[-1]} {r.final.seconds:.0f}s" for r in execution.nodes.values()))


def test_registry_has_the_version_with_its_lineage(execution, services, propeller):
    _require_dag(execution)
    from mlflow import MlflowClient

    from diffusionrl.tracking.runs import LINEAGE_KEYS

    registered = ch.msgpack_value(execution.outputs["registered"])
    client = MlflowClient(services["mlflow_url"], registry_uri=services["mlflow_url"])
    mv = client.get_model_version(registered["name"], registered["version"])
    tags = mv.tags or {}
    required = ("flyte_execution_id", "git_sha", "dataset_digest", "base_model_digest", "config_digest")
    assert set(required) <= set(LINEAGE_KEYS)
    missing = [k for k in required if not tags.get(k)]
    assert not missing, f"version {mv.version} lacks lineage tags {missing}: {tags}"
    assert tags["flyte_execution_id"] == f"{propeller.project}-{propeller.domain}-{execution.name}"
    prompts = execution.by_task("prepare_prompts").outputs.literals
    model = execution.by_task("fetch_base_weights").outputs.literals
    assert tags["dataset_digest"] == prompts["digest"].scalar.primitive.string_value
    assert tags["base_model_digest"] == model["digest"].scalar.primitive.string_value
    from diffusionrl.config import apply_overrides

    cfg = type(_config()).from_dict(apply_overrides(_config().to_dict(), RUN_OVERRIDES))
    assert tags["config_digest"] == cfg.digest()
    # The workflow run carries the same lineage.
    run = client.get_run(mv.run_id)
    assert run.data.tags.get("flyte_execution_id") == tags["flyte_execution_id"]
    # No pod has the repository: the commit travels in the tasks' environment from registration.
    assert tags["git_sha"] == _git("rev-parse", "HEAD")


def test_outputs_live_in_the_object_store(execution, services, propeller, tmp_path):
    """Every pod folder is gone (``execution`` deleted them): what later tasks and users need is in
    the object store."""
    _require_dag(execution)
    store = services["store"]
    assert propeller.workdirs and not any(d.exists() for d in propeller.workdirs)
    # Each node ran in its own folder.
    dirs = [a.workdir for r in execution.nodes.values() for a in r.attempts]
    assert len(set(dirs)) == len(dirs)
    out = execution.outputs
    for name in ("lora", "trajectories", "report"):
        uri = ch.literal_uri(out[name])
        assert uri.startswith(f"s3://{store.bucket}/"), f"{name} output is not in the object store: {uri}"
        assert store.exists(uri), f"{name} output {uri} does not exist"
    lora_keys = store.keys(ch.literal_uri(out["lora"]))
    assert any(k.endswith("adapter_model.safetensors") for k in lora_keys), lora_keys
    traj = sorted(k.rsplit("/", 1)[-1] for k in store.keys(ch.literal_uri(out["trajectories"])))
    assert traj == [f"step-{s:06d}.parquet" for s in range(1, STEPS + 1)], traj
    html = store.get(ch.literal_uri(out["report"])).decode()
    assert 'alt="training curve"' in html and "Held-out prompts: base | tuned" in html
    metrics = _read_parquet_folder(store, ch.literal_uri(out["metrics"]))
    assert metrics["step"].tolist() == list(range(1, STEPS + 1))
    # The registered model's artifacts are in the object store too (through the MLflow server).
    keys = store.keys(store.uri("mlflow"))
    assert any(k.endswith("adapter_model.safetensors") for k in keys), "no LoRA among the MLflow artifacts"
    assert any(k.endswith("report.html") for k in keys), "the report was not logged to MLflow"
    # Paths a task handed on that point into a (now deleted) pod folder.
    run_dir = execution.by_task("train").outputs.literals["run_dir"].scalar.primitive.string_value
    assert run_dir.startswith(f"s3://{store.bucket}/"), f"train's run folder is not in the object store: {run_dir}"
    assert any(k.endswith("checkpoints/LATEST") for k in store.keys(run_dir)), "no published checkpoint"
    # The warm start: the sft pod's LoRA lies in the object store, and the RL run's config names it.
    rl_config = json.loads(store.get(f"{run_dir}/config.json"))
    init_lora = rl_config["algorithm"]["init_lora"]
    assert init_lora.startswith(f"s3://{store.bucket}/") and init_lora.endswith("/sft/lora"), init_lora
    assert store.exists(f"{init_lora}/adapter_model.safetensors"), f"no SFT LoRA at {init_lora}"


def test_registered_model_references_only_shared_storage(execution, services, propeller):
    """The registered ``mlflow.diffusers`` model names its base model: a hub id or a location that
    outlives the register pod."""
    _require_dag(execution)
    import yaml
    from mlflow import MlflowClient

    store = services["store"]
    registered = ch.msgpack_value(execution.outputs["registered"])
    client = MlflowClient(services["mlflow_url"], registry_uri=services["mlflow_url"])
    mv = client.get_model_version(registered["name"], registered["version"])
    model_id = getattr(mv, "model_id", None) or ""
    mlmodels = [k for k in store.keys(store.uri("mlflow")) if k.endswith("/MLmodel") and model_id in k]
    assert mlmodels, f"no MLmodel of version {mv.version} ({mv.source}) in the object store"
    flavor = yaml.safe_load(store.get(f"s3://{store.bucket}/{mlmodels[0]}"))["flavors"]["diffusers"]
    base = str(flavor["base_model"])
    if base.startswith("/") and base.startswith(str(propeller.root)):
        # Known limit of the built-in CPU model only: it has no hub id, so the registered version names
        # the copy the register pod made (models.fetch.base_model_reference); a hub model records its id.
        pytest.xfail(f"the registered model's base_model is {base!r}, a folder on the register pod's disk: "
                     "builtin:tiny-sd3 has no hub id to record")
    assert not base.startswith("/") or Path(base).is_dir(), f"base_model {base!r} does not exist"


# -- 3. a retried train attempt ----------------------------------------------------------------------------------


def test_train_attempt_fails_retryably_and_the_retry_succeeds(retried):
    result = retried.result
    first = result.attempts[0]
    assert first.returncode != 0, "the injected fault did not fail the attempt"
    assert first.error is not None, f"attempt 0 wrote no error.pb\n{first.stderr_tail()}"
    assert _injected(first), f"attempt 0 did not fail with the injected fault: {first.failure()}"
    assert first.error.error.kind == 1, f"not RECOVERABLE: {first.failure()}"
    assert len(result.attempts) >= 2
    assert result.ok, f"the retried train node did not succeed: {result.final.error_summary()}"
    assert all(a.prefixes["prevCheckpointPrefix"] == p.prefixes["checkpointOutputPrefix"]
               for p, a in zip(result.attempts, result.attempts[1:]))
    seconds = [round(a.seconds) for a in result.attempts]
    print(f"train attempts: {seconds} s (checkpoint_dir={retried.checkpoint_dir!r})")


def _retried_ok(retried) -> ch.NodeResult:
    assert retried.result.ok, f"the retried train node did not succeed: {retried.result.final.error_summary()}"
    return retried.result


def test_retried_train_ends_with_the_same_lora(retried, execution, services, tmp_path):
    result = _retried_ok(retried)
    store = services["store"]
    a = _lora_tensors(store, ch.literal_uri(execution.by_task("train").outputs.literals["lora"]), tmp_path / "a")
    b = _lora_tensors(store, ch.literal_uri(result.outputs.literals["lora"]), tmp_path / "b")
    assert a.keys() == b.keys()
    differ = [k for k in a if not _bitwise_equal(a[k], b[k])]
    assert not differ, f"{len(differ)}/{len(a)} LoRA tensors differ after the retry (e.g. {differ[0]})"


def test_retried_train_has_complete_metrics(retried, services):
    result = _retried_ok(retried)
    metrics = _read_parquet_folder(services["store"], ch.literal_uri(result.outputs.literals["metrics"]))
    steps = metrics["step"].astype(int).tolist() if "step" in metrics else []
    assert steps == list(range(1, STEPS + 1)), f"the retried train's metrics have steps {steps}, not 1..{STEPS}"


def test_retried_train_has_one_trajectory_file_per_step(retried, services):
    result = _retried_ok(retried)
    store = services["store"]
    files = sorted(k.rsplit("/", 1)[-1] for k in store.keys(ch.literal_uri(result.outputs.literals["trajectories"])))
    expected = [f"step-{s:06d}.parquet" for s in range(1, STEPS + 1)]
    assert files == expected, f"the retried train's trajectories are {files}, not {expected}"


def test_checkpoint_dir_in_the_object_store_is_used(retried, services):
    s3 = retried.s3_result
    assert _injected(s3.attempts[0]), f"checkpoint_dir={retried.s3_checkpoint_dir!r}: {s3.attempts[0].failure()}"
    assert s3.ok, f"the retried train with checkpoint_dir={retried.s3_checkpoint_dir!r}: {s3.final.error_summary()}"
    store = services["store"]
    run_dir = s3.outputs.literals["run_dir"].scalar.primitive.string_value
    assert run_dir == retried.s3_checkpoint_dir.rstrip("/")
    keys = store.keys(retried.s3_checkpoint_dir)
    assert any(k.endswith("checkpoints/LATEST") for k in keys) and any(k.endswith("metrics.jsonl") for k in keys)


# -- 4. the secret --------------------------------------------------------------------------------------------


def test_secret_value_appears_nowhere(execution, retried, services, propeller, token):
    """Not in the object store (every object), the MLflow database, the MLflow server's or Ray's
    logs, nor any task's stdout/stderr."""
    needle = token.encode()
    assert propeller.logs, "no task ran"
    found = []
    for key, data in services["store"].all_objects():
        if needle in data:
            found.append(f"object s3://{services['store'].bucket}/{key}")
    db = services["mlflow_db"]
    for f in [db, *db.parent.glob("mlflow.db-*")]:
        if f.is_file() and needle in f.read_bytes():
            found.append(f"MLflow database {f}")
    for log in propeller.logs:
        if log.is_file() and needle in log.read_bytes():
            found.append(f"task log {log.name}")
    for svc in services["services"]:
        if needle in svc.log.read_bytes():
            found.append(f"{svc.name} log")
    for d in services["ray_dirs"]:
        for f in d.rglob("*"):
            if f.is_file() and not f.is_symlink() and f.stat().st_size < 50 * 2**20:
                try:
                    if needle in f.read_bytes():
                        found.append(f"Ray file {f.relative_to(d)}")
                except OSError:
                    pass
    assert not found, f"the secret value leaked into: {found}"
