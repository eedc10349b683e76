"""Which adapter serves a model reference, and loading its pipeline.

The family of a reference is read, never guessed from its name: a ``builtin:tiny-<family>`` names
its adapter's ``builtin``; a local folder's ``model_index.json`` and a hub id's (fetched alone, at
``revision`` with ``HF_TOKEN``) name the diffusers pipeline class (``_class_name``), which names
the adapter (``pipeline_class``). Adding a family: its adapter class in ``ADAPTERS``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import DTYPES, FlowAdapter, hf_token, resolve_device
from .flux import FluxAdapter
from .qwen_image import QwenImageAdapter
from .sd3 import SD3Adapter
from .wan import WanAdapter

ADAPTERS: tuple[type[FlowAdapter], ...] = (SD3Adapter, FluxAdapter, QwenImageAdapter, WanAdapter)


class UnknownModelFamily(ValueError):
    """The reference's pipeline class (or builtin name) has no adapter."""


def builtin_names() -> list[str]:
    return [name for a in ADAPTERS for name in a.builtins()]


def builtin_builder(reference: str):
    """The builder of a built-in model's pipeline; an unknown name fails naming the known ones."""
    for adapter in ADAPTERS:
        builder = adapter.builtins().get(reference)
        if builder is not None:
            return builder
    raise UnknownModelFamily(f"unknown builtin model {reference!r}; the built-in image models are "
                             f"{builtin_names()}")


def pipeline_class_of(reference: str, revision: str = "") -> str:
    """The diffusers pipeline class a reference holds (``_class_name`` of its ``model_index.json``)."""
    if reference.startswith("builtin:"):
        for adapter in ADAPTERS:
            if reference in adapter.builtins():
                return adapter.pipeline_class
        builtin_builder(reference)  # raises, naming the known ones
    path = Path(reference).expanduser()
    if path.exists():
        index = path / "model_index.json"
        if not index.is_file():
            raise ValueError(f"{path} is not a diffusers pipeline folder (no model_index.json)")
    else:
        from huggingface_hub import hf_hub_download

        index = Path(hf_hub_download(reference, "model_index.json", revision=revision or None, token=hf_token()))
    return str(json.loads(index.read_text()).get("_class_name", ""))


def adapter_class(reference: str, revision: str = "") -> type[FlowAdapter]:
    """The adapter class for ``reference`` (builtin name, folder or hub id)."""
    name = pipeline_class_of(reference, revision)
    for adapter in ADAPTERS:
        if adapter.pipeline_class == name:
            return adapter
    raise UnknownModelFamily(f"{reference!r} holds a {name or 'pipeline without _class_name'}; the supported "
                             f"pipelines are {[a.pipeline_class for a in ADAPTERS]}")


def load_pipeline(reference: str, revision: str = "", dtype: str = "float32"):
    """The family's diffusers pipeline from a builtin name, a local folder or a hub id.

    Hub ids are loaded with ``revision`` and ``HF_TOKEN`` (SD3.5 and FLUX.1-dev are gated). Under
    ``HF_HUB_OFFLINE=1`` only the local cache is consulted.
    """
    import diffusers

    adapter = adapter_class(reference, revision)
    torch_dtype = DTYPES[dtype]
    if reference.startswith("builtin:"):
        pipe = builtin_builder(reference)()
        return pipe.to(dtype=torch_dtype) if torch_dtype != torch.float32 else pipe
    cls = getattr(diffusers, adapter.pipeline_class)
    path = Path(reference).expanduser()
    if path.exists():
        return cls.from_pretrained(str(path), torch_dtype=torch_dtype)
    return cls.from_pretrained(reference, revision=revision or None, token=hf_token(), torch_dtype=torch_dtype)


def load_adapter(model_cfg, mixed_precision: str = "no") -> FlowAdapter:
    """The adapter of ``model_cfg.name`` (its family read from the reference), on ``model_cfg.device``."""
    adapter = adapter_class(model_cfg.name, model_cfg.revision)
    pipe = load_pipeline(model_cfg.name, model_cfg.revision, model_cfg.dtype)
    autocast = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]
    return adapter(pipe, device=resolve_device(model_cfg.device), autocast_dtype=autocast)


def save_builtin(reference: str, directory: str | Path) -> Path:
    """Write a builtin model as a diffusers folder (safetensors weights, JSON configs) that the
    stock pipeline class's ``from_pretrained`` loads."""
    directory = Path(directory)
    builtin_builder(reference)().save_pretrained(directory, safe_serialization=True)
    return directory
