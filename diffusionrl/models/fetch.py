"""Resolve a model reference to a local diffusers folder plus a content digest.

- ``builtin:tiny-sd3``, ``builtin:tiny-flux``, ``builtin:tiny-qwen-image``: written in code;
  ``builtin:tiny-sd3-shapes``: from the weights this package ships (no download);
- a local folder: used in place (checked to be a diffusers pipeline folder with intact weights; a
  path that is not there is "no such folder", ``families.local_folder``);
- a hub id (``stabilityai/stable-diffusion-3.5-medium``): ``snapshot_download`` at ``revision``
  with ``HF_TOKEN`` (gated models); the token is passed to the hub client only, never logged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from diffusionrl.digest import file_sha256
from diffusionrl.hub import hf_token

from .families import adapter_class, check_weights, local_folder, save_builtin

log = logging.getLogger(__name__)

# What a diffusers pipeline (SD3, FLUX) needs; skips the single-file checkpoints hubs also hold.
ALLOW_PATTERNS = ["model_index.json", "*/config.json", "*/*.safetensors", "*/*.safetensors.index.json",
                  "scheduler/*", "tokenizer*/*", "*/generation_config.json"]


def folder_digest(folder: str | Path) -> str:
    """sha256 over (relative path, bytes) of every file, in path order."""
    folder = Path(folder)
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel.startswith(".cache/") or "/.cache/" in rel:
            continue
        h.update(rel.encode() + b"\x00")
        file_sha256(path, into=h)
    return h.hexdigest()


def fetch_model(reference: str, revision: str, dest: str | Path) -> Path:
    """A local diffusers folder for ``reference`` (``dest`` is used for builtin and hub models)."""
    dest = Path(dest)
    if reference.startswith("builtin:"):
        adapter_class(reference)  # an unknown builtin name fails here, naming the known ones
        return save_builtin(reference, dest)
    path = local_folder(reference)
    if path is not None:
        adapter_class(reference)  # a folder of an unsupported pipeline fails before anything reads it
        check_weights(path)
        return path
    from huggingface_hub import snapshot_download

    adapter_class(reference, revision)  # model_index.json alone first: an unknown id or family costs no download
    log.info("downloading %s@%s", reference, revision or "main")
    folder = Path(
        snapshot_download(reference, revision=revision or None, token=hf_token(), local_dir=str(dest),
                          allow_patterns=ALLOW_PATTERNS)
    )
    check_weights(folder)
    return folder


def cache_root() -> Path:
    """Where built-in models are kept for later readers (``$DIFFUSIONRL_CACHE``, else ~/.cache/diffusionrl)."""
    return Path(os.environ.get("DIFFUSIONRL_CACHE", "~/.cache/diffusionrl")).expanduser()


def base_model_reference(reference: str, fetched: str | Path, digest: str) -> str:
    """The base-model reference a registered LoRA records (``mlflow.diffusers``' ``base_model``):
    the hub id, an absolute local folder, or for a built-in model a persistent copy of the fetched
    folder under the cache (``<cache>/models/tiny-sd3-<digest>``), so it loads offline later."""
    if reference.startswith("builtin:"):
        dest = cache_root() / "models" / f"{reference.removeprefix('builtin:')}-{digest[:16]}"
        if not (dest / "model_index.json").is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=dest.parent))
            shutil.copytree(fetched, tmp / "model")
            try:
                (tmp / "model").rename(dest)
            except OSError:  # written concurrently by another run: theirs is the same folder
                shutil.rmtree(tmp / "model", ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
        return str(dest)
    path = Path(reference).expanduser()
    return str(path.resolve()) if path.exists() else reference
