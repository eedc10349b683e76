"""A cluster-shaped harness for ``tests/test_cluster.py``: the serialized workflow run task by task.

What a Flyte cluster gives a task, and nothing more, each piece a real separate process on this
machine:

- an S3-compatible object store (``moto_server``) with one bucket: inputs, outputs, raw data,
  Flyte checkpoints and the fast-registration code tarball all live there;
- an MLflow tracking server (SQLite backend) whose artifacts live in that object store;
- a Ray cluster of two node processes (a head and a ``reward-cpu`` node) that the Ray task joins
  through ``RAY_ADDRESS``;
- ``MiniPropeller``: reads the ``TaskSpec``/``WorkflowSpec`` protobufs of ``pyflyte package
  --fast``, walks the workflow's nodes in dependency order, writes each node's ``inputs.pb`` to
  the object store, runs the template's ``container.args`` (``pyflyte-fast-execute ... --
  pyflyte-execute ...``) with Flyte's placeholders filled in, in a fresh process with its own
  HOME, working directory (the pod's ``/root``) and TMPDIR, and reads ``outputs.pb``/``error.pb``
  back. Retryable failures are retried like propeller does: a new attempt whose
  ``{{.prevCheckpointPrefix}}`` is the failed attempt's ``{{.checkpointOutputPrefix}}``.

Secrets reach a task the way Flyte's secret webhook delivers them: ``_FSEC_<GROUP>_<KEY>``, a
file under the secrets directory, and the ``env_var`` a ``Secret`` declares.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VENV_BIN = Path(sys.executable).parent
PLACEHOLDER = re.compile(r"\{\{\s*\.(\w+)\s*\}\}")
START_NODE = ""  # flytekit's GLOBAL_INPUT_NODE_ID: bindings to workflow inputs (propeller's start-node)
ACCESS_KEY, SECRET_KEY, REGION = "ctest-access", "ctest-secret-key", "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(home: Path, tmp: Path, **extra: str) -> dict[str, str]:
    """A clean environment: nothing of this test process leaks in (no PYTHONPATH, no MLflow URI)."""
    home.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": f"{VENV_BIN}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray >= 2.5x enables token auth for `ray start`; a KubeRay cluster without auth is the model
        # (its nodes listen on loopback only here: RAY_START).
        "RAY_AUTH_MODE": "disabled",
        # A driver joining 127.0.0.1:port keeps that address: Ray maps loopback to the host's
        # reachable address unless multi-node clusters are off (see RAY_START), and the nodes listen
        # on loopback only.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


# -- processes ---------------------------------------------------------------------------------------------


@dataclass
class Service:
    """A background process in its own session (so that stopping it stops what it spawned)."""

    name: str
    proc: subprocess.Popen
    log: Path
    marker: str = ""  # a string in the command line of every process it spawns (ray: its temp dir)
    term_wait: float = 10.0  # seconds between SIGTERM and SIGKILL

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, self.term_wait), (signal.SIGKILL, 5)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            with contextlib.suppress(ProcessLookupError):  # the leader is gone: so is the rest of its group
                os.killpg(pgid, signal.SIGKILL)
            break
        if self.marker:  # e.g. Ray workers that left the group: found by their temp dir, killed by pid
            for pid in pids_with_marker(self.marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def pids_with_marker(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            out.append(int(d.name))
    return out


def spawn(name: str, cmd: list[str], env: dict[str, str], cwd: Path, log: Path, marker: str = "") -> Service:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return Service(name, proc, log, marker)


def wait_until(what: str, ok: Callable[[], bool], timeout: float, services: Iterable[Service] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for s in services:
            if not s.alive():
                raise RuntimeError(f"{s.name} exited ({s.proc.returncode}) while waiting for {what}:\n{s.tail()}")
        try:
            if ok():
                return
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        time.sleep(0.5)
    tails = "\n".join(f"--- {s.name}\n{s.tail()}" for s in services)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s\n{tails}")


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


# -- the object store -----------------------------------------------------------------------------------------


@dataclass
class ObjectStore:
    endpoint: str
    bucket: str

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def uri(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *(p.strip("/") for p in parts)])

    @staticmethod
    def split(uri: str) -> tuple[str, str]:
        assert uri.startswith("s3://"), uri
        bucket, _, key = uri[len("s3://"):].partition("/")
        return bucket, key

    def put(self, uri: str, data: bytes) -> None:
        b, k = self.split(uri)
        self.client().put_object(Bucket=b, Key=k, Body=data)

    def get(self, uri: str) -> bytes | None:
        b, k = self.split(uri)
        try:
            return self.client().get_object(Bucket=b, Key=k)["Body"].read()
        except self.client().exceptions.NoSuchKey:
            return None

    def keys(self, prefix_uri: str) -> list[str]:
        """Every key under ``prefix_uri`` (a folder: a trailing slash is added)."""
        b, k = self.split(prefix_uri)
        if k and not k.endswith("/"):
            k += "/"
        out, token = [], None
        c = self.client()
        while True:
            kw = {"Bucket": b, "Prefix": k, **({"ContinuationToken": token} if token else {})}
            page = c.list_objects_v2(**kw)
            out += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def exists(self, uri: str) -> bool:
        """An object, or a folder holding at least one object."""
        b, k = self.split(uri)
        c = self.client()
        try:
            c.head_object(Bucket=b, Key=k)
            return True
        except Exception:  # noqa: BLE001 - not an object: maybe a folder
            return bool(self.keys(uri))

    def all_objects(self) -> Iterator[tuple[str, bytes]]:
        c = self.client()
        for key in self.keys(f"s3://{self.bucket}"):
            yield key, c.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def download_folder(self, uri: str, dest: Path) -> Path:
        b, k = self.split(uri)
        k = k.rstrip("/") + "/"
        c = self.client()
        for key in self.keys(uri):
            target = dest / key[len(k):]
            target.parent.mkdir(parents=True, exist_ok=True)
            c.download_file(b, key, str(target))
        return dest


def start_object_store(root: Path, started: list[Service]) -> ObjectStore:
    """``moto_server`` on loopback with one bucket (appended to ``started`` as soon as it runs)."""
    port = free_port()
    env = base_env(root / "home", root / "tmp")
    svc = spawn("moto_server", [str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], env, root,
                root / "moto.log")
    started.append(svc)
    store = ObjectStore(f"http://127.0.0.1:{port}", "ctest")
    wait_until("moto_server", lambda: http_ok(f"{store.endpoint}/moto-api/"), 60, [svc])
    store.client().create_bucket(Bucket=store.bucket)
    return store


def s3_env(store: ObjectStore) -> dict[str, str]:
    """What flytekit (fsspec/s3fs) and MLflow need to reach the store."""
    return {
        "FLYTE_AWS_ENDPOINT": store.endpoint,
        "FLYTE_AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "FLYTE_AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": store.endpoint,
        "MLFLOW_S3_ENDPOINT_URL": store.endpoint,
    }


# -- MLflow and Ray -------------------------------------------------------------------------------------------


def start_mlflow(root: Path, store: ObjectStore, started: list[Service]) -> tuple[str, Path, Service]:
    """``mlflow server`` (SQLite backend, artifacts in the object store); not waited for."""
    port = free_port()
    db = root / "mlflow.db"
    env = base_env(root / "home", root / "tmp", **s3_env(store))
    cmd = [str(VENV_BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{db}",
           "--artifacts-destination", store.uri("mlflow"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    svc = spawn("mlflow server", cmd, env, root, root / "mlflow.log")
    started.append(svc)
    return f"http://127.0.0.1:{port}", db, svc


def wait_mlflow(url: str, svc: Service) -> None:
    wait_until("mlflow server /health", lambda: http_ok(f"{url}/health"), 120, [svc])


# `ray start`, but every node of this one-host cluster listens on 127.0.0.1 only (with
# --node-ip-address 127.0.0.1): Ray replaces a loopback node or GCS address with the host's reachable
# one for multi-node clusters (ray._private.services.resolve_ip_for_localhost), which would make each
# server listen on every interface. Ray's own multi-node tests run their nodes on 127.0.0.1 too
# (ray.cluster_utils.Cluster); multi-node is switched back on here, base_env switches it off for drivers.
RAY_START = """
import sys
from ray._private import ray_constants, services
services.resolve_ip_for_localhost = lambda host: host
ray_constants.ENABLE_RAY_CLUSTER = True
from ray.scripts.scripts import main
sys.argv[0] = "ray"
sys.exit(main())
"""

RAY_CHECK = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
print(json.dumps({"nodes": len(alive), "resources": ray.cluster_resources()}))
"""


