"""Checkpoint manifests: the SHA-256 and size of every file of a checkpoint folder, checked on load.

``manifest.json`` is the last file written into a checkpoint folder, before the folder is renamed
into place (``run.checkpoint.save_checkpoint``) or, on an object store, the last file uploaded
(``run.folder.RunFolder.publish_checkpoint``). ``verify_checkpoint`` raises ``CheckpointDamaged``,
naming the folder and the file, when a file is missing (the manifest included: a checkpoint without
one is incomplete), has another size or another hash. No torch import here: ``run.folder``
verifies pulled checkpoints with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusionrl.digest import file_sha256
from diffusionrl.errors import UserError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


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


def verify_checkpoint(directory: str | Path) -> None:
    """Raise ``CheckpointDamaged`` unless every file of the checkpoint is whole and unchanged."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise CheckpointDamaged(directory, f"{MANIFEST} is missing (written last, so the save or copy did not finish): "
                                           "copy the whole folder again or resume from another checkpoint")
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
