"""Checkpoint manifests: the SHA-256 and size of every file of a checkpoint folder, checked on load.

``manifest.json`` is the last file written into a checkpoint folder, before the folder is renamed
into place (``run.checkpoint.save_checkpoint``) or, on an object store, the last file uploaded
(``run.folder.RunFolder.publish_checkpoint``). ``verify_checkpoint`` raises ``CheckpointDamaged``,
naming the folder and the file, when a file is missing, has another size or another hash.

Checkpoints written before manifests existed (``state.json`` format 1, no ``manifest.json``) are
accepted with a warning after a structural check (``state.json`` parses, every safetensors file is
as long as its header says): refusing them would strand every run folder written before this
change, and the check still catches a truncated file. A format-2 checkpoint without its manifest
is damaged. No torch import here: ``run.folder`` verifies pulled checkpoints with it.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

from diffusionrl.digest import file_sha256
from diffusionrl.errors import UserError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
LEGACY_FORMAT = 1  # state.json format without a manifest


class CheckpointDamaged(UserError):
    """A checkpoint's files are missing, truncated or do not match their recorded SHA-256."""

    def __init__(self, path: str | Path, reason: str, message: str | None = None):
        self.path, self.reason = Path(path), reason
        super().__init__(message or f"checkpoint {path} is damaged: {reason}")


def sha256_file(path: Path) -> str:
    return file_sha256(path).hexdigest()


def write_manifest(directory: str | Path) -> Path:
    """Record every file of ``directory`` (but the manifest) with its size and SHA-256."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    record = {
        "manifest_version": MANIFEST_VERSION,
        "files": {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                  for p in files},
    }
    path = directory / MANIFEST
    path.write_text(json.dumps(record, indent=1, sort_keys=True))
    return path


def _read_json(path: Path, directory: Path) -> dict:
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(directory, f"{path.name} is unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(record, dict):
        raise CheckpointDamaged(directory, f"{path.name} is not a JSON object")
    return record


def _safetensors_complete(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (its header says how long it is), or None."""
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > size - 8:
                return f"{size} bytes, shorter than its header (truncated)"
            header = json.loads(fh.read(length))
        end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"], default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"unreadable safetensors header ({type(exc).__name__})"
    if size != 8 + length + end:
        return f"{size} bytes, its header says {8 + length + end} (truncated)"
    return None


def verify_checkpoint(directory: str | Path) -> None:
    """Raise ``CheckpointDamaged`` unless every file of the checkpoint is whole and unchanged."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        state = directory / "state.json"
        if not state.is_file():
            raise CheckpointDamaged(directory, "no state.json and no manifest.json (not a complete checkpoint)")
        record = _read_json(state, directory)
        if record.get("format_version", LEGACY_FORMAT) != LEGACY_FORMAT:
            raise CheckpointDamaged(directory, f"{MANIFEST} is missing (state.json says format "
                                               f"{record.get('format_version')}, which always has one)")
        for f in sorted(directory.glob("*.safetensors")):
            why = _safetensors_complete(f)
            if why:
                raise CheckpointDamaged(directory, f"{f.name}: {why}")
        log.warning("checkpoint %s has no %s (written before checksums): loaded unverified", directory, MANIFEST)
        return
    files = _read_json(manifest, directory).get("files")
    if not isinstance(files, dict) or "state.json" not in files:
        raise CheckpointDamaged(directory, f"{MANIFEST} lists no state.json")
    for rel, entry in sorted(files.items()):
        path = directory / rel
        if not path.is_file():
            raise CheckpointDamaged(directory, f"{rel} is missing")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointDamaged(directory, f"{rel} has {size} bytes, {MANIFEST} says {entry.get('bytes')} "
                                               "(truncated or replaced)")
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointDamaged(directory, f"{rel} does not match its SHA-256 in {MANIFEST} (corrupted bytes)")
