"""The ``sglang serve`` process: which interpreter runs it, its port, its start, health and stop.

The server runs from its own interpreter, normally the repo's ``.venv-sglang`` (sglang pins
torch/transformers/diffusers versions that differ from ours), in its own process group (stopped
as a group), and without a GPU at the lowest CPU priority. Its scheduler waits for requests
(``--sleep-on-idle``) instead of polling, which keeps a whole core busy while it is idle (a poll
returns as soon as a request arrives).

Everything it serves listens on 127.0.0.1 only: HTTP (``--host``) and its scheduler socket (which
SGLang derives from ``--host``), gloo and NCCL (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME=lo``:
the server is one node), and torch.distributed's rendezvous store. That store is the one piece no
SGLang flag places: torch's ``TCPStore`` server listens on every interface whatever host it is
given (SGLang 0.5.23 has rank 0 start one on ``--master-port``, 30005 by default). So ``LAUNCHER``
starts the server with that store already running in the launching process, on a listening socket
bound to 127.0.0.1, and every rank joins it as a client (``TORCHELASTIC_USE_AGENT_STORE=True``,
torch's own mode for a store hosted by someone else).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# SGLang picks its native pipeline by model id (a local folder's name says nothing); any other id
# falls back to its diffusers backend, whose /rollout/generate fails. Family -> (model id, number of
# text encoders: one precision each).
SERVED_FAMILIES = {"sd3": ("stable-diffusion-3-medium-diffusers", 3), "flux": ("FLUX.1-dev", 2),
                   "flux2": ("FLUX.2-dev", 1), "flux2-klein": ("FLUX.2-klein-base-4B", 1)}
# Families whose SGLang pipeline config fixes the text length whatever text_encoder_extra_args say (FLUX.2
# [klein]'s drops the tokenizer's max_length): served only at that model.max_sequence_length
FIXED_TEXT_TOKENS = {"flux2-klein": 512}
SD3_MODEL_ID = SERVED_FAMILIES["sd3"][0]
# Families the engine does not serve, and why (docs/sglang.md): what was tried with SGLang 0.5.23 on CPU (Wan,
# Qwen-Image: a CPU kernel is missing; Z-Image: its DiT config and batching) and editing families (the requests
# carry no input image).
UNSERVED_FAMILIES = {
    **dict.fromkeys(("wan", "qwen-image"),
                    "on CPU SGLang's DiT calls torch.ops.sgl_kernel.fused_norm_scale_shift_cpu, which the installed "
                    "sgl_kernel lacks: /rollout/generate answers HTTP 500 on the first forward"),
    "zimage": "SGLang's Z-Image DiT reads num_attention_heads and num_layers where diffusers' config has n_heads "
              "and n_layers (it falls back to diffusers' transformer, which has no rotary_emb for its rollout path: "
              "HTTP 500), with the keys added it takes one caption per request (a batch of 2 answers HTTP 500), and "
              "its DiT fuses to_q/to_k/to_v into one to_qkv, which the LoRA push (by diffusers' names) does not map",
    "flux-kontext": "an editing family: its input image enters the transformer as extra tokens beside the noisy "
                    "latents, and the engine's rollout requests (protocol.py) carry prompts and seeds only, with no "
                    "input image nor its latents to send",
    **dict.fromkeys(("qwen-image-edit", "qwen-image-edit-v1"),  # both pipelines
                    "an editing family: its input image enters the text encoder (Qwen2.5-VL's vision tower) and, "
                    "VAE-encoded, the transformer, and the engine's rollout requests (protocol.py) carry prompts "
                    "and seeds only, with no input image to send"),
}
PRECISIONS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def text_encoder_args(family: str, t5_tokens: int) -> list[dict]:
    """SGLang's ``text_encoder_extra_args`` (per text encoder, laid over its tokenizer kwargs) that
    make a served family encode prompts as the local engine does: CLIP at its 77 tokens, T5 (FLUX.2's
    Mistral) at ``model.max_sequence_length`` (diffusers' ``max_sequence_length``). SGLang 0.5.23 fixes
    SD3's T5 at 256 tokens and FLUX.1's and FLUX.2's text at 512 otherwise, and a request's
    ``max_sequence_length`` would cut SD3's CLIP encoders too and miss its negative prompt; this applies to
    every prompt."""
    t5 = {"max_length": int(t5_tokens), "padding": "max_length", "truncation": True}
    if family == "sd3":  # CLIP-L, CLIP-G keep their kwargs; T5 third
        return [{}, {}, t5]
    if family == "flux":  # SGLang's FLUX.1 kwargs (CLIP 77), T5 second
        common = {"padding": "max_length", "truncation": True, "return_overflowing_tokens": False,
                  "return_length": False}
        return [{**common, "max_length": 77}, {**common, **t5}]
    if family == "flux2":  # one encoder (Mistral), the templated prompt padded to the local length as the pipeline's
        return [t5]
    if family in FIXED_TEXT_TOKENS:  # SGLang's own length, which SGLangServer checks is the local one
        return [{}]
    raise SGLangServerError(f"no text-encoder lengths for family {family!r}")
SGLANG_PYTHON_ENV = "DIFFUSIONRL_SGLANG_PYTHON"
LOOPBACK = "127.0.0.1"
# What ``sglang serve`` runs as (``python -c LAUNCHER serve ...``, in the SGLang interpreter, where
# this package is not importable): SGLang's CLI, with torch.distributed's store hosted here on
# loopback (module docstring). The hook waits for SGLang to import ``launch_server`` itself (its
# import order matters to its plugins), then wraps ``_start_scheduler_processes``, which spawns the
# ranks after the ports are settled: the store listens on the settled ``master_port`` and the ranks
# inherit ``TORCHELASTIC_USE_AGENT_STORE``. A SGLang without that function starts unchanged (the
# store is then its own, on every interface) and says so in the server log.
LAUNCHER = r"""
import importlib.abc, importlib.util, os, socket, sys

TARGET = "sglang.multimodal_gen.runtime.launch_server"


def host_store(module):
    spawn = getattr(module, "_start_scheduler_processes", None)
    if spawn is None:
        print(f"diffusionrl: {TARGET} has no _start_scheduler_processes: the rendezvous store is SGLang's own",
              file=sys.stderr, flush=True)
        return

    def spawn_beside_a_loopback_store(server_args, *args, **kwargs):
        import datetime
        from torch.distributed import TCPStore

        port = server_args.materialize().master_port
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        module._diffusionrl_store = TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=3600),
                                             wait_for_workers=False, multi_tenant=True,
                                             master_listen_fd=listener.detach())
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the ranks, spawned next, join it as clients
        print(f"diffusionrl: torch.distributed store on 127.0.0.1:{port}", file=sys.stderr, flush=True)
        return spawn(server_args, *args, **kwargs)

    module._start_scheduler_processes = spawn_beside_a_loopback_store


