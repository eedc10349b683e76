"""Resumable checkpoints: safetensors for tensors, JSON for the rest, never pickles.

Layout of a checkpoint folder ``step-000012/``::

    state.json             step, policy version, metadata, optimizer hyper-parameters, RNG states
    lora.safetensors       trainable LoRA tensors (policy ``named_parameters`` names)
    optimizer.safetensors  per-parameter optimizer state ("<index>.<key>")
    extra.safetensors      EMA / old-policy tensors ("ema.<name>", "old.<name>") and torch RNG states

A folder is written under a temporary name and renamed when complete, so a crash mid-save never
leaves a half checkpoint that looks valid.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1


class CheckpointMismatch(ValueError):
    """A checkpoint was made for another model or objective than the current run."""


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
    for idx, values in meta.get("scalars", {}).items():
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
    save_file({k: v.detach().cpu().contiguous() for k, v in state.lora.items()}, str(tmp / "lora.safetensors"))
    opt_tensors, opt_meta = _optimizer_split(state.optimizer)
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
        "optimizer": opt_meta,
        "scaler": state.scaler,
        "rng": rng_meta,
        "tensor_groups": sorted(state.tensors),
        "extra": state.extra,
    }
    (tmp / "state.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


def load_checkpoint(directory: str | Path, restore_rng: bool = True) -> CheckpointState:
    directory = Path(directory)
    record_path = directory / "state.json"
    if not record_path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint (no state.json)")
    record = json.loads(record_path.read_text())
    if record.get("format_version") != FORMAT_VERSION:
        raise CheckpointMismatch(
            f"{directory}: checkpoint format {record.get('format_version')} is not {FORMAT_VERSION}"
        )
    extra = load_file(str(directory / "extra.safetensors"))
    groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in record.get("tensor_groups", [])}
    rng: dict[str, torch.Tensor] = {}
    for key, value in extra.items():
        group, name = key.split(".", 1)
        (rng if group == "rng" else groups.setdefault(group, {}))[name] = value
    if restore_rng:
        _set_rng_state(rng, record.get("rng", {}))
    return CheckpointState(
        step=int(record["step"]),
        policy_version=int(record["policy_version"]),
        metadata=record["metadata"],
        lora=load_file(str(directory / "lora.safetensors")),
        optimizer=_optimizer_join(load_file(str(directory / "optimizer.safetensors")), record["optimizer"]),
        scaler=record.get("scaler", {}),
        tensors=groups,
        extra=record.get("extra", {}),
    )


def check_metadata(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Fail closed when the identity keys (model, objective) differ."""
    diffs = [
        f"{key}: checkpoint has {saved.get(key)!r}, this run has {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if diffs:
        raise CheckpointMismatch(
            f"cannot resume from {where}: it was made for another model or objective:\n  "
            + "\n  ".join(diffs)
            + "\nstart a fresh run (another output folder) or resume with the checkpoint's settings"
        )


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and (p / "state.json").is_file())


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root: str | Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
