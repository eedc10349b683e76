"""Which adapter serves a model reference, and loading its pipeline.

The family of a reference is read, never guessed from its name: a ``builtin:tiny-<family>`` names
its adapter's ``builtin``; a local folder's ``model_index.json`` and a hub id's (fetched alone, at
``revision`` with ``HF_TOKEN``) name the diffusers pipeline class (``_class_name``), which names
the adapter (``pipeline_class``). Adding a family: its adapter class in ``ADAPTERS``.

A reference is checked before any weights load (``local_folder``, ``check_model``): a mistyped
folder is "no such folder", never an invalid hub id; a folder without ``model_index.json``, with an
unknown pipeline class, a missing component folder or a truncated ``.safetensors`` file, a hub id the
hub does not know, and ``sampling.num_frames`` > 1 for an image family are each one line
(``ModelReferenceError``, a ``UserError``) naming the reference and the fix, instead of the
loader's traceback minutes later.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path

import torch

from diffusionrl.errors import UserError
from diffusionrl.hub import hf_token

from .base import DTYPES, FlowAdapter, dtype_kwargs, resolve_device
from .flux import FluxAdapter
from .flux2 import Flux2Adapter, Flux2KleinAdapter
from .flux_kontext import FluxKontextAdapter
from .qwen_image import QwenImageAdapter
from .qwen_image_edit import QwenImageEditAdapter, QwenImageEditV1Adapter
from .sd3 import SD3Adapter
from .truncation import no_progress_bars
from .wan import WanAdapter
from .zimage import ZImageAdapter

ADAPTERS: tuple[type[FlowAdapter], ...] = (SD3Adapter, FluxAdapter, QwenImageAdapter, WanAdapter, ZImageAdapter,
                                           Flux2Adapter, Flux2KleinAdapter, FluxKontextAdapter, QwenImageEditAdapter,
                                           QwenImageEditV1Adapter)


class ModelReferenceError(UserError):
    """A model reference (``model.name``, a fetched folder) that names nothing loadable."""

    kind = "model error"


class UnknownModelFamily(ModelReferenceError):
    """The reference's pipeline class (or builtin name) has no adapter."""


@functools.cache
def _by_family() -> dict[str, type[FlowAdapter]]:
    return {a.family: a for a in ADAPTERS}


def adapter_for_family(name: str) -> type[FlowAdapter]:
    """The adapter class whose ``family`` is ``name`` (a ``diffusionrl.json``'s or the planner's family name);
    an unknown name is ``UnknownModelFamily`` naming the known ones."""
    adapter = _by_family().get(name)
    if adapter is None:
        raise UnknownModelFamily(f"unknown model family {name!r}; the families are {sorted(_by_family())}")
    return adapter


def looks_like_path(reference: str) -> bool:
    """Whether ``reference`` is meant as a local folder rather than a hub id (``org/name``): it
    starts like a path (``/``, ``./``, ``../``, ``~``), has more than one ``/``, ends with one, holds
    the platform's separator where that is not ``/``, or its first part is a local folder."""
    if reference.startswith(("/", "./", "../", "~", ".\\", "..\\")) or reference in (".", ".."):
        return True
    if reference.count("/") > 1 or reference.endswith("/") or (os.sep != "/" and os.sep in reference):
        return True
    return "/" in reference and Path(reference.split("/", 1)[0]).is_dir()


def local_folder(reference: str, key: str = "model.name") -> Path | None:
    """The local diffusers folder ``reference`` names (checked to hold a ``model_index.json``), or
    None for a builtin name or a hub id (checked to be one). ``key`` names the setting in errors."""
    if reference.startswith("builtin:"):
        return None
    path = Path(reference).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelReferenceError(f"{key}={reference!r} is a file; give the diffusers pipeline folder that "
                                      "holds model_index.json")
        if not (path / "model_index.json").is_file():
            inner = sorted(p.parent for p in path.glob("*/model_index.json"))
            hint = f"; did you mean {str(inner[0])!r}?" if inner else (
                "; give the folder a pipeline's save_pretrained wrote (model_index.json beside its component folders)")
            raise ModelReferenceError(f"{key}={reference!r} is not a diffusers pipeline folder: no model_index.json "
                                      f"there{hint}")
        return path
    if looks_like_path(reference):
        raise ModelReferenceError(f"{key}={reference!r}: no such folder; fix the path, or give a hub id (org/name) "
                                  f"or one of {builtin_names()}")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(reference)
    except HFValidationError:
        raise ModelReferenceError(f"{key}={reference!r} is neither a local folder (none there) nor a hub id "
                                  f"(org/name); fix it, or use one of {builtin_names()}") from None
    return None