def start_ray(root: Path, started: list[Service]) -> str:
    """A head (2 CPUs) and a second node process (1 CPU + ``reward-cpu``), each with its own temp
    dir, every server on loopback (``RAY_START``); returns the head's address, 127.0.0.1:port."""
    port = free_port()
    ray = [sys.executable, "-c", RAY_START]
    common = ["--block", "--num-cpus", "{cpus}", "--disable-usage-stats", "--object-store-memory", str(200 * 2**20),
              "--dashboard-agent-listen-port", "{agent}", "--temp-dir", "{temp}", "--node-ip-address", "127.0.0.1"]
    services = []
    for name, extra, cpus in (
        ("ray head", ["--head", "--port", str(port), "--include-dashboard=false",
                      "--ray-client-server-port", str(free_port())], 2),
        ("ray node reward-cpu", ["--address", f"127.0.0.1:{port}", "--resources", '{"reward-cpu": 1}'], 1),
    ):
        d = root / ("h" if name == "ray head" else "w")
        temp = d / "t"  # short: Ray's socket paths must fit in 107 bytes
        temp.mkdir(parents=True)
        args = [a.format(cpus=cpus, agent=free_port(), temp=temp) for a in common]
        env = base_env(d / "home", d / "tmp", HF_HUB_OFFLINE="1")
        svc = spawn(name, [*ray, "start", *extra, *args], env, d, d / "ray.log", marker=str(temp))
        svc.term_wait = 3  # `ray start --block` does not always exit on SIGTERM
        services.append(svc)
        started.append(svc)
        wait_until(name, lambda svc=svc: "Ray runtime started" in svc.tail(100_000), 120, services)
    address = f"127.0.0.1:{port}"
    check_env = base_env(root / "check" / "home", root / "check" / "tmp")

    def two_nodes() -> bool:
        out = subprocess.run([sys.executable, "-c", RAY_CHECK, address], env=check_env, capture_output=True,
                             text=True, timeout=60, check=False)
        return out.returncode == 0 and '"nodes": 2' in out.stdout and "reward-cpu" in out.stdout

    wait_until("a 2-node Ray cluster", two_nodes, 120, services)
    return address


