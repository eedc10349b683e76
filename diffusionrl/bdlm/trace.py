"""The trace contract between rollout and learner, and its Parquet form (schema in docs/bdlm.md).

A ``TraceBatch`` is everything the learner needs to score every action exactly: the final canvas
(``targets``), the global step at which each position was committed (``action_steps``), the
per-token loss weights and the prompt layout. It is validated when built, so a malformed batch
fails at the producer, not as a silent wrong gradient.

Parquet: one file per RL step (``traces/step-XXXXXX.parquet``), one row per sample, written with
pyarrow and readable with plain pandas, like the image trajectories: the same reader API
(``write_step``, ``list_step_files``, ``read_trace``, ``read_traces``), a schema version in the
file's key-value metadata (``diffusionrl.trace_schema_version``) and in a column, and the same page
checksums (a damaged file fails naming it and its step: ``CorruptParquetFile``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from diffusionrl.trajectory import read_parquet, write_parquet

from .model import VOCAB, Vocab

SCHEMA_VERSION = 1
KIND = "bdlm_trace"


class TraceError(ValueError):
    """A trace batch violates the contract (shapes, dtypes, steps, weights, layout)."""


@dataclass
class TraceBatch:
    targets: torch.Tensor  # [B, L] int64: final canvas, prompt region then generated tokens
    action_steps: torch.Tensor  # [B, L] int64: commit step, -1 for prompt and padding
    loss_weights: torch.Tensor  # [B, L] float32: finite, >= 0, zero where action_steps == -1
    log_probs: torch.Tensor  # [B, L] float32: sampler's log-prob of each committed token (0 at -1)
    prompt_length: int  # P: positions [0, P) are the (left-padded) prompt, [P, L) are generated
    temperature: float  # T of the proposals the log-probs were taken under
    group_ids: torch.Tensor  # [B] int64
    seeds: torch.Tensor  # [B] int64 (-1: greedy)
    micro_batch_size: int  # rows per forward in the rollout; replay keeps this composition
    policy_version: int = 0
    rewards: torch.Tensor | None = None  # [B] float32
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B]
    advantages: torch.Tensor | None = None  # [B] float32
    metadata: list[dict] | None = None  # per-row JSON-able info (prompt text, answer)
    vocab: Vocab = VOCAB

    def __post_init__(self) -> None:
        validate(self)

    @property
    def batch_size(self) -> int:
        return int(self.targets.shape[0])

    @property
    def num_steps(self) -> int:
        """Forward passes the replay needs: 1 + the largest commit step."""
        return int(self.action_steps.max()) + 1

    @property
    def generation_length(self) -> int:
        return int(self.targets.shape[1]) - self.prompt_length

    def micro_batches(self, size: int | None = None) -> list[slice]:
        size = size or self.micro_batch_size
        return [slice(i, min(i + size, self.batch_size)) for i in range(0, self.batch_size, size)]

    # -- what the learner calls (``CanvasTrace`` has the same interface) ---------------------------
    excluded_token = property(lambda self: self.vocab.mask)  # never proposed: left out of the KL

    def unit_keys(self, rows: slice) -> list[int]:
        """Global steps with at least one commit among ``rows``: one replay unit each."""
        return sorted(int(s) for s in torch.unique(self.action_steps[rows]) if s >= 0)

    def unit_mask(self, rows: slice, step: int) -> torch.Tensor:
        return self.action_steps[rows] == step  # [m, L]

    def score_unit(self, adapter, rows: slice, step: int):
        """One forward of ``rows`` at ``step`` (keeps the rows' composition, as in the rollout)."""
        from .replay import replay_canvas, score_step

        targets, steps = self.targets[rows], self.action_steps[rows]
        logits = adapter.logits(replay_canvas(targets, steps, step, self.vocab.mask))  # [m, L, V]
        return score_step(logits, targets, steps == step, self.temperature, self.vocab.mask)

    def with_rewards(
        self, rewards: torch.Tensor, components: dict[str, torch.Tensor], advantages: torch.Tensor
    ) -> TraceBatch:
        return replace(self, rewards=rewards.float(), reward_components=components, advantages=advantages.float())


def _fail(msg: str) -> None:
    raise TraceError(f"invalid trace batch: {msg}")


def validate(t: TraceBatch) -> None:
    """The contract, checked field by field."""
    if t.targets.ndim != 2:
        _fail(f"targets must be [B, L], got shape {tuple(t.targets.shape)}")
    shape = tuple(t.targets.shape)
    for name in ("action_steps", "loss_weights", "log_probs"):
        if tuple(getattr(t, name).shape) != shape:
            _fail(f"{name} has shape {tuple(getattr(t, name).shape)}, targets {shape}; all must be [B, L]")
    if t.targets.dtype != torch.int64 or t.action_steps.dtype != torch.int64:
        _fail(f"targets and action_steps must be int64, got {t.targets.dtype} and {t.action_steps.dtype}")
    if not t.loss_weights.is_floating_point() or not t.log_probs.is_floating_point():
        _fail("loss_weights and log_probs must be floating point")
    if not 0 < t.prompt_length < shape[1]:
        _fail(f"prompt_length {t.prompt_length} must lie in (0, L={shape[1]})")
    if int(t.targets.min()) < 0 or int(t.targets.max()) >= t.vocab.size or bool((t.targets == t.vocab.mask).any()):
        _fail(f"targets must be token ids in [0, {t.vocab.size}) and never MASK ({t.vocab.mask}): "
              "the canvas is complete")
    if bool((t.action_steps[:, : t.prompt_length] != -1).any()):
        _fail("prompt positions [0, prompt_length) must have action step -1")
    if bool((t.action_steps[:, t.prompt_length :] < 0).any()):
        _fail("every generated position [prompt_length, L) must have a commit step >= 0")
    w = t.loss_weights
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        _fail("loss_weights must be finite and >= 0")
    if bool((w[t.action_steps < 0] != 0).any()):
        _fail("loss_weights must be 0 at prompt/padding positions (action step -1)")
    if not bool(torch.isfinite(t.log_probs[t.action_steps >= 0]).all()):
        _fail("log_probs of committed tokens must be finite")
    if t.temperature <= 0:
        _fail(f"temperature {t.temperature} must be > 0")
    for name in ("group_ids", "seeds", "rewards", "advantages", *(f"reward:{n}" for n in t.reward_components)):
        value = t.reward_components[name[7:]] if name.startswith("reward:") else getattr(t, name)
        if value is not None and tuple(value.shape) != (shape[0],):
            _fail(f"{name} has shape {tuple(value.shape)}, expected [B] = ({shape[0]},)")
    if t.micro_batch_size <= 0:
        _fail(f"micro_batch_size {t.micro_batch_size} must be > 0")
    if t.metadata is not None and len(t.metadata) != shape[0]:
        _fail(f"metadata has {len(t.metadata)} rows, expected {shape[0]}")


# -- Parquet -------------------------------------------------------------------------------------

COLUMNS = [
    "schema_version",  # int32
    "run_id",  # string
    "step",  # int64: RL step (1-based) this rollout trained
    "policy_version",  # int64
    "sample_index",  # int32
    "group_id",  # int64
    "prompt",  # string: decoded prompt (digits, '|' separator, '.' padding)
    "seed",  # int64
    "reward",  # float32
    "advantage",  # float32
    "targets",  # list<int32> [L]
    "action_steps",  # list<int32> [L]
    "loss_weights",  # list<float32> [L]
    "log_probs",  # list<float32> [L]
    "prompt_length",  # int32
    "temperature",  # float64 (exact: the replay divides by it)
    "micro_batch_size",  # int32
    "metadata_json",  # string
    # optional: reward_<name> float32 per reward component
]


def _rows(t: torch.Tensor, dtype) -> list[np.ndarray]:
    return list(t.detach().cpu().numpy().astype(dtype))


def trace_table(trace: TraceBatch, *, run_id: str, step: int) -> pa.Table:
    if trace.rewards is None or trace.advantages is None:
        raise ValueError("trace_table needs a scored trace (rewards and advantages)")
    b = trace.batch_size
    meta = trace.metadata or [{}] * b
    cols: dict[str, pa.Array] = {
        "schema_version": pa.array([SCHEMA_VERSION] * b, pa.int32()),
        "run_id": pa.array([run_id] * b, pa.string()),
        "step": pa.array([step] * b, pa.int64()),
        "policy_version": pa.array([trace.policy_version] * b, pa.int64()),
        "sample_index": pa.array(range(b), pa.int32()),
        "group_id": pa.array(trace.group_ids.tolist(), pa.int64()),
        "prompt": pa.array([trace.vocab.decode(r[: trace.prompt_length]) for r in trace.targets], pa.string()),
        "seed": pa.array(trace.seeds.tolist(), pa.int64()),
        "reward": pa.array(trace.rewards.numpy(), pa.float32()),
        "advantage": pa.array(trace.advantages.numpy(), pa.float32()),
        "targets": pa.array(_rows(trace.targets, np.int32), pa.list_(pa.int32())),
        "action_steps": pa.array(_rows(trace.action_steps, np.int32), pa.list_(pa.int32())),
        "loss_weights": pa.array(_rows(trace.loss_weights, np.float32), pa.list_(pa.float32())),
        "log_probs": pa.array(_rows(trace.log_probs, np.float32), pa.list_(pa.float32())),
        "prompt_length": pa.array([trace.prompt_length] * b, pa.int32()),
        "temperature": pa.array([trace.temperature] * b, pa.float64()),
        "micro_batch_size": pa.array([trace.micro_batch_size] * b, pa.int32()),
        "metadata_json": pa.array([json.dumps(m, sort_keys=True, default=str) for m in meta], pa.string()),
    }
    for name, values in sorted(trace.reward_components.items()):
        cols[f"reward_{name}"] = pa.array(values.numpy(), pa.float32())
    table = pa.table(cols)
    kv = {
        b"diffusionrl.trace_schema_version": str(SCHEMA_VERSION).encode(),
        b"diffusionrl.kind": KIND.encode(),
        b"diffusionrl.vocab": json.dumps(asdict(trace.vocab)).encode(),
    }
    return table.replace_schema_metadata({**(table.schema.metadata or {}), **kv})


def write_step(directory: str | Path, trace: TraceBatch, *, run_id: str, step: int) -> Path:
    """Write ``step-XXXXXX.parquet`` atomically; returns its path."""
    return write_parquet(trace_table(trace, run_id=run_id, step=step), Path(directory) / f"step-{step:06d}.parquet")


def list_step_files(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).glob("step-*.parquet"))