def model_index(reference: str, revision: str = "", key: str = "model.name") -> dict:
    """The parsed ``model_index.json`` of a local folder or hub id (fetched alone)."""
    folder = local_folder(reference, key)
    if folder is not None:
        index = folder / "model_index.json"
    else:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        at = f"{reference}@{revision}" if revision else reference
        try:
            index = Path(hf_hub_download(reference, "model_index.json", revision=revision or None, token=hf_token()))
        except GatedRepoError:
            raise ModelReferenceError(f"{key}={at} is a gated hub model: accept its licence on the hub and set "
                                      "HF_TOKEN") from None
        except RepositoryNotFoundError:
            raise ModelReferenceError(f"{key}={at}: no such hub model (or a private one: set HF_TOKEN); check the "
                                      "id, or give a local folder") from None
        except RevisionNotFoundError:
            raise ModelReferenceError(f"{key}={at}: the hub model has no revision {revision!r}; fix "
                                      "model.revision") from None
        except RemoteEntryNotFoundError:
            raise ModelReferenceError(f"{key}={at} holds no model_index.json: not a diffusers pipeline; give a "
                                      "diffusers-format model") from None
        except LocalEntryNotFoundError:
            offline = getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)()
            if not offline:
                raise  # the hub did not answer and nothing is cached: a network fault, retryable
            raise ModelReferenceError(f"{key}={at} is not in the local hub cache and HF_HUB_OFFLINE is set; "
                                      "download it once without HF_HUB_OFFLINE, or give a local folder") from None
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelReferenceError(f"{key}={reference!r}: {index} is not valid JSON ({exc}); re-save the "
                                  "pipeline") from None
    if not isinstance(data, dict):
        raise ModelReferenceError(f"{key}={reference!r}: {index} is not a JSON object; re-save the pipeline")
    return data


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a ``.safetensors`` file, read from its header alone (cheap for any size):
    None when the header parses and the file is as long as the tensors it lists."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short to be safetensors"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"truncated ({size} bytes, its header alone says {n + 8})"
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "its header is not safetensors JSON"
    if not isinstance(header, dict):
        return "its header is not safetensors JSON"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets") or ()) == 2]
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"truncated ({size} bytes of {need})"
    return None


