"""Resumable checkpoints: safetensors for tensors, JSON for the rest, never pickles.

Layout of a checkpoint folder ``step-000012/``::

    state.json             step, policy version, metadata, the run's config and input digests,
                           optimizer hyper-parameters, RNG states
    lora.safetensors       trainable LoRA tensors (policy ``named_parameters`` names)
    optimizer.safetensors  per-parameter optimizer state ("<index>.<key>")
    extra.safetensors      EMA / old-policy tensors ("ema.<name>", "old.<name>") and torch RNG states
    sharded/               train.checkpoint_format=sharded: each rank's shards of the LoRA (or full weights),
                           optimizer, EMA and old-policy tensors (``distributed.sharded``, DCP) in place of
                           those tensors in the files above; state.json's "sharded" says so
    manifest.json          size and SHA-256 of every other file, written last (``diffusionrl.run.manifest``)

A folder is written under a temporary name and renamed when complete, so a crash mid-save never
leaves a half checkpoint that looks valid; the manifest catches what the rename cannot (bytes
damaged later, a partial copy). ``load_checkpoint`` verifies it and names the damaged file (a folder
without its manifest is damaged too), and refuses a ``state.json`` of another format or without one
of the keys above (``CheckpointMismatch``, one line); ``latest_checkpoint`` / ``load_latest`` skip a
damaged checkpoint with one warning line and take the previous intact one.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from diffusionrl.errors import UserError

from .manifest import CheckpointDamaged, verify_checkpoint, write_manifest

__all__ = ["CheckpointDamaged", "CheckpointMismatch", "CheckpointState", "ConfigChanged", "config_changes",
           "input_changes", "load_checkpoint", "load_latest", "latest_checkpoint", "list_checkpoints",
           "save_checkpoint"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # state.json's format_version: the format save_checkpoint writes, the one load_checkpoint reads
STATE_KEYS = ("step", "policy_version", "metadata", "config", "inputs", "optimizer", "scaler", "rng", "tensor_groups",
              "extra")  # what save_checkpoint writes into state.json besides format_version
NAME = re.compile(r"step-\d+")
SHARDED = "sharded"  # a sharded checkpoint's DCP folder


class CheckpointMismatch(UserError):
    """A checkpoint was made for another model or objective than the current run, or in another format."""


class ConfigChanged(CheckpointMismatch):
    """Resuming with other objective-relevant settings than the checkpoint was made with."""


@dataclass
class CheckpointState:
    step: int  # number of completed RL steps
    policy_version: int
    metadata: dict[str, Any]
    lora: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # "ema", "old", ...
    extra: dict[str, Any] = field(default_factory=dict)  # JSON-able loop state (data cursor, ...)
    config: dict[str, Any] = field(default_factory=dict)  # the run's config (``Config.to_dict()``)
    # digests of the data behind the config's paths (``{"prompts": ..., "init_lora": ...}``)
    inputs: dict[str, str] = field(default_factory=dict)
    # train.checkpoint_format=sharded (``lora`` and ``optimizer`` then empty): on save, a function writing the
    # shards into the folder it is given and returning what state.json records of them; on load, that record
    # with the shards' ``folder``
    write_shards: Callable[[Path], dict[str, Any]] | None = None
    sharded: dict[str, Any] | None = None


def _optimizer_split(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for idx, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _optimizer_join(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    if "torch_cpu" in tensors:
        torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if "python" in meta:
        v, s, g = meta["python"]
        random.setstate((v, tuple(s), g))
    if "numpy" in meta:
        name, keys, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(directory: str | Path, state: CheckpointState) -> Path:
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    sharded = None
    if state.write_shards is not None:
        (tmp / SHARDED).mkdir()
        sharded = state.write_shards(tmp / SHARDED)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.lora.items()}, str(tmp / "lora.safetensors"))
    opt_tensors, opt_meta = _optimizer_split(state.optimizer) if state.optimizer else ({}, {})
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    rng_tensors, rng_meta = _rng_state()
    extra = {f"rng.{k}": v for k, v in rng_tensors.items()}
    for group, tensors in state.tensors.items():
        extra.update({f"{group}.{k}": v.detach().cpu().contiguous() for k, v in tensors.items()})
    save_file(extra, str(tmp / "extra.safetensors"))
    record = {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "policy_version": state.policy_version,
        "metadata": state.metadata,
        "config": state.config,
        "inputs": state.inputs,
        "optimizer": opt_meta,
        "scaler": state.scaler,
        "rng": rng_meta,
        "tensor_groups": sorted(state.tensors),
        "extra": state.extra,
    }
    if sharded is not None:
        record["sharded"] = sharded
    (tmp / "state.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    write_manifest(tmp)  # last: a folder with a valid manifest is complete
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


def _load(directory: Path, name: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(directory / name))
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:  # damage load_checkpoint(verify=False) lets by
        raise CheckpointDamaged(directory, f"{name} is unreadable ({type(exc).__name__}: {exc})") from exc


def load_checkpoint(directory: str | Path, restore_rng: bool = True, verify: bool = True) -> CheckpointState:
    """The checkpoint in ``directory``, its files verified against its manifest first
    (``CheckpointDamaged`` names the damaged file)."""
    directory = Path(directory)
    record_path = directory / "state.json"
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a checkpoint (no such folder)")
    if verify:  # an empty or half-copied step-N/ has no manifest: damaged, so that load_latest falls back past it
        verify_checkpoint(directory)
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(directory, f"state.json is unreadable ({type(exc).__name__}: {exc})") from exc
    missing = [k for k in STATE_KEYS if k not in record]
    if record.get("format_version") != FORMAT_VERSION or missing:
        raise CheckpointMismatch(
            f"{record_path}: checkpoint format {record.get('format_version')}"
            f"{' without ' + ', '.join(missing) if missing else ''}, not the format {FORMAT_VERSION} (with "
            f"{', '.join(STATE_KEYS)}) this version reads; resume from a checkpoint it wrote or start over (--fresh)")
    extra = _load(directory, "extra.safetensors")
    groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in record["tensor_groups"]}
    rng: dict[str, torch.Tensor] = {}
    for key, value in extra.items():
        group, name = key.split(".", 1)
        (rng if group == "rng" else groups.setdefault(group, {}))[name] = value
    lora = _load(directory, "lora.safetensors")
    sharded, optimizer = record.get("sharded"), {}
    if sharded is not None:  # the tensors are in sharded/ (read by the worker that loads them)
        sharded = {**sharded, "folder": str(directory / SHARDED)}
    else:
        optimizer = _optimizer_join(_load(directory, "optimizer.safetensors"), record["optimizer"])
    if restore_rng:
        _set_rng_state(rng, record["rng"])
    return CheckpointState(
        step=int(record["step"]),
        policy_version=int(record["policy_version"]),
        metadata=record["metadata"],
        lora=lora,
        optimizer=optimizer,
        scaler=record["scaler"],
        tensors=groups,
        extra=record["extra"],
        config=record["config"],
        inputs=record["inputs"],
        sharded=sharded,
    )


def check_metadata(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Fail closed when the identity keys (model, objective) differ: one line naming them."""
    diffs = [
        f"{key}: checkpoint has {saved.get(key)!r}, this run has {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if diffs:
        raise CheckpointMismatch(
            f"cannot resume from {where}: it was made for another model or objective ({'; '.join(diffs)}); "
            "start a fresh run (another output folder, or --fresh) or resume with the checkpoint's settings"
        )


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """``{"train": {"seed": 0}}`` -> ``{"train.seed": 0}``, the names of ``Config.flat()``."""
    out: dict[str, Any] = {}
    for section, values in config.items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            out[section] = values
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any], free: tuple[str, ...]) -> dict[str, dict]:
    """``{key: {"old", "new"}}`` for every flat key both configs have, whose value differs, and that
    matches none of the ``free`` patterns (fnmatch). A key only one side has (the schema gained
    or lost it) is not compared. Both go through JSON first, as the saved one did (tuple == list)."""
    a, b = (flat_config(json.loads(json.dumps(c))) for c in (saved, current))
    return {k: {"old": a[k], "new": b[k]} for k in sorted(set(a) & set(b))
            if a[k] != b[k] and not any(fnmatch.fnmatchcase(k, p) for p in free)}


