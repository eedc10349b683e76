"""The SGLang rollout engine: rollouts from SGLang's diffusion runtime (``sglang.multimodal_gen``).

The engine launches and owns one ``sglang serve`` process (its own interpreter, normally the
repo's ``.venv-sglang``: sglang pins torch/transformers/diffusers versions that differ from ours),
waits for ``/health``, and talks to it over HTTP:

- ``generate`` sends one ``POST /rollout/generate`` per sample (one output per request: the
  sample's own seed, its own SDE step set, and no exposure to the upstream report of several
  outputs of one request collapsing to output 0's trajectory). The server computes the per-step
  log-probs itself; the response's DiT trajectory (latents ``[T+1, C, h, w]``, the scheduler's
  ``sigmas`` snapshot ``[T+1]``, ``timesteps``) and denoising env (the DiT's text conditioning)
  become our ``Trajectory``, so the trainer recomputes exactly what the server sampled.
- ``update_weights`` pushes the trainer's LoRA as merged weights ``W0 + scale * B @ A`` of the
  touched layers (``W0``: the base weights the engine was started with) through
  ``POST /update_weights_from_tensor``: by value (pickled CPU tensors, base64) on CPU and across
  hosts, CUDA IPC handles in per-dtype flattened buckets when the trainer is on a GPU (colocated).
  Every push carries a weight version; ``verify_weights`` checks each pushed tensor's SHA-256
  on the server (``/update_weights_from_tensor_checker``), because the server skips unknown
  names with only a warning.
- A server that dies (or stops answering) is restarted, the last weights re-pushed and the
  batch (or push) retried, up to ``max_restarts`` times per engine.

Mapping of our contract to SGLang's (sglang 0.5.23, SD3):
- seeds: request ``seed`` with ``generator_device="cpu"``; same seed -> bitwise-same sample.
  SGLang's noise stream differs from the local engine's, so the two engines give different
  samples for one seed (each is reproducible).
- step strategies: our per-sample ``sde_mask`` row -> ``rollout_sde_step_indices`` (steps not
  listed are ODE steps whose log-prob the server reports as 0, as ours). An ODE spec (NFT
  rollouts) is ``sde`` with no SDE step, so no log-prob assertion trips on the server.
- ``sde`` log-probs are full Gaussian log-densities averaged over elements (ours); ``cps`` asks for
  ``rollout_log_prob_no_const`` (ours drops the constants there too).
- sigmas/timesteps: the server's own post-shift ``sigmas`` snapshot is kept as is (recomputing it
  from timesteps drifts ~3e-5 in log-prob); its timesteps carry a terminal 0, dropped (``[:T]``).
- conditioning: ``pos_cond_kwargs`` / ``neg_cond_kwargs`` (``encoder_hidden_states``,
  ``pooled_projections``) -> ``Conditioning``. SGLang encodes SD3 prompts with its own lengths
  (CLIP 77 + T5 256 tokens); a request's ``max_sequence_length`` would also cut CLIP and is not
  applied to the negative prompt in 0.5.23, so the engine does not send it: its conditioning has
  333 tokens where the local engine's has ``77 + model.max_sequence_length``.
- images: ``generated_output`` (float ``[3, H, W]`` in [0, 1]) -> uint8 ``[H, W, 3]``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import logging
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diffusionrl.trajectory import Conditioning, Trajectory

from .base import SamplingSpec
from .local import _as_long

log = logging.getLogger(__name__)

# SGLang picks its native SD3 pipeline by model id; any other id falls back to its diffusers
# backend, whose /rollout/generate fails.
SD3_MODEL_ID = "stable-diffusion-3-medium-diffusers"
PRECISIONS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
SGLANG_PYTHON_ENV = "DIFFUSIONRL_SGLANG_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Above this many transformer elements, verification skips the whole-module checksum (hashing
# every weight on each push) and relies on the per-tensor check of what was pushed.
MODULE_CHECKSUM_MAX_NUMEL = 50_000_000


class SGLangServerError(RuntimeError):
    """The SGLang server could not be started, died, or refused a request."""


# -- pure helpers ---------------------------------------------------------------------------------


def resolve_sglang_python(configured: str = "") -> str:
    """The interpreter that runs ``sglang serve``: the configured path, else
    ``$DIFFUSIONRL_SGLANG_PYTHON``, else the repo's ``.venv-sglang/bin/python``, else this
    interpreter if it can import sglang (the GPU image installs it alongside the project)."""
    for candidate, source in ((configured, "sampling.sglang_python"), (os.environ.get(SGLANG_PYTHON_ENV, ""), SGLANG_PYTHON_ENV)):
        if candidate:
            path = Path(candidate).expanduser()
            if not path.is_file():
                raise SGLangServerError(f"{source}={candidate!r} is not a file; point it at the SGLang venv's python")
            return str(path)
    venv = REPO_ROOT / ".venv-sglang" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    raise SGLangServerError(
        f"no SGLang interpreter: {venv} does not exist and this Python cannot import sglang. "
        f"Run `make sglang-env`, or set sampling.sglang_python / ${SGLANG_PYTHON_ENV}"
    )


def sglang_available(configured: str = "") -> bool:
    try:
        resolve_sglang_python(configured)
        return True
    except SGLangServerError:
        return False


def free_port(lo: int = 20000, hi: int = 32000) -> int:
    """A free TCP port P on 127.0.0.1 whose neighbour P+1 (SGLang's broker port) is free too.

    Drawn below Linux's ephemeral range (32768+), where outgoing connections take their ports:
    a port from ``bind(0)`` can be taken by one during the server's ~20 s start."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(lo, hi)
        if _bindable(port) and _bindable(port + 1):
            return port
    raise SGLangServerError(f"found no free pair of TCP ports in [{lo}, {hi}) on 127.0.0.1")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def decode_tensors(obj):
    """A msgpack response tree with ``{"__tensor__": True, "data": <safetensors bytes>}`` leaves
    -> the same tree with torch tensors."""
    from safetensors.torch import load

    if isinstance(obj, dict):
        if obj.get("__tensor__"):
            return load(obj["data"])["t"]
        return {k: decode_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tensors(v) for v in obj]
    return obj


def tensor_sha256(t: torch.Tensor) -> str:
    """SGLang's per-tensor digest (``/update_weights_from_tensor_checker``): dtype, shape, bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256()
    h.update(str(t.dtype).encode("utf-8"))
    h.update(repr(tuple(t.shape)).encode("utf-8"))
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_checksum(named: dict[str, torch.Tensor]) -> str:
    """SGLang's module digest (``/get_weights_checksum``): names and bytes in name order."""
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def buckets(named: list[tuple[str, torch.Tensor]], max_bytes: int, by_dtype: bool = False):
    """Split ``(name, tensor)`` pairs into lists of at most ``max_bytes`` (a bigger tensor goes
    alone), optionally one dtype per bucket (a flattened bucket holds a single dtype's bytes)."""
    groups: dict = {}
    for name, t in named:
        groups.setdefault(t.dtype if by_dtype else None, []).append((name, t))
    for group in groups.values():
        current, size = [], 0
        for name, t in group:
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > max_bytes:
                yield current
                current, size = [], 0
            current.append((name, t))
            size += nbytes
        if current:
            yield current


@dataclass
class LoraLayer:
    """One LoRA-wrapped linear layer of the policy, as the server names its weight."""

    param: str  # server parameter name, e.g. "transformer_blocks.0.attn.to_q.weight"
    a_key: str  # lora_state key of A [r, in]
    b_key: str  # lora_state key of B [out, r]
    base: torch.Tensor  # W0 [out, in], the base weight the engine started with
    scaling: float  # alpha / r


def lora_layers(peft_model: torch.nn.Module) -> list[LoraLayer]:
    """The LoRA layers of a peft-wrapped transformer (single ``default`` adapter)."""
    from peft.tuners.lora import LoraLayer as PeftLoraLayer

    layers = []
    for name, module in peft_model.named_modules():
        if not isinstance(module, PeftLoraLayer) or "default" not in getattr(module, "lora_A", {}):
            continue
        short = name.removeprefix("base_model.model.")
        layers.append(
            LoraLayer(
                param=f"{short}.weight",
                a_key=f"{name}.lora_A.default.weight",
                b_key=f"{name}.lora_B.default.weight",
                base=module.get_base_layer().weight.detach(),
                scaling=float(module.scaling["default"]),
            )
        )
    if not layers:
        raise ValueError("the policy has no LoRA layers to push")
    return layers


@torch.no_grad()
def merge_lora(layers: list[LoraLayer], lora_state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Merged weights ``W0 + scale * B @ A`` (computed in float32, cast to ``dtype``)."""
    missing = [k for layer in layers for k in (layer.a_key, layer.b_key) if k not in lora_state]
    if missing:
        raise KeyError(f"update_weights: {len(missing)} LoRA tensors missing from the state, e.g. {missing[:3]}")
    out = []
    for layer in layers:
        a = lora_state[layer.a_key].to(layer.base.device, torch.float32)  # [r, in]
        b = lora_state[layer.b_key].to(layer.base.device, torch.float32)  # [out, r]
        merged = layer.base.float() + layer.scaling * (b @ a)  # [out, in]
        out.append((layer.param, merged.to(dtype).contiguous()))
    return out


def base_transformer_state(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base transformer's state dict under diffusers names (LoRA tensors left out)."""
    state = {}
    for key, value in peft_model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        state[key.replace(".base_layer.", ".")] = value.detach()
    return state


# -- the server process ---------------------------------------------------------------------------


def _lowest_priority_on_cpu() -> None:
    """In the server's child process: without a GPU, run it at the lowest CPU priority. Its
    scheduler busy-polls a core even when idle, and a trainer sharing these cores (torch's
    OpenMP threads wait for each other) was measured ~60x slower next to it at normal priority."""
    if not torch.cuda.is_available():
        os.nice(19)
        try:  # with autogroup scheduling, niceness counts between sessions only through this
            Path("/proc/self/autogroup").write_text("19")
        except OSError:
            pass


class SGLangServer:
    """One ``sglang serve`` process in its own process group (killed as a group)."""

    def __init__(self, python: str, model_path: str, precision: str, port: int = 0, workdir: str | Path | None = None,
                 start_timeout_s: float = 300.0):
        self.python = python
        self.model_path = model_path
        self.precision = precision
        self.requested_port = port
        self.port = 0
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="sglang-"))
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "server.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        p = self.precision
        return [
            self.python, "-c", "import sys; from sglang.cli.main import main; sys.argv[0] = 'sglang'; sys.exit(main())",
            "serve", "--model-path", self.model_path, "--model-id", SD3_MODEL_ID,
            "--host", "127.0.0.1", "--port", str(self.port), "--num-gpus", "1",
            "--dit-precision", p, "--vae-precision", p, "--text-encoder-precisions", p, p, p,
            "--warmup-mode", "off",
        ]

    def start(self, attempts: int = 3) -> None:
        """Launch and wait for ``/health``; with a free port picked here, a port taken meanwhile
        by another process (the server exits on the bind error) is retried on a new port."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except SGLangServerError as exc:
                if self.requested_port or attempt == attempts or "address already in use" not in str(exc).lower():
                    raise
                log.warning("sglang port %d was taken while the server started; retrying on another port", self.port)

    def _start_once(self) -> None:
        import requests

        self.port = self.requested_port or free_port()
        env = dict(os.environ)
        env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        with open(self.log_path, "ab") as log_fh:  # the child keeps its own copy of the descriptor
            log_fh.write(f"\n=== start {self.starts + 1}: port {self.port}\n".encode())
            log_fh.flush()
            self.proc = subprocess.Popen(
                self.command(), cwd=self.workdir, env=env, stdout=log_fh, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_lowest_priority_on_cpu,
            )
        self.starts += 1
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SGLangServerError(f"sglang serve exited with {self.proc.returncode} while starting; log tail:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    log.info("sglang server up on %s (pid %d)", self.url, self.proc.pid)
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise SGLangServerError(f"sglang serve not healthy after {self.start_timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def healthy(self) -> bool:
        import requests

        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the process group (a clean shutdown), SIGKILL after ``timeout``."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the server's pid
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                # children (the scheduler) may outlive the parent for a moment
                if not _group_alive(pgid):
                    break
                time.sleep(0.5)
                if not _group_alive(pgid):
                    break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- the engine -----------------------------------------------------------------------------------


class SGLangRolloutEngine:
    """Rollouts from an SGLang diffusion server that this engine launches and owns."""

    name = "sglang"

    def __init__(
        self,
        adapter,
        peft_model: torch.nn.Module,
        *,
        micro_batch_size: int,
        python: str = "",
        port: int = 0,
        verify_weights: bool = False,
        ipc_bucket_mb: int = 512,
        start_timeout_s: float = 300.0,
        max_restarts: int = 3,
        concurrency: int = 2,
        request_timeout_s: float = 600.0,
        model_path: str | None = None,
        dtype: str = "float32",
        server: SGLangServer | None = None,
    ):
        """``server``: attach to a running server of the same base model instead of launching
        one (the engine then restarts it if it dies, but does not stop it on ``close``)."""
        self.adapter = adapter
        self.micro_batch_size = micro_batch_size
        self.version = 0
        self.verify_weights = verify_weights
        self.bucket_bytes = int(ipc_bucket_mb) * 2**20
        self.max_restarts = max_restarts
        self.concurrency = max(1, concurrency)
        self.request_timeout_s = request_timeout_s
        self.restarts = 0
        self.requests_sent = 0
        self.last_push_s = 0.0
        self.dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        self.layers = lora_layers(peft_model)
        self.base_state = base_transformer_state(peft_model)
        self._pushed: list[tuple[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._local = threading.local()
        self.workdir = Path(tempfile.mkdtemp(prefix="diffusionrl-sglang-"))
        self.owns_server = server is None
        if server is None:
            server = SGLangServer(
                resolve_sglang_python(python), model_path or self._materialize_model(), PRECISIONS[dtype], port=port,
                workdir=self.workdir, start_timeout_s=start_timeout_s,
            )
        self.server = server
        try:
            if self.owns_server:
                self.server.start()
            if verify_weights:
                self._verify([(layer.param, layer.base.to(self.dtype)) for layer in self.layers], "base weights")
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, cfg, adapter, policy) -> SGLangRolloutEngine:
        sc = cfg.sampling
        return cls(
            adapter,
            policy.model,
            micro_batch_size=cfg.train.micro_batch_size,
            python=sc.sglang_python,
            port=sc.sglang_port,
            verify_weights=sc.sglang_verify_weights,
            ipc_bucket_mb=sc.sglang_ipc_bucket_mb,
            start_timeout_s=sc.sglang_start_timeout_s,
            max_restarts=sc.sglang_max_restarts,
            model_path=model_folder(cfg.model.name, adapter),
            dtype=cfg.model.dtype,
        )

    def _materialize_model(self) -> str:
        """``builtin:tiny-sd3`` as a diffusers folder the server can load (the same weights as the
        adapter's: the build is seeded; ``verify_weights`` checks the served base weights of the
        LoRA layers and the module checksum at start)."""
        from diffusionrl.models.tiny import save_tiny_sd3

        path = save_tiny_sd3(self.workdir / "model")
        return str(path)

    # -- plumbing ------------------------------------------------------------------------------
    def _http(self):
        """One HTTP session per thread (requests run from a small thread pool)."""
        import requests

        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _post(self, path: str, **kw):
        import requests

        try:
            r = self._http().post(self.server.url + path, timeout=self.request_timeout_s, **kw)
        except requests.RequestException as exc:
            raise SGLangServerError(f"POST {path} failed: {exc}") from exc
        return r

    def _with_restart(self, fn, what: str):
        """Run ``fn``; if the server died or stopped answering, restart it (re-pushing the last
        weights) and run ``fn`` again, up to ``max_restarts`` restarts per engine."""
        while True:
            try:
                return fn()
            except SGLangServerError as exc:
                if self.server.healthy():
                    raise  # a live server refused the request: a real error, not a crash
                if self.restarts >= self.max_restarts:
                    raise SGLangServerError(
                        f"{what}: sglang server died and {self.restarts} restarts are used up "
                        f"(sampling.sglang_max_restarts={self.max_restarts}): {exc}"
                    ) from exc
                self.restarts += 1
                log.warning("%s: sglang server is down (%s); restart %d/%d, then retry", what, exc, self.restarts, self.max_restarts)
                self.server.stop(timeout=5.0)
                self.server.start()
                if self._pushed is not None:
                    self._push(self._pushed)

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, lora_state: dict[str, torch.Tensor], version: int) -> None:
        """Push the LoRA as merged weights of the touched layers, tagged with ``version``."""
        t0 = time.perf_counter()
        named = merge_lora(self.layers, lora_state, self.dtype)
        self._with_restart(lambda: self._push(named), f"update_weights(version={version})")
        self._pushed = named
        if self.verify_weights:
            self._with_restart(lambda: self._verify(named, f"version {version}"), "verify weights")
        self.version = int(version)
        self.last_push_s = time.perf_counter() - t0

    def _push(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if named and named[0][1].is_cuda:
            self._push_ipc(named)
        else:
            self._push_by_value(named)

    def _push_by_value(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Pickled CPU tensors, base64, in requests of at most the bucket size."""
        for chunk in buckets([(n, t.cpu()) for n, t in named], self.bucket_bytes):
            payload = base64.b64encode(pickle.dumps(chunk)).decode("ascii")
            self._check_update(self._post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [payload], "target_modules": ["transformer"],
            }))

    def _push_ipc(self, named: list[tuple[str, torch.Tensor]]) -> None:  # pragma: no cover - needs a GPU
        """CUDA IPC handles of per-dtype flattened buckets (trainer and server on one GPU)."""
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        monkey_patch_torch_reductions()
        device = named[0][1].device
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        for chunk in buckets(named, self.bucket_bytes, by_dtype=True):
            bucket = FlattenedTensorBucket(named_tensors=chunk)
            payload = {"transformer": {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}}
            torch.cuda.synchronize(device)  # the server reads the memory as soon as it gets the handle
            serialized = MultiprocessingSerializer.serialize(payload, output_str=True)
            # the bucket stays referenced until the server has answered (it copied the weights)
            self._check_update(self._post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [serialized], "payload_gpu_uuids": [uuid],
                "load_format": "flattened_bucket", "target_modules": ["transformer"],
            }))
            del bucket, payload

    def _check_update(self, r) -> None:
        body = _json_or_text(r)
        if r.status_code != 200 or not (isinstance(body, dict) and body.get("success")):
            raise SGLangServerError(f"update_weights_from_tensor refused (HTTP {r.status_code}): {body}")

    def _verify(self, named: list[tuple[str, torch.Tensor]], what: str) -> None:
        """Each pushed tensor's SHA-256 on the server must equal ours (the server skips unknown
        names with a warning only); small models also check the whole-module checksum."""
        expected = {n: tensor_sha256(t) for n, t in named}
        r = self._post("/update_weights_from_tensor_checker", json={"target_module": "transformer", "expected_named_tensors_sha256": expected})
        body = _json_or_text(r)
        if r.status_code != 200 or not (isinstance(body, dict) and body.get("success")):
            raise SGLangServerError(f"weight verification of {what} failed: the server's tensors differ from ours: {body}")
        if sum(t.numel() for t in self.base_state.values()) <= MODULE_CHECKSUM_MAX_NUMEL:
            server, ours = self.server_checksum(), self.expected_checksum(named)
            if server != ours:
                raise SGLangServerError(f"weight verification of {what} failed: module checksum {server} != expected {ours}")

    def server_checksum(self, module: str = "transformer") -> str:
        r = self._post("/get_weights_checksum", json={"module_names": [module]})
        if r.status_code != 200:
            raise SGLangServerError(f"get_weights_checksum failed (HTTP {r.status_code}): {_json_or_text(r)}")
        return r.json()[module]

    def expected_checksum(self, named: list[tuple[str, torch.Tensor]] | None = None) -> str:
        """The transformer checksum the server should report: base weights, with ``named`` (by
        default the last push) laid over them."""
        state = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in self.base_state.items()}
        state.update(dict(named if named is not None else (self._pushed or [])))
        return weights_checksum(state)

    # -- GPU memory handoff (colocated trainer) ---------------------------------------------------
    def release_memory(self) -> None:  # pragma: no cover - GPU only
        """Free the server's GPU memory while the trainer trains (``/release_memory_occupation``)."""
        self._memory("release")

    def resume_memory(self) -> None:  # pragma: no cover - GPU only
        self._memory("resume")

    def _memory(self, what: str) -> None:  # pragma: no cover - GPU only
        r = self._post(f"/{what}_memory_occupation", json={})
        if r.status_code != 200:
            raise SGLangServerError(f"{what}_memory_occupation failed (HTTP {r.status_code}): {_json_or_text(r)}")

    # -- sampling ------------------------------------------------------------------------------
    def _request(self, prompt: str, seed: int, sde_steps: list[int], spec: SamplingSpec) -> dict:
        cfg = spec.guidance_scale != 1.0
        return {
            "prompt": prompt,
            "negative_prompt": spec.negative_prompt if cfg else None,
            "seed": int(seed),
            "generator_device": "cpu",
            "width": spec.resolution,
            "height": spec.resolution,
            "num_inference_steps": spec.num_steps,
            "num_outputs_per_prompt": 1,
            "guidance_scale": float(spec.guidance_scale),
            "rollout": True,
            "rollout_sde_type": "sde" if spec.sde_type == "ode" else spec.sde_type,
            "rollout_noise_level": float(spec.noise_level),
            "rollout_log_prob_no_const": spec.sde_type == "cps",
            "rollout_debug_mode": False,
            "rollout_return_denoising_env": True,
            "rollout_return_dit_trajectory": True,
            "rollout_sde_step_indices": sde_steps,
            "suppress_logs": True,
        }

    def _generate_one(self, body: dict) -> dict:
        import msgpack

        r = self._post("/rollout/generate", json=body)
        with self._lock:
            self.requests_sent += 1
        if r.status_code != 200:
            raise SGLangServerError(f"/rollout/generate failed (HTTP {r.status_code}): {_json_or_text(r)}")
        items = decode_tensors(msgpack.unpackb(r.content, raw=False))
        if len(items) != 1:
            raise SGLangServerError(f"/rollout/generate returned {len(items)} outputs for 1 requested")
        item = items[0]
        if int(item["seed"]) != body["seed"]:
            raise SGLangServerError(f"/rollout/generate answered seed {item['seed']} for seed {body['seed']}")
        return item

    def _generate_all(self, bodies: list[dict]) -> list[dict]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._generate_one, bodies))

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        group_ids,
        seeds,
        spec: SamplingSpec,
        sde_mask: np.ndarray | torch.Tensor | None = None,
        metadata: list[dict] | None = None,
    ) -> Trajectory:
        b, t = len(prompts), spec.num_steps
        group_ids_t = _as_long(group_ids, b, "group_ids")
        seeds_t = _as_long(seeds, b, "seeds")
        if spec.sde_type == "ode" and spec.ode_solver != "euler":
            raise NotImplementedError(f"the sglang engine samples ODE steps with Euler only, not {spec.ode_solver!r}")
        if spec.sde_type == "ode" or sde_mask is None:
            mask = torch.zeros(b, t, dtype=torch.bool)
            if spec.sde_type != "ode":
                mask[:, :-1] = True
        else:
            mask = torch.as_tensor(np.asarray(sde_mask), dtype=torch.bool)
            mask = mask.expand(b, t).clone() if mask.ndim == 1 else mask
        bodies = [
            self._request(p, int(s), [j for j in range(t) if bool(mask[i, j])], spec)
            for i, (p, s) in enumerate(zip(prompts, seeds_t.tolist()))
        ]
        items = self._with_restart(lambda: self._generate_all(bodies), f"generate({b} samples)")
        return self._to_trajectory(items, prompts, group_ids_t, seeds_t, mask, spec, metadata)

    def _to_trajectory(self, items, prompts, group_ids, seeds, mask, spec, metadata) -> Trajectory:
        b, t = len(items), spec.num_steps
        traj0 = items[0]["dit_trajectory"]
        sigmas = traj0["sigmas"].to(torch.float32)  # [T+1], the server's post-shift snapshot
        timesteps = traj0["timesteps"].to(torch.float32)[:t]  # [T] (the server appends a terminal 0)
        latents, log_probs, images, pos, neg = [], [], [], [], []
        for item in items:
            traj = item["dit_trajectory"]
            if not (torch.equal(traj["sigmas"].float(), sigmas) and torch.equal(traj["timesteps"].float()[:t], timesteps)):
                raise SGLangServerError("samples of one batch came back with different schedules")
            latents.append(traj["latents"].to(torch.float32))  # [T+1, C, h, w]
            log_probs.append(item["rollout_log_probs"].to(torch.float32).reshape(t))  # [T]
            env = item["denoising_env"]
            pos.append(env["pos_cond_kwargs"])
            neg.append(env.get("neg_cond_kwargs"))
            if spec.keep_images:
                img = item["generated_output"].float()  # [3, H, W] in [0, 1]
                images.append((img.clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
        cond = _conditioning(pos, neg if spec.guidance_scale != 1.0 else None)
        micro = self.micro_batch_size if b % self.micro_batch_size == 0 else b
        return Trajectory(
            prompts=list(prompts),
            group_ids=group_ids,
            seeds=seeds,
            sigmas=sigmas,
            timesteps=timesteps,
            sde_mask=mask,
            latents=torch.stack(latents),  # [B, T+1, C, h, w]
            log_probs=torch.stack(log_probs),  # [B, T]
            conditioning=cond,
            guidance_scale=float(spec.guidance_scale),
            sde_type=spec.sde_type,
            noise_level=float(spec.noise_level),
            micro_batch_size=micro,
            policy_version=self.version,
            images=np.stack(images) if images else None,
            metadata=metadata,
        )

    def close(self) -> None:
        server = getattr(self, "server", None)
        if server is not None and self.owns_server:
            server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _conditioning(pos: list[dict], neg: list[dict | None] | None) -> Conditioning:
    """The DiT's conditioning kwargs of each sample -> one batched ``Conditioning``."""

    def stack(kwargs: list[dict], key: str, ndim: int) -> torch.Tensor:
        # one sample's tensor comes as [S, D] / [D] (or with a leading 1)
        return torch.stack([kw[key].reshape(kw[key].shape[-ndim:]).to(torch.float32) for kw in kwargs])

    cond = Conditioning(stack(pos, "encoder_hidden_states", 2), stack(pos, "pooled_projections", 1))
    if neg is not None:
        if any(n is None for n in neg):
            raise SGLangServerError("the server returned no negative conditioning for a CFG request")
        cond.negative_prompt_embeds = stack(neg, "encoder_hidden_states", 2)
        cond.negative_pooled_embeds = stack(neg, "pooled_projections", 1)
    return cond


def model_folder(reference: str, adapter) -> str | None:
    """What the server loads: a local diffusers folder (the reference, or the folder the adapter
    was loaded from), a hub id as is; ``None`` for the builtin model (the engine writes it)."""
    loaded_from = getattr(getattr(adapter.pipe, "config", None), "_name_or_path", None)
    if loaded_from and Path(loaded_from).is_dir():
        return str(Path(loaded_from).resolve())
    if reference.startswith("builtin:"):
        return None
    if Path(reference).expanduser().is_dir():
        return str(Path(reference).expanduser().resolve())
    return reference


def _json_or_text(r):
    try:
        return r.json()
    except ValueError:
        return r.text[:2000]