# -- the package ----------------------------------------------------------------------------------------------


@dataclass
class Package:
    archive: Path
    folder: Path
    tasks: dict  # task name -> flyteidl.admin.task_pb2.TaskSpec
    workflows: dict  # workflow name -> flyteidl.admin.workflow_pb2.WorkflowSpec
    fast_tarball: Path | None
    log: str

    def task(self, short: str):
        return self.tasks[f"tasks.grpo.{short}"]


def build_package(repo: Path, out: Path, **registration_env: str) -> Package:
    """``make package``'s command (``pyflyte --pkgs workflows --pkgs tasks package --copy all``, offline
    image names), with ``registration_env`` set as a registering user would (e.g. the MLflow URI that
    every task's environment then carries), extracted and parsed."""
    from flyteidl.admin import task_pb2, workflow_pb2

    out.mkdir(parents=True, exist_ok=True)
    archive = out / "pkg.tgz"
    env = base_env(out / "home", out / "tmp", PYTHONPATH=str(repo), DIFFUSIONRL_IMAGES_OFFLINE="1",
                   **registration_env)
    cmd = [str(VENV_BIN / "pyflyte"), "--pkgs", "workflows", "--pkgs", "tasks", "package", "--copy", "all",
           "--force", "--output", str(archive)]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"pyflyte package failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    folder = out / "pkg"
    folder.mkdir()
    with tarfile.open(archive) as tf:
        tf.extractall(folder, filter="data")
    tasks, workflows = {}, {}
    for f in sorted(folder.glob("*.pb")):
        if f.stem.endswith("_1"):
            spec = task_pb2.TaskSpec()
            spec.ParseFromString(f.read_bytes())
            tasks[spec.template.id.name] = spec
        elif f.stem.endswith("_2"):
            spec = workflow_pb2.WorkflowSpec()
            spec.ParseFromString(f.read_bytes())
            workflows[spec.template.id.name] = spec
    fast = next(iter(folder.glob("fast*.tar.gz")), None)
    return Package(archive, folder, tasks, workflows, fast, proc.stdout + proc.stderr)