def input_changes(saved: dict[str, str], current: dict[str, str]) -> dict[str, dict]:
    """``{"inputs.<name>": {"old", "new"}}`` for every input (prompts, SFT pairs, initial LoRA) both
    sides recorded whose digest differs: the data behind an unchanged path changed. An input only
    one side has (an input added or dropped by a config change, which ``config_changes`` reports)
    is not compared."""
    return {f"inputs.{k}": {"old": saved[k], "new": current[k]} for k in sorted(set(saved) & set(current))
            if saved[k] != current[k]}


def with_hyperparameters(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state ``saved`` with the hyper-parameters (lr, betas, weight decay, ...) of the
    freshly built optimizer's state ``current``: what an allowed config change must take effect on
    (``load_state_dict`` would bring the checkpoint's back)."""
    groups = [{**old, **{k: v for k, v in new.items() if k != "params"}}
              for old, new in zip(saved["param_groups"], current["param_groups"])]
    return {**saved, "param_groups": groups}


def list_checkpoints(root: str | Path) -> list[Path]:
    """The checkpoint folders (``step-NNNNNN``) of ``root``, oldest first, whole or damaged."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and NAME.fullmatch(p.name))


def _no_intact(root: Path, damaged: list[CheckpointDamaged]) -> CheckpointDamaged:
    reasons = "; ".join(f"{e.path.name}: {e.reason}" for e in damaged)
    return CheckpointDamaged(root, reasons, f"no intact checkpoint in {root} ({reasons}); restore one, or start "
                                            "over with --fresh (resume=None), which moves them aside")


def _skip(exc: CheckpointDamaged) -> None:
    log.warning("skipping damaged checkpoint %s: %s; trying the previous one", exc.path.name, exc.reason)


def _newest_intact(root: str | Path, open_one):
    """``open_one(path)`` of the newest checkpoint of ``root`` it succeeds on; a damaged one (or one with a
    file this user may not read) is reported in one warning line and skipped; None when there is none;
    ``CheckpointDamaged`` when every one is damaged."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        try:
            try:
                return open_one(path)
            except PermissionError as exc:  # unreadable by this user: as useless to a resume as a damaged one
                name = Path(exc.filename).name if exc.filename else "a file"
                raise CheckpointDamaged(path, f"{name} is not readable by this user (permission denied; chmod/chown "
                                              "it to resume from it)") from exc
        except CheckpointDamaged as exc:
            _skip(exc)
            damaged.append(exc)
    if damaged:
        raise _no_intact(Path(root), damaged)
    return None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest intact checkpoint of ``root`` (its files match the manifest)."""

    def verified(path: Path) -> Path:
        verify_checkpoint(path)
        return path

    return _newest_intact(root, verified)


def load_latest(root: str | Path, restore_rng: bool = True) -> tuple[Path, CheckpointState] | None:
    """``latest_checkpoint`` and its state, also skipping a checkpoint whose files do not parse."""
    return _newest_intact(root, lambda path: (path, load_checkpoint(path, restore_rng=restore_rng)))


def prune_checkpoints(root: str | Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
