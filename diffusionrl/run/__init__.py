"""A training run's machinery, whatever it trains: the loop, its checkpoints and its folder.

- ``loop``: ``RunLoop`` (run, resume, checkpoint cadence, ``metrics.jsonl``, callbacks), the
  ``Backend`` protocol, ``Schedule``, ``RunResult``;
- ``callbacks``: ``Callback``, the hooks callers attach to a run (no torch import);
- ``checkpoint``: safetensors + JSON checkpoints, their metadata and config checks (fail closed);
- ``manifest``: each checkpoint's file sizes and SHA-256 (``CheckpointDamaged``);
- ``folder``: ``RunFolder``, a run's folder as a local path or an object-store URI, and the
  ``SyncRunFolder`` callback;
- ``lock``: one run per run folder (``hold_run_folder``; ``RunFolderBusy``); ``lock_check.check_free``, the
  same refusal from a read-only look.

The names other modules import are re-exported here. Those of ``loop`` and ``checkpoint`` load on
first use: those modules import torch, which a caller that only needs a ``Callback`` or the run
folder (the Flyte tasks, ``tracking``) never did.
"""

from .callbacks import Callback
from .folder import (
    RunFolder,
    RunFolderError,
    SyncRunFolder,
    check_local_out,
    check_run_folder,
    check_store_access,
    is_remote,
    local_copy,
    local_path,
    write_text,
)
from .lock import RunFolderBusy, RunFolderLost, RunOwner, hold_run_folder
from .lock_check import check_free
from .manifest import CheckpointDamaged, verify_checkpoint, write_manifest

_LOOP = ("RUN_CONTROL_KEYS", "RunLoop", "RunResult", "Schedule")
_CHECKPOINT = ("CheckpointMismatch", "CheckpointState", "ConfigChanged", "latest_checkpoint")

__all__ = [
    "Callback", "CheckpointDamaged", "RunFolder", "RunFolderBusy", "RunFolderError", "RunFolderLost", "RunOwner",
    "SyncRunFolder", "check_free", "check_local_out", "check_run_folder", "check_store_access", "hold_run_folder",
    "is_remote", "local_copy", "local_path", "verify_checkpoint", "write_manifest", "write_text", *_LOOP, *_CHECKPOINT,
]


def __getattr__(name: str):
    if name in _LOOP:
        from . import loop

        return getattr(loop, name)
    if name in _CHECKPOINT:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
