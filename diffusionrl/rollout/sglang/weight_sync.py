"""Weight push to the server: the trainer's LoRA as merged weights of the touched layers, or a full
fine-tune's every transformer parameter.

``merge_lora`` gives ``W0 + scale * B @ A`` per LoRA layer (``W0``: the base weight the engine was
started with); ``full_named`` casts a full fine-tune's parameters to the served precision. Either is sent
through ``POST /update_weights_from_tensor``: by value (pickled CPU tensors,
base64) on CPU and across hosts, CUDA IPC handles in per-dtype flattened buckets when the trainer
is on a GPU (colocated). The server skips unknown names with only a warning, so ``verify_pushed``
checks each pushed tensor's SHA-256 on the server (``/update_weights_from_tensor_checker``) and,
for small models, the whole-module checksum (``/get_weights_checksum``).

The push functions take ``post(path, json=...)``: one HTTP POST to the server, returning the
``requests`` response (the engine's, which owns the connection and the restarts).
"""

from __future__ import annotations

import base64
import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .protocol import json_or_text
from .server import SGLangServerError

Post = Callable[..., Any]  # post(path, json=...) -> requests.Response
NamedTensors = list[tuple[str, torch.Tensor]]
# Above this many transformer elements, verification skips the whole-module checksum (hashing
# every weight on each push) and relies on the per-tensor check of what was pushed.
MODULE_CHECKSUM_MAX_NUMEL = 50_000_000


# -- checksums, buckets ---------------------------------------------------------------------------


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


# -- LoRA merge -----------------------------------------------------------------------------------


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
def merge_lora(layers: list[LoraLayer], lora_state: dict[str, torch.Tensor], dtype: torch.dtype) -> NamedTensors:
    """Merged weights ``W0 + scale * B @ A`` (computed in float32, cast to ``dtype``)."""
    missing = [k for layer in layers for k in (layer.a_key, layer.b_key) if k not in lora_state]
    if missing:
        raise KeyError(
            f"update_weights: {len(missing)} LoRA tensors missing from the state, e.g. {missing[:3]}"
        )
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


# -- full fine-tuning -----------------------------------------------------------------------------


def full_base_state(module: torch.nn.Module, keep_params: bool) -> dict[str, torch.Tensor]:
    """What a full fine-tune's module checksum rests on besides the pushed parameters: the transformer's
    buffers (CPU copies) and, with ``keep_params``, its parameters as served at start (to check the served
    base weights before any push; the live ones change with every update)."""
    params = {n for n, _ in module.named_parameters()}
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if keep_params or k not in params}


@torch.no_grad()
def full_named(names: list[str], state: dict[str, torch.Tensor], dtype: torch.dtype) -> NamedTensors:
    """A full fine-tune's push: every transformer parameter (``names``, diffusers' names, which SGLang's
    modules share) from ``state``, cast to the served ``dtype``."""
    missing, unknown = set(names) - set(state), set(state) - set(names)
    if missing or unknown:
        raise KeyError(f"update_weights: the full state has {len(missing)} missing and {len(unknown)} unknown "
                       f"transformer parameters, e.g. {sorted(missing)[:2] + sorted(unknown)[:2]}")
    return [(name, state[name].detach().to(dtype).contiguous()) for name in names]


# -- push and verify ------------------------------------------------------------------------------


def push_weights(post: Post, named: NamedTensors, bucket_bytes: int) -> None:
    """Push ``named`` in requests of at most ``bucket_bytes``: CUDA tensors as IPC handles (the
    server on the same GPU), others by value."""
    if named and named[0][1].is_cuda:
        push_ipc(post, named, bucket_bytes)
    else:
        push_by_value(post, named, bucket_bytes)


def push_by_value(post: Post, named: NamedTensors, bucket_bytes: int) -> None:
    """Pickled CPU tensors, base64, in requests of at most the bucket size."""
    for chunk in buckets([(n, t.cpu()) for n, t in named], bucket_bytes):
        payload = base64.b64encode(pickle.dumps(chunk)).decode("ascii")
        check_update(post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [payload], "target_modules": ["transformer"],
        }))


def push_ipc(post: Post, named: NamedTensors, bucket_bytes: int) -> None:  # pragma: no cover - needs a GPU
    """CUDA IPC handles of per-dtype flattened buckets (trainer and server on one GPU)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()
    device = named[0][1].device
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    for chunk in buckets(named, bucket_bytes, by_dtype=True):
        bucket = FlattenedTensorBucket(named_tensors=chunk)
        flat = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        payload = {"transformer": flat}
        torch.cuda.synchronize(device)  # the server reads the memory as soon as it gets the handle
        serialized = MultiprocessingSerializer.serialize(payload, output_str=True)
        # the bucket stays referenced until the server has answered (it copied the weights)
        check_update(post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialized], "payload_gpu_uuids": [uuid],
            "load_format": "flattened_bucket", "target_modules": ["transformer"],
        }))
        del bucket, flat, payload


def module_checksum_fits(state: dict[str, torch.Tensor]) -> bool:
    """Whether verification hashes the whole served module (``state``) on each push (up to
    ``MODULE_CHECKSUM_MAX_NUMEL`` elements) rather than only the pushed tensors."""
    return sum(t.numel() for t in state.values()) <= MODULE_CHECKSUM_MAX_NUMEL


def check_update(r) -> None:
    body = json_or_text(r)
    if r.status_code != 200 or not (isinstance(body, dict) and body.get("success")):
        raise SGLangServerError(f"update_weights_from_tensor refused (HTTP {r.status_code}): {body}")


def server_checksum(post: Post, module: str = "transformer") -> str:
    """The server's checksum of ``module`` (``/get_weights_checksum``)."""
    r = post("/get_weights_checksum", json={"module_names": [module]})
    if r.status_code != 200:
        raise SGLangServerError(f"get_weights_checksum failed (HTTP {r.status_code}): {json_or_text(r)}")
    return r.json()[module]


def expected_checksum(base_state: dict[str, torch.Tensor], dtype: torch.dtype, named: NamedTensors) -> str:
    """The transformer checksum the server should report: the base weights (floating ones in
    ``dtype``) with ``named`` laid over them."""
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in base_state.items()}
    state.update(dict(named))
    return weights_checksum(state)


def verify_pushed(post: Post, named: NamedTensors, base_state: dict[str, torch.Tensor], dtype: torch.dtype,
                  what: str, module_check: bool = True) -> None:
    """Each pushed tensor's SHA-256 on the server must equal ours (the server skips unknown
    names with a warning only); with ``module_check`` (small models: ``module_checksum_fits`` of the served
    state) also the whole-module checksum."""
    expected = {n: tensor_sha256(t) for n, t in named}
    r = post("/update_weights_from_tensor_checker",
             json={"target_module": "transformer", "expected_named_tensors_sha256": expected})
    body = json_or_text(r)
    if r.status_code != 200 or not (isinstance(body, dict) and body.get("success")):
        raise SGLangServerError(f"weight verification of {what} failed: the server's tensors differ from ours: {body}")
    if module_check:
        server, ours = server_checksum(post), expected_checksum(base_state, dtype, named)
        if server != ours:
            raise SGLangServerError(
                f"weight verification of {what} failed: module checksum {server} != expected {ours}"
            )