class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            host_store(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Hook())
from sglang.cli.main import main

sys.argv[0] = "sglang"
sys.exit(main())
"""
REPO_ROOT = Path(__file__).resolve().parents[3]  # diffusionrl/rollout/sglang/server.py -> the repo


class SGLangServerError(RuntimeError):
    """The SGLang server could not be started, died, or refused a request."""


# -- interpreter and ports ------------------------------------------------------------------------


def resolve_sglang_python(configured: str = "") -> str:
    """The interpreter that runs ``sglang serve``: the configured path, else
    ``$DIFFUSIONRL_SGLANG_PYTHON``, else the repo's ``.venv-sglang/bin/python``, else this
    interpreter if it can import sglang (the GPU image installs it alongside the project)."""
    choices = ((configured, "sampling.sglang_python"), (os.environ.get(SGLANG_PYTHON_ENV, ""), SGLANG_PYTHON_ENV))
    for candidate, source in choices:
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
    a port from ``bind(0)`` can be taken by one during the server's start."""
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


def _lowest_priority_on_cpu() -> None:
    """In the server's child process: without a GPU, run it at the lowest CPU priority. Its
    scheduler busy-polls a core even when idle, and a trainer sharing these cores (torch's
    OpenMP threads wait for each other) is many times slower next to it at normal priority
    (bench/README.md)."""
    if not torch.cuda.is_available():
        os.nice(19)
        try:  # with autogroup scheduling, niceness counts between sessions only through this
            Path("/proc/self/autogroup").write_text("19")
        except OSError:
            pass


