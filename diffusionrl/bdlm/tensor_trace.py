"""Parquet form of the pipeline traces (DiffusionGemma ``CanvasTrace``, LLaDA2 ``WindowTrace``).

One file per RL step (``traces/step-XXXXXX.parquet``, the same atomic write and page checksums as
the other traces), one row per sample. Every per-sample tensor field is a flattened list column
whose per-row shape and dtype are in the file metadata (``diffusionrl.fields``); the scalars
(temperature, micro-batch size, ...) are metadata too, the temperature as a JSON float (exact:
the replay divides by it). ``diffusionrl.kind`` names the trace class; ``read_tensor_trace`` gives
back a validated trace that replays like the original (tested).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from diffusionrl.trajectory import read_parquet, write_parquet

from .model import Vocab

SCHEMA_VERSION = 1
KINDS = {"bdlm_canvas_trace": ("gemma_rollout", "CanvasTrace"), "bdlm_window_trace": ("llada2", "WindowTrace")}
ARROW = {torch.int64: pa.int64(), torch.bool: pa.bool_(), torch.float32: pa.float32()}


def _kind_of(trace) -> str:
    for kind, (_, cls) in KINDS.items():
        if type(trace).__name__ == cls:
            return kind
    raise TypeError(f"no Parquet form for {type(trace).__name__}")


def _class(kind: str):
    import importlib

    module, cls = KINDS[kind]
    return getattr(importlib.import_module(f"diffusionrl.bdlm.{module}"), cls)


def write_tensor_trace(directory: str | Path, trace, *, run_id: str, step: int) -> Path:
    """``directory/step-XXXXXX.parquet`` (atomic); the trace must be scored (rewards, advantages)."""
    if trace.rewards is None or trace.advantages is None:
        raise ValueError("write_tensor_trace needs a scored trace (rewards and advantages)")
    b = trace.batch_size
    cols: dict[str, pa.Array] = {"run_id": pa.array([run_id] * b, pa.string()),
                                 "step": pa.array([step] * b, pa.int64()),
                                 "sample_index": pa.array(range(b), pa.int32())}
    fields, scalars = {}, {}
    for f in dataclasses.fields(trace):
        value = getattr(trace, f.name)
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == b:
            flat = value.detach().cpu().reshape(b, -1).numpy()
            cols[f.name] = pa.array(list(flat), pa.list_(ARROW[value.dtype]))
            fields[f.name] = {"shape": list(value.shape[1:]), "dtype": str(value.dtype).removeprefix("torch.")}
        elif f.name == "reward_components":
            for name, v in sorted(value.items()):
                cols[f"reward_{name}"] = pa.array(v.float().numpy(), pa.float32())
        elif f.name == "metadata":
            meta = value or [{}] * b
            cols["metadata_json"] = pa.array([json.dumps(m, sort_keys=True, default=str) for m in meta], pa.string())
        elif f.name == "vocab":
            scalars["vocab"] = dataclasses.asdict(value)
        elif value is None or isinstance(value, (int, float, str)):
            scalars[f.name] = value
    table = pa.table(cols)
    kv = {b"diffusionrl.trace_schema_version": str(SCHEMA_VERSION).encode(),
          b"diffusionrl.kind": _kind_of(trace).encode(),
          b"diffusionrl.fields": json.dumps(fields).encode(), b"diffusionrl.scalars": json.dumps(scalars).encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **kv})
    return write_parquet(table, Path(directory) / f"step-{step:06d}.parquet")


def read_tensor_trace(path: str | Path):
    """One step file back into its (validated) trace class."""
    table = read_parquet(path)
    kv = table.schema.metadata or {}
    kind = kv.get(b"diffusionrl.kind", b"").decode()
    if kind not in KINDS:
        raise ValueError(f"{path} is not a pipeline trace file (diffusionrl.kind is {kind!r})")
    version = int(kv.get(b"diffusionrl.trace_schema_version", b"0"))
    if version != SCHEMA_VERSION:
        raise ValueError(f"{path}: trace schema version {version}, this reader knows {SCHEMA_VERSION}")
    fields = json.loads(kv[b"diffusionrl.fields"])
    scalars = json.loads(kv[b"diffusionrl.scalars"])
    d = table.to_pydict()
    b = len(d["sample_index"])
    values = {}
    for name, spec in fields.items():
        dtype = getattr(torch, spec["dtype"])
        values[name] = torch.from_numpy(np.asarray(d[name])).to(dtype).reshape(b, *spec["shape"])
    values["reward_components"] = {c[len("reward_"):]: torch.tensor(d[c], dtype=torch.float32)
                                   for c in d if c.startswith("reward_")}
    values["metadata"] = [json.loads(m) for m in d["metadata_json"]]
    values["vocab"] = Vocab(**scalars.pop("vocab"))
    values.update(scalars)
    return _class(kind)(**values)