def check_weights(folder: Path, key: str = "model.name") -> None:
    """Every component folder ``model_index.json`` lists is there, every shard its
    ``*.safetensors.index.json`` names is there, and no ``.safetensors`` file is truncated."""
    index = json.loads((folder / "model_index.json").read_text())
    for name, spec in index.items():
        if (not name.startswith("_") and isinstance(spec, list) and len(spec) == 2 and None not in spec
                and not (folder / name).is_dir()):
            raise ModelReferenceError(f"{key}={str(folder)!r}: model_index.json lists the component {name!r} but "
                                      f"there is no {name}/ folder; copy the whole pipeline folder")
    for shard_index in sorted(folder.glob("*/*.safetensors.index.json")):
        try:
            shards = set(json.loads(shard_index.read_text()).get("weight_map", {}).values())
        except (json.JSONDecodeError, AttributeError):
            raise ModelReferenceError(f"{key}={str(folder)!r}: {shard_index} is not a shard index; re-download or "
                                      "re-save the model") from None
        missing = sorted(s for s in shards if not (shard_index.parent / s).is_file())
        if missing:
            raise ModelReferenceError(f"{key}={str(folder)!r}: {shard_index.parent.name}/{missing[0]} is missing "
                                      f"({len(missing)} of {len(shards)} shards); re-download or re-save the model")
    for path in sorted(folder.glob("*/*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            raise ModelReferenceError(f"{key}={str(folder)!r}: {path.relative_to(folder)} is damaged ({problem}); "
                                      "re-download or re-save the model")


def check_model(reference: str, revision: str = "", num_frames: int = 1,
                key: str = "model.name") -> type[FlowAdapter]:
    """The adapter class of ``reference``, after the checks that need no weights loaded: the
    reference itself (``local_folder``), its pipeline class, a local folder's files
    (``check_weights``) and ``sampling.num_frames`` against the family (1 for an image model)."""
    adapter = adapter_class(reference, revision, key)
    folder = local_folder(reference, key)
    if folder is not None:
        check_weights(folder, key)
    if not getattr(adapter, "video", False) and num_frames != 1:
        from diffusionrl.config import ConfigError

        raise ConfigError(f"sampling.num_frames={num_frames}, but {reference} is an image model ({adapter.family}); "
                          "set sampling.num_frames=1, or use a video model (e.g. builtin:tiny-wan)")
    return adapter


def two_experts(reference: str, revision: str = "", key: str = "model.name") -> bool:
    """Whether ``reference`` holds two experts (Wan2.2 A14B: ``transformer_2`` and ``boundary_ratio`` in its
    ``model_index.json``; a builtin: its adapter's ``two_expert_builtins``), read without the weights."""
    if reference.startswith("builtin:"):
        return any(reference in getattr(a, "two_expert_builtins", ()) for a in ADAPTERS)
    index = model_index(reference, revision, key)
    second = index.get("transformer_2")
    return isinstance(second, list) and bool(second) and second[0] is not None and \
        index.get("boundary_ratio") is not None


def check_guidance_2(cfg, reference: str, key: str = "model.name") -> None:
    """``sampling.guidance_scale_2`` and ``eval.guidance_scale_2`` (the low-noise expert's CFG scale) only
    for a model with two experts: elsewhere one line naming the key."""
    for section in ("sampling", "eval"):
        value = getattr(cfg, section).guidance_scale_2
        if value and not two_experts(reference, cfg.model.revision, key):
            from diffusionrl.config import ConfigError

            raise ConfigError(f"{section}.guidance_scale_2={value:g}: {key}={reference!r} has one transformer, not "
                              f"two experts (Wan2.2 A14B); set {section}.guidance_scale_2=0")


def builtin_names() -> list[str]:
    return [name for a in ADAPTERS for name in a.builtins()]


def builtin_builder(reference: str):
    """The builder of a built-in model's pipeline; an unknown name fails naming the known ones."""
    for adapter in ADAPTERS:
        builder = adapter.builtins().get(reference)
        if builder is not None:
            return builder
    raise UnknownModelFamily(f"unknown builtin model {reference!r}; the built-in models are {builtin_names()}")


def pipeline_class_of(reference: str, revision: str = "", key: str = "model.name") -> str:
    """The diffusers pipeline class a reference holds (``_class_name`` of its ``model_index.json``)."""
    if reference.startswith("builtin:"):
        for adapter in ADAPTERS:
            if reference in adapter.builtins():
                return adapter.pipeline_class
        builtin_builder(reference)  # raises, naming the known ones
    return str(model_index(reference, revision, key).get("_class_name", ""))


def adapter_class(reference: str, revision: str = "", key: str = "model.name") -> type[FlowAdapter]:
    """The adapter class for ``reference`` (builtin name, folder or hub id)."""
    name = pipeline_class_of(reference, revision, key)
    for adapter in ADAPTERS:
        if adapter.pipeline_class == name:
            return adapter
    raise UnknownModelFamily(f"{key}={reference!r} holds a {name or 'pipeline without _class_name'}; the supported "
                             f"pipelines are {[a.pipeline_class for a in ADAPTERS]}: use one of those or a builtin")


def lora_suffixes(model_cfg) -> list[str]:
    """The LoRA target suffixes ``model_cfg.lora_targets`` means: as listed, or where it is empty the
    family's own (its adapter's ``default_lora_targets``): what a checkpoint's metadata records, so a run
    that spells its family's default resumes one that left it empty and the other way round."""
    if model_cfg.lora_targets:
        return list(model_cfg.lora_targets)
    return list(_default_suffixes(model_cfg.name, model_cfg.revision))


@functools.lru_cache(maxsize=32)
def _default_suffixes(reference: str, revision: str) -> tuple[str, ...]:
    """The family's default LoRA targets, its ``model_index.json`` read once per process (every checkpoint's
    metadata asks)."""
    return tuple(adapter_class(reference, revision).lora_suffixes([]))


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
    path = local_folder(reference)
    with no_progress_bars():
        if path is not None:
            check_weights(path)  # a truncated file is one line here, not the loader's traceback
            return cls.from_pretrained(str(path), **dtype_kwargs(torch_dtype))
        return cls.from_pretrained(reference, revision=revision or None, token=hf_token(), **dtype_kwargs(torch_dtype))


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
    with no_progress_bars():
        builtin_builder(reference)().save_pretrained(directory, safe_serialization=True)
    return directory