class SGLangServer:
    """One ``sglang serve`` process in its own process group (killed as a group)."""

    def __init__(self, python: str, model_path: str, precision: str, port: int = 0, workdir: str | Path | None = None,
                 start_timeout_s: float = 300.0, family: str = "sd3", embedded_guidance: float | None = None,
                 t5_tokens: int | None = None):
        """``family``: the adapter's (``SERVED_FAMILIES``); ``embedded_guidance``: the guidance input
        of a guidance-distilled family (FLUX), which SGLang 0.5.23 takes per server
        (``--embedded-cfg-scale``), not per request; ``t5_tokens``: the T5 prompt length
        (``text_encoder_args``; ``None``: SGLang's own)."""
        if family not in SERVED_FAMILIES:
            why = f" ({UNSERVED_FAMILIES[family]})" if family in UNSERVED_FAMILIES else ""
            raise SGLangServerError(f"the sglang engine serves the families {sorted(SERVED_FAMILIES)}, "
                                    f"not {family!r}{why}; use sampling.engine=local")
        fixed = FIXED_TEXT_TOKENS.get(family)
        if fixed is not None and t5_tokens not in (None, fixed):
            raise SGLangServerError(f"SGLang 0.5.23's {family} pipeline encodes prompts at {fixed} tokens whatever "
                                    f"it is asked (its pipeline config drops the tokenizer's max_length), not at "
                                    f"model.max_sequence_length={t5_tokens}; set model.max_sequence_length={fixed} "
                                    "(the flux2-klein-base-4b-pickscore recipe's) or use sampling.engine=local")
        self.python = python
        self.model_path = model_path
        self.precision = precision
        self.family = family
        self.embedded_guidance = embedded_guidance
        self.t5_tokens = t5_tokens
        self.requested_port = port
        self.port = 0
        self.master_port = 0  # torch.distributed's rendezvous store (hosted on loopback by LAUNCHER)
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
        model_id, encoders = SERVED_FAMILIES[self.family]
        extra = [] if self.embedded_guidance is None else ["--embedded-cfg-scale", repr(self.embedded_guidance)]
        if self.t5_tokens is not None:  # a pipeline-config file: the one way to set text_encoder_extra_args
            config = self.workdir / "pipeline_config.json"
            config.write_text(json.dumps({"text_encoder_extra_args": text_encoder_args(self.family, self.t5_tokens)}))
            extra += ["--pipeline-config-path", str(config)]
        return [
            self.python, "-c", LAUNCHER,
            "serve", "--model-path", self.model_path, "--model-id", model_id,
            "--host", LOOPBACK, "--port", str(self.port), "--master-port", str(self.master_port), "--num-gpus", "1",
            "--dit-precision", p, "--vae-precision", p, "--text-encoder-precisions", *[p] * encoders,
            *extra, "--warmup-mode", "off", "--sleep-on-idle",
        ]

    def environment(self) -> dict[str, str]:
        """The server's environment: ours, no telemetry, and (one node) gloo's and NCCL's sockets on
        loopback, which otherwise listen on the interface the host name resolves to."""
        env = dict(os.environ)
        env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
        return env

    def start(self, attempts: int = 3) -> None:
        """Launch and wait for ``/health``; with a free port picked here, a port taken meanwhile
        by another process (the server exits on the bind error) is retried on a new port, ``attempts``
        starts at most (tenacity)."""
        from tenacity import Retrying, retry_if_exception, stop_after_attempt

        def port_taken(exc: BaseException) -> bool:
            return (not self.requested_port and isinstance(exc, SGLangServerError)
                    and "address already in use" in str(exc).lower())

        def warn(_state) -> None:
            log.warning("sglang port %d was taken while the server started; retrying on another port", self.port)

        Retrying(stop=stop_after_attempt(attempts), retry=retry_if_exception(port_taken), before_sleep=warn,
                 reraise=True)(self._start_once)

    def _start_once(self) -> None:
        import requests

        self.port = self.requested_port or free_port()
        self.master_port = free_port()
        while self.master_port in (self.port, self.port + 1):
            self.master_port = free_port()
        env = self.environment()
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
                raise SGLangServerError(
                    f"sglang serve exited with {self.proc.returncode} while starting; log tail:\n{self.log_tail()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    log.info("sglang server up on %s (pid %d)", self.url, self.proc.pid)
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise SGLangServerError(
            f"sglang serve not healthy after {self.start_timeout_s:.0f} s; log tail:\n{self.log_tail()}"
        )

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