def read_trace(path: str | Path) -> TraceBatch:
    """One step file back into a validated ``TraceBatch``."""
    table = read_parquet(path)
    kv = table.schema.metadata or {}
    if kv.get(b"diffusionrl.kind") != KIND.encode():
        raise ValueError(f"{path} is not a bdlm trace file (diffusionrl.kind is {kv.get(b'diffusionrl.kind')!r})")
    version = int(kv.get(b"diffusionrl.trace_schema_version", b"0"))
    if version != SCHEMA_VERSION:
        raise ValueError(f"{path}: trace schema version {version}, this reader knows {SCHEMA_VERSION}")
    d = table.to_pydict()
    components = {c[len("reward_"):]: torch.tensor(d[c], dtype=torch.float32) for c in d if c.startswith("reward_")}
    return TraceBatch(
        targets=torch.tensor(d["targets"], dtype=torch.int64),
        action_steps=torch.tensor(d["action_steps"], dtype=torch.int64),
        loss_weights=torch.tensor(d["loss_weights"], dtype=torch.float32),
        log_probs=torch.tensor(d["log_probs"], dtype=torch.float32),
        prompt_length=int(d["prompt_length"][0]),
        temperature=float(d["temperature"][0]),
        group_ids=torch.tensor(d["group_id"], dtype=torch.int64),
        seeds=torch.tensor(d["seed"], dtype=torch.int64),
        micro_batch_size=int(d["micro_batch_size"][0]),
        policy_version=int(d["policy_version"][0]),
        rewards=torch.tensor(d["reward"], dtype=torch.float32),
        reward_components=components,
        advantages=torch.tensor(d["advantage"], dtype=torch.float32),
        metadata=[json.loads(m) for m in d["metadata_json"]],
        vocab=Vocab(**json.loads(kv[b"diffusionrl.vocab"])),
    )


def read_traces(directory: str | Path) -> list[TraceBatch]:
    """Every step of a run, in step order."""
    return [read_trace(p) for p in list_step_files(directory)]
