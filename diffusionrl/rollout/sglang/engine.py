"""The SGLang rollout engine: rollouts from SGLang's diffusion runtime (``sglang.multimodal_gen``).

The engine launches and owns one ``sglang serve`` process (``server.py``), waits for ``/health``,
and talks to it over HTTP:

- ``generate`` sends one ``POST /rollout/generate`` per group (the samples of one prompt and SDE step
  set, up to ``outputs_per_request`` outputs each), ``concurrency`` at a time, and turns the answers
  into our ``Trajectory`` (``protocol.py``: the wire format and how our contract maps to SGLang's).
- ``update_weights`` pushes the trainer's LoRA as merged weights of the touched layers (a full
  fine-tune: every transformer parameter), tagged with a weight version, and optionally verifies them
  on the server (``weight_sync.py``).
- ``release_memory`` / ``resume_memory`` hand the server's GPU memory to a colocated trainer and
  back (``/release_memory_occupation``, ``/resume_memory_occupation``).
- A server that dies (or stops answering) is restarted, the last weights re-pushed and the
  batch (or push) retried, up to ``max_restarts`` times per engine.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from diffusionrl.trajectory import Trajectory

from ..base import SamplingSpec
from ..batch import RolloutBatch
from . import weight_sync
from .protocol import json_or_text, parse_generate_response, plan_requests, request_body, trajectory_fields
from .server import PRECISIONS, SGLangServer, SGLangServerError, model_folder, resolve_sglang_python
from .weight_sync import (
    NamedTensors,
    base_transformer_state,
    full_base_state,
    full_named,
    lora_layers,
    merge_lora,
    module_checksum_fits,
)

log = logging.getLogger(__name__)

# The rollout dynamics the server can sample (protocol.request_body maps ode to sde without SDE steps).
SERVER_SDE_TYPES = ("sde", "cps", "ode")


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
        outputs_per_request: int = 16,
        request_timeout_s: float = 600.0,
        model_path: str | None = None,
        dtype: str = "float32",
        server: SGLangServer | None = None,
        builtin: str = "",
        guidance_scale: float | None = None,
        t5_tokens: int | None = None,
        finetune: str = "lora",
    ):
        """``server``: attach to a running server of the same base model instead of launching
        one (the engine then restarts it if it dies, but does not stop it on ``close``).
        ``guidance_scale``: what a guidance-distilled family's server embeds (FLUX: SGLang takes it
        per server); requests must then ask for the same scale. ``t5_tokens``: the T5 prompt length
        the server encodes (``model.max_sequence_length``, the local engine's; ``None``: SGLang's).
        ``finetune``: ``lora`` (``peft_model`` is the peft-wrapped transformer; pushes merge the LoRA into
        the touched layers) or ``full`` (``peft_model`` is the trained transformer itself, before any
        sharding; pushes carry every parameter)."""
        self.adapter = adapter
        self.cfg_pass = adapter.needs_negative(2.0)  # does the family sample with a negative (CFG) pass at all?
        self.micro_batch_size = micro_batch_size
        self.version = 0
        self.verify_weights = verify_weights
        self.bucket_bytes = int(ipc_bucket_mb) * 2**20
        self.max_restarts = max_restarts
        self.concurrency = max(1, concurrency)
        self.outputs_per_request = max(1, int(outputs_per_request))
        self.request_timeout_s = request_timeout_s
        self.restarts = 0
        self.requests_started = 0
        self.requests_sent = 0  # answered
        self.last_push_s = 0.0
        self.dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        if finetune == "full":
            self.layers, self.param_names = None, [n for n, _ in peft_model.named_parameters()]
            self.module_check = module_checksum_fits(peft_model.state_dict())
            self.base_state = full_base_state(peft_model, keep_params=self.module_check)
            served = [(n, p.detach().to(self.dtype)) for n, p in peft_model.named_parameters()]
        else:
            self.layers, self.param_names = lora_layers(peft_model), None
            self.base_state = base_transformer_state(peft_model)
            self.module_check = module_checksum_fits(self.base_state)
            served = [(layer.param, layer.base.to(self.dtype)) for layer in self.layers]
        self._pushed: NamedTensors | None = None
        self._lock = threading.Lock()
        self._local = threading.local()
        self.workdir = Path(tempfile.mkdtemp(prefix="diffusionrl-sglang-"))
        self.builtin = builtin
        self.owns_server = server is None
        if server is None:
            embedded = None if self.cfg_pass else (3.5 if guidance_scale is None else guidance_scale)
            server = SGLangServer(
                resolve_sglang_python(python), model_path or self._materialize_model(), PRECISIONS[dtype], port=port,
                workdir=self.workdir, start_timeout_s=start_timeout_s, family=adapter.family,
                embedded_guidance=embedded, t5_tokens=t5_tokens,
            )
        self.server = server
        try:
            if self.owns_server:
                self.server.start()
            if verify_weights:
                self._verify(served, "base weights")
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, cfg, adapter, policy, **kw) -> SGLangRolloutEngine:
        """The engine ``cfg`` asks for over ``policy`` (a LoRA or a full fine-tune); ``kw`` adds to or overrides
        the constructor's arguments (e.g. ``server``)."""
        sampling_cfg = cfg.sampling
        return cls(adapter, policy.model, **dict(
            micro_batch_size=cfg.train.micro_batch_size,
            python=sampling_cfg.sglang_python,
            port=sampling_cfg.sglang_port,
            verify_weights=sampling_cfg.sglang_verify_weights,
            ipc_bucket_mb=sampling_cfg.sglang_ipc_bucket_mb,
            start_timeout_s=sampling_cfg.sglang_start_timeout_s,
            max_restarts=sampling_cfg.sglang_max_restarts,
            outputs_per_request=sampling_cfg.sglang_outputs_per_request,
            model_path=model_folder(cfg.model.name, adapter),
            builtin=cfg.model.name if cfg.model.name.startswith("builtin:") else "",
            dtype=cfg.model.dtype,
            guidance_scale=sampling_cfg.guidance_scale,
            t5_tokens=cfg.model.max_sequence_length,
            finetune=policy.finetune,
        ) | kw)

    def _materialize_model(self) -> str:
        """The builtin model (``builtin``, default the family's ``builtin:tiny-<family>``) as a diffusers
        folder the server can load (the same weights as the adapter's: a seeded build or shipped
        weights; ``verify_weights`` checks the served base weights of the LoRA layers and the module
        checksum at start)."""
        from diffusionrl.models.families import save_builtin

        path = save_builtin(self.builtin or self.adapter.builtin, self.workdir / "model")
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
                log.warning("%s: sglang server is down (%s); restart %d/%d, then retry", what, exc, self.restarts,
                            self.max_restarts)
                self.server.stop(timeout=5.0)
                self.server.start()
                if self._pushed is not None:
                    self._push(self._pushed)

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Push the trainer's weights, tagged with ``version``: ``state`` is the LoRA (pushed as merged weights
        of the touched layers) or a full fine-tune's parameters (pushed whole, in the served precision)."""
        t0 = time.perf_counter()
        if self.layers is None:
            named = full_named(self.param_names, state, self.dtype)
        else:
            named = merge_lora(self.layers, state, self.dtype)
        self._with_restart(lambda: self._push(named), f"update_weights(version={version})")
        self._pushed = named
        if self.verify_weights:
            self._with_restart(lambda: self._verify(named, f"version {version}"), "verify weights")
        self.version = int(version)
        self.last_push_s = time.perf_counter() - t0

    def _push(self, named: NamedTensors) -> None:
        weight_sync.push_weights(self._post, named, self.bucket_bytes)

    def _verify(self, named: NamedTensors, what: str) -> None:
        weight_sync.verify_pushed(self._post, named, self.base_state, self.dtype, what, self.module_check)

    def server_checksum(self, module: str = "transformer") -> str:
        return weight_sync.server_checksum(self._post, module)

    def expected_checksum(self, named: NamedTensors | None = None) -> str:
        """The transformer checksum the server should report: base weights, with ``named`` (by
        default the last push) laid over them."""
        return weight_sync.expected_checksum(self.base_state, self.dtype,
                                             named if named is not None else (self._pushed or []))

    # -- GPU memory handoff (colocated trainer) ---------------------------------------------------
    def release_memory(self) -> None:  # pragma: no cover - GPU only
        """Free the server's GPU memory while the trainer trains (``/release_memory_occupation``)."""
        self._memory("release")

    def resume_memory(self) -> None:  # pragma: no cover - GPU only
        """Take the server's GPU memory back before sampling (``/resume_memory_occupation``)."""
        self._memory("resume")

    def _memory(self, what: str) -> None:  # pragma: no cover - GPU only
        r = self._post(f"/{what}_memory_occupation", json={})
        if r.status_code != 200:
            raise SGLangServerError(f"{what}_memory_occupation failed (HTTP {r.status_code}): {json_or_text(r)}")

    # -- sampling ------------------------------------------------------------------------------
    def _request(self, prompt: str, seeds: list[int], sde_steps: list[int], spec: SamplingSpec) -> dict:
        """One group's /rollout/generate body."""
        return request_body(prompt, seeds, sde_steps, spec, self.cfg_pass)

    def _generate_one(self, body: dict) -> list[dict]:
        with self._lock:
            self.requests_started += 1
        r = self._post("/rollout/generate", json=body)
        with self._lock:
            self.requests_sent += 1
        return parse_generate_response(r, body)

    def _generate_all(self, plan: list[tuple[list[int], dict]], size: int) -> list[dict]:
        """The answers of ``plan`` (``protocol.plan_requests``), back in sample order."""
        items: list[dict | None] = [None] * size
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            for (idx, _), outputs in zip(plan, pool.map(self._generate_one, [body for _, body in plan])):
                for i, item in zip(idx, outputs):
                    items[i] = item
        return items

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
        if spec.sde_type not in SERVER_SDE_TYPES:
            raise NotImplementedError(
                f"the sglang engine cannot sample sde_type={spec.sde_type!r}: its server's rollout SDEs are "
                f"{'/'.join(SERVER_SDE_TYPES)} (Dance-SDE's constant-noise dynamics are not one of them); "
                "use sampling.engine=local"
            )
        if spec.same_latent:
            raise NotImplementedError("the sglang engine cannot share a group's initial latent (sampling.same_latent):"
                                      " its server draws each output's latent from its own seed; use the local engine")
        if spec.ode_solver != "euler":  # also the ODE steps outside an SDE window
            raise NotImplementedError(f"the sglang engine samples ODE steps with Euler only, not {spec.ode_solver!r}")
        if spec.post_window_ode_steps:
            raise NotImplementedError("the sglang engine samples the whole schedule: MixGRPO-Flash's compression "
                                      "(sampling.post_window_ode_steps) needs the local engine")
        batch = RolloutBatch.prepare(prompts, group_ids, seeds, spec, sde_mask, self.micro_batch_size, metadata)
        plan = plan_requests(batch.prompts, batch.seeds, batch.sde_mask, spec, self.outputs_per_request, self.cfg_pass)
        items = self._with_restart(lambda: self._generate_all(plan, batch.size), f"generate({batch.size} samples)")
        return batch.trajectory(**trajectory_fields(items, spec, self.adapter), policy_version=self.version)

    def close(self) -> None:
        server = getattr(self, "server", None)
        if server is not None and self.owns_server:
            server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