# -- literals ---------------------------------------------------------------------------------------------------


def to_literal(value: Any, python_type: Any, literal_type_pb) -> Any:
    """A Python value as a ``flyteidl.core.literals_pb2.Literal`` (flytekit's TypeEngine)."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.types import LiteralType

    ctx = FlyteContextManager.current_context()
    lt = LiteralType.from_flyte_idl(literal_type_pb)
    return TypeEngine.to_literal(ctx, value, python_type, lt).to_flyte_idl()


def resolve_attr_path(literal, attr_path) -> Any:
    """A promise's attribute path (``cfg.data``, ``prompts.digest``) applied to a literal, as
    propeller does: into maps/collections, then into a msgpack (dataclass) or Struct scalar."""
    import msgpack
    from flyteidl.core import literals_pb2
    from google.protobuf import json_format, struct_pb2

    path = [a.string_value if a.WhichOneof("value") == "string_value" else a.int_value for a in attr_path]
    cur, used = literal, 0
    for attr in path:
        kind = cur.WhichOneof("value")
        if kind == "map":
            cur = cur.map.literals[attr]
        elif kind == "collection":
            cur = cur.collection.literals[attr]
        else:
            break
        used += 1
    rest = path[used:]
    if not rest:
        return cur
    scalar = cur.scalar
    if scalar.WhichOneof("value") == "binary" and scalar.binary.tag == "msgpack":
        obj = msgpack.loads(scalar.binary.value, strict_map_key=False)
        for attr in rest:
            obj = obj[attr]
        return literals_pb2.Literal(scalar=literals_pb2.Scalar(
            binary=literals_pb2.Binary(value=msgpack.dumps(obj), tag="msgpack")))
    if scalar.WhichOneof("value") == "generic":
        obj = json_format.MessageToDict(scalar.generic)
        for attr in rest:
            obj = obj[attr]
        st = struct_pb2.Struct()
        st.update(obj if isinstance(obj, dict) else {"value": obj})
        return literals_pb2.Literal(scalar=literals_pb2.Scalar(generic=st))
    raise ValueError(f"cannot resolve attribute path {path} in {cur}")


def msgpack_value(literal) -> Any:
    import msgpack

    return msgpack.loads(literal.scalar.binary.value, strict_map_key=False)


def literal_uri(literal) -> str:
    """The object-store location a blob (file/directory) or structured dataset literal points at."""
    s = literal.scalar
    kind = s.WhichOneof("value")
    if kind == "blob":
        return s.blob.uri
    if kind == "structured_dataset":
        return s.structured_dataset.uri
    raise ValueError(f"not an offloaded literal: {kind}")


# -- the mini propeller -----------------------------------------------------------------------------------------


@dataclass
class Attempt:
    node: str
    task: str
    attempt: int
    returncode: int
    seconds: float
    workdir: Path  # the attempt's own HOME, working directory and TMPDIR live under it
    log_out: Path
    log_err: Path
    prefixes: dict[str, str]
    outputs: Any = None  # flyteidl LiteralMap
    error: Any = None  # flyteidl ErrorDocument

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.outputs is not None

    def stderr_tail(self, n: int = 4000) -> str:
        return self.log_err.read_text(errors="replace")[-n:]

    def error_summary(self) -> str:
        """The error's last line and the innermost frame of the task's own (packaged) code."""
        if self.error is None:
            return f"exit {self.returncode}, no error.pb; stderr: {self.stderr_tail(600)}"
        msg = self.error.error.message
        lines = [x.strip() for x in msg.splitlines() if x.strip()]
        last = lines[-1] if lines else ""
        own = [x for x in lines if x.startswith("File ") and str(self.workdir / "root") in x]
        where = own[-1].replace(str(self.workdir / "root") + "/", "") if own else ""
        return f"{self.error.error.code}: {last}" + (f" (at {where})" if where else "")

    def failure(self) -> str:
        err = ""
        if self.error is not None:
            e = self.error.error
            err = f"error.pb: kind={e.kind} ({'RECOVERABLE' if e.kind == 1 else 'NON_RECOVERABLE'}) " \
                  f"code={e.code} message={e.message[-2000:]}\n"
        return f"node {self.node} ({self.task}) attempt {self.attempt} exited {self.returncode}\n{err}" \
               f"--- stderr tail:\n{self.stderr_tail()}"


@dataclass
class NodeResult:
    node: str
    task: str
    inputs: Any  # flyteidl LiteralMap
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.final.ok

    @property
    def outputs(self):
        return self.final.outputs


@dataclass
class Execution:
    name: str
    nodes: dict[str, NodeResult] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)  # workflow output name -> flyteidl Literal
    failed: NodeResult | None = None
    seconds: float = 0.0
    probe: dict[str, Any] = field(default_factory=dict)  # see MiniPropeller.probe
    side: dict[str, Any] = field(default_factory=dict)  # what ran alongside (results or exceptions)

    def by_task(self, short: str) -> NodeResult:
        return next(r for r in self.nodes.values() if r.task.endswith("." + short))


class MiniPropeller:
    """Runs serialized tasks the way propeller + a pod do (see the module docstring)."""

    project, domain = "diffusionrl", "development"

    def __init__(self, package: Package, store: ObjectStore, root: Path, env: dict[str, str],
                 secrets: dict[tuple[str, str], str], version: str, max_parallel: int = 2):
        self.package, self.store, self.root = package, store, root
        self.env, self.secrets, self.version, self.max_parallel = env, secrets, version, max_parallel
        self.fast_uri = ""
        if package.fast_tarball is not None:  # what `pyflyte register` uploads and templates in
            self.fast_uri = store.uri("fast", package.fast_tarball.name)
            store.put(self.fast_uri, package.fast_tarball.read_bytes())
        self.logs: list[Path] = []
        self.workdirs: list[Path] = []

    # -- one attempt of one node --------------------------------------------------------------------------
    def run_task(self, execution: str, node_id: str, task_name: str, inputs, attempt: int = 0,
                 prev_checkpoint: str = "", extra_env: dict[str, str] | None = None,
                 timeout: float = 600) -> Attempt:
        from flyteidl.core import errors_pb2, literals_pb2

        spec = self.package.tasks[task_name]
        tmpl = spec.template
        meta = f"metadata/{execution}/{node_id}/{attempt}"
        prefixes = {
            "input": self.store.uri(meta, "inputs.pb"),
            "outputPrefix": self.store.uri(meta),
            "rawOutputDataPrefix": self.store.uri("raw", execution, node_id, str(attempt)),
            "checkpointOutputPrefix": self.store.uri("raw", execution, node_id, str(attempt), "_flytecheckpoints"),
            "prevCheckpointPrefix": prev_checkpoint,
            "remote_package_path": self.fast_uri,
        }
        self.store.put(prefixes["input"], inputs.SerializeToString())
        work = self.root / execution / f"{node_id}-{task_name.rsplit('.', 1)[-1]}-a{attempt}"
        cwd = work / "root"
        cwd.mkdir(parents=True)
        self.workdirs.append(work)
        args = []
        for a in tmpl.container.args:
            missing = [m for m in PLACEHOLDER.findall(a) if m not in prefixes]
            assert not missing, f"unknown placeholder(s) {missing} in {a!r}"
            args.append(PLACEHOLDER.sub(lambda m: prefixes[m.group(1)], a))
        # The pod's working directory (/root in the image) is this attempt's fresh folder.
        args = [str(cwd) if a == "/root" and i and args[i - 1] == "--dest-dir" else a for i, a in enumerate(args)]
        env = self.pod_env(work, tmpl, execution, node_id, task_name, attempt)
        env.update(extra_env or {})
        out, err = work.with_suffix(".stdout"), work.with_suffix(".stderr")
        self.logs += [out, err]
        t0 = time.monotonic()
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=fo, stderr=fe, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:  # the pod's whole process group, as the kubelet would
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                fe.write(f"\n[harness] killed after {timeout} s\n".encode())
        result = Attempt(node_id, task_name, attempt, rc, time.monotonic() - t0, work, out, err, prefixes)
        raw = self.store.get(self.store.uri(meta, "outputs.pb"))
        if raw is not None and rc == 0:
            result.outputs = literals_pb2.LiteralMap()
            result.outputs.ParseFromString(raw)
        raw = self.store.get(self.store.uri(meta, "error.pb"))
        if raw is not None:
            result.error = errors_pb2.ErrorDocument()
            result.error.ParseFromString(raw)
        return result

    def pod_env(self, work: Path, tmpl, execution: str, node_id: str, task_name: str, attempt: int) -> dict[str, str]:
        """What a pod's container gets: the services' addresses, propeller's variables, the secrets."""
        env = base_env(work / "home", work / "tmp", **self.env)
        env.update({
            "FLYTE_INTERNAL_EXECUTION_PROJECT": self.project,
            "FLYTE_INTERNAL_EXECUTION_DOMAIN": self.domain,
            "FLYTE_INTERNAL_EXECUTION_ID": execution,
            "FLYTE_INTERNAL_EXECUTION_WORKFLOW": f"{self.project}:{self.domain}:workflows.grpo.grpo",
            "FLYTE_INTERNAL_EXECUTION_LAUNCHPLAN": "workflows.grpo.grpo",
            "FLYTE_INTERNAL_TASK_PROJECT": self.project,
            "FLYTE_INTERNAL_TASK_DOMAIN": self.domain,
            "FLYTE_INTERNAL_TASK_NAME": task_name,
            "FLYTE_INTERNAL_TASK_VERSION": self.version,
            "FLYTE_INTERNAL_NODE_ID": node_id,
            "FLYTE_ATTEMPT_NUMBER": str(attempt),
            "FLYTE_FAIL_ON_ERROR": "true",  # set by propeller: a task that wrote error.pb exits 1
            # A pod has no view of the developer's repository (the fast tarball of a git worktree
            # carries a `.git` file pointing at the host's repository: keep git from following it).
            "GIT_DIR": str(work / "no-git-repository"),
            "GIT_CEILING_DIRECTORIES": str(self.root),
        })
        env.update({kv.key: kv.value for kv in tmpl.container.env})  # the task's own `environment=`
        env.update(self.secret_env(tmpl, work / "secrets"))
        return env

    def secret_env(self, tmpl, secrets_dir: Path) -> dict[str, str]:
        """Every secret of the harness, as the webhook mounts it (env var and file) for every task,
        plus the ``env_var`` a task's template declares for it."""
        env = {}
        declared = {(s.group, s.key): s for s in tmpl.security_context.secrets}
        for (group, key), value in self.secrets.items():
            env[f"_FSEC_{group.upper()}_{key.upper()}"] = value  # flytekit's SecretsManager env prefix
            f = secrets_dir / group / key
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(value)
            s = declared.get((group, key))
            if s is not None and s.env_var:
                env[s.env_var] = value
        env["FLYTE_SECRETS_DEFAULT_DIR"] = str(secrets_dir)  # files: <dir>/<group>/<key>
        return env

    def run_node(self, execution: str, node_id: str, task_name: str, inputs, prev_checkpoint: str = "",
                 extra_env: dict[str, str] | None = None) -> NodeResult:
        """A node with propeller's retry policy: a RECOVERABLE error gets a new attempt (up to the
        template's ``retries``) that starts from the failed attempt's checkpoint."""
        spec = self.package.tasks[task_name]
        retries = spec.template.metadata.retries.retries
        result = NodeResult(node_id, task_name, inputs)
        for attempt in range(retries + 1):
            a = self.run_task(execution, node_id, task_name, inputs, attempt, prev_checkpoint, extra_env)
            result.attempts.append(a)
            if a.ok or a.error is None or a.error.error.kind != 1:  # 1: RECOVERABLE
                break
            prev_checkpoint = a.prefixes["checkpointOutputPrefix"]
        return result

    # -- a whole workflow ---------------------------------------------------------------------------------------
    def run_workflow(self, workflow: str, inputs: dict[str, Any], execution: str | None = None,
                     skip: Iterable[str] = (), on_node_done: Callable[[Execution, NodeResult], None] | None = None,
                     ) -> Execution:
        """``inputs``: workflow input name -> flyteidl Literal. Nodes whose upstream nodes all
        succeeded run, at most ``max_parallel`` at once; a failed node stops the execution.
        ``on_node_done(execution, node_result)`` is called (in this thread) as each node ends."""
        from flyteidl.core import literals_pb2

        spec = self.package.workflows[workflow]
        tmpl = spec.template
        ex = Execution(execution or f"ctest{uuid.uuid4().hex[:12]}")
        t0 = time.monotonic()
        nodes = {n.id: n for n in tmpl.nodes if n.id not in skip and n.id not in ("start-node", "end-node", START_NODE)}
        if tmpl.HasField("failure_node"):
            nodes.pop(tmpl.failure_node.id, None)  # on_failure handler: not part of this run
        deps = {nid: self._node_deps(n) - {START_NODE, "start-node"} for nid, n in nodes.items()}
        outputs: dict[str, Any] = {START_NODE: literals_pb2.LiteralMap(literals=inputs)}
        done: set[str] = set()
        running: dict[concurrent.futures.Future, str] = {}
        with concurrent.futures.ThreadPoolExecutor(self.max_parallel) as pool:
            while True:
                if ex.failed is None:
                    for nid, node in nodes.items():
                        if nid in done or nid in running.values() or len(running) >= self.max_parallel:
                            continue
                        if deps[nid] <= done:
                            run_id, task_node = nid, node
                            if node.HasField("branch_node"):  # propeller evaluates the condition, runs one case
                                task_node = self.branch_case(node, outputs)
                                run_id = f"{nid}-{task_node.id}"
                            task_name = task_node.task_node.reference_id.name
                            node_inputs = literals_pb2.LiteralMap(
                                literals={b.var: self.resolve(b.binding, outputs) for b in task_node.inputs})
                            running[pool.submit(self.run_node, ex.name, run_id, task_name, node_inputs)] = nid
                if not running:
                    break
                finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in finished:
                    nid = running.pop(fut)
                    res = fut.result()
                    ex.nodes[nid] = res
                    if on_node_done is not None:
                        on_node_done(ex, res)
                    if res.ok:
                        outputs[nid] = res.outputs
                        done.add(nid)
                    elif ex.failed is None:
                        ex.failed = res
        if ex.failed is None and done != set(nodes):
            blocked = {n: sorted(deps[n] - done) for n in nodes if n not in done}
            raise RuntimeError(f"nodes never became ready (waiting on): {blocked}; ran: {sorted(ex.nodes)}")
        if ex.failed is None:
            ex.outputs = {b.var: self.resolve(b.binding, outputs) for b in tmpl.outputs}
        ex.seconds = time.monotonic() - t0
        return ex

    def _node_deps(self, node) -> set[str]:
        """The outer nodes a node waits for; for a branch node, those of every case it may run."""
        deps = set(node.upstream_node_ids) | self._binding_nodes(node.inputs)
        if node.HasField("branch_node"):
            ie = node.branch_node.if_else
            for case in [ie.case.then_node, *(c.then_node for c in ie.other), ie.else_node]:
                if case.id:
                    deps |= self._node_deps(case)
        return deps

    def branch_case(self, node, outputs: dict[str, Any]):
        """The case node a branch node runs: the first whose condition holds on the branch's inputs."""
        ie = node.branch_node.if_else
        values = {b.var: self.resolve(b.binding, outputs) for b in node.inputs}
        for case in [ie.case, *ie.other]:
            if self._holds(case.condition, values):
                return case.then_node
        if not ie.else_node.id:
            raise RuntimeError(f"branch node {node.id}: no case holds and there is no else")
        return ie.else_node

    def _holds(self, expr, values: dict[str, Any]) -> bool:
        import operator

        if expr.HasField("conjunction"):
            c = expr.conjunction
            left, right = self._holds(c.left_expression, values), self._holds(c.right_expression, values)
            return (left and right) if c.operator == 0 else (left or right)  # 0: AND, 1: OR
        cmp = expr.comparison

        def value(operand):
            if operand.HasField("var"):
                prim = values[operand.var].scalar.primitive
            else:
                prim = operand.primitive
            return getattr(prim, prim.WhichOneof("value"))

        ops = [operator.eq, operator.ne, operator.gt, operator.ge, operator.lt, operator.le]  # EQ NEQ GT GTE LT LTE
        return bool(ops[cmp.operator](value(cmp.left_value), value(cmp.right_value)))

    @staticmethod
    def _binding_nodes(bindings) -> set[str]:
        out: set[str] = set()

        def walk(bd):
            kind = bd.WhichOneof("value")
            if kind == "promise":
                out.add(bd.promise.node_id)
            elif kind == "collection":
                for b in bd.collection.bindings:
                    walk(b)
            elif kind == "map":
                for b in bd.map.bindings.values():
                    walk(b)

        for b in bindings:
            walk(b.binding)
        return out

    def resolve(self, bd, outputs: dict[str, Any]):
        from flyteidl.core import literals_pb2

        kind = bd.WhichOneof("value")
        if kind == "scalar":
            return literals_pb2.Literal(scalar=bd.scalar)
        if kind == "collection":
            return literals_pb2.Literal(collection=literals_pb2.LiteralCollection(
                literals=[self.resolve(b, outputs) for b in bd.collection.bindings]))
        if kind == "map":
            return literals_pb2.Literal(map=literals_pb2.LiteralMap(
                literals={k: self.resolve(b, outputs) for k, b in bd.map.bindings.items()}))
        if kind == "promise":
            p = bd.promise
            lit = outputs[START_NODE if p.node_id == "start-node" else p.node_id].literals[p.var]
            return resolve_attr_path(lit, p.attr_path) if len(p.attr_path) else lit
        raise ValueError(f"unsupported binding {kind}")

    PROBE = """
import hashlib, importlib, json, sys
from flytekit.core.context_manager import SecretsManager
out = {m: importlib.import_module(m).__file__ for m in sys.argv[1].split(",")}
out["secret_sha256"] = {f"{g}/{k}": hashlib.sha256(SecretsManager().get(g, k).encode()).hexdigest()
                        for g, k in (s.split("/") for s in sys.argv[2].split(",") if s)}
print(json.dumps(out))
"""

    def probe(self, modules: Iterable[str], task_name: str) -> dict[str, Any]:
        """What a pod of ``task_name`` sees, without running the task: where ``modules`` import from
        (``pyflyte-fast-execute`` with the code tarball into a fresh folder, then a Python in the
        task's environment) and the SHA-256 of each secret flytekit's SecretsManager reads."""
        work = self.root / "probe"
        cwd = work / "root"
        cwd.mkdir(parents=True)
        self.workdirs.append(work)
        env = self.pod_env(work, self.package.tasks[task_name].template, "probe", "probe", task_name, 0)
        secrets = ",".join(f"{g}/{k}" for g, k in self.secrets)
        out = subprocess.run(["pyflyte-fast-execute", "--additional-distribution", self.fast_uri, "--dest-dir",
                              str(cwd), "--", "python", "-c", self.PROBE, ",".join(modules), secrets],
                             cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
        self.logs.append(work.with_suffix(".log"))
        self.logs[-1].write_text(out.stdout + out.stderr)
        assert out.returncode == 0, out.stderr[-3000:]
        import json

        return {"cwd": str(cwd), **json.loads(out.stdout.strip().splitlines()[-1])}

    def remove_workdirs(self) -> None:
        """What a cluster does to a finished pod's disk."""
        for d in self.workdirs:
            shutil.rmtree(d, ignore_errors=True)
