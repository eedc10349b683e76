"""The three stages the workflow calls: ``warm_start``, ``train_grpo`` and ``evaluate``.

A GRPO step is ``sample_batch -> rollout -> score -> update -> checkpoint``, each a method of
``BDLMRun``. Every random choice of step ``s`` (its prompts, sample seeds) is seeded by
``(grpo.seed, s)`` and the rollout's Gumbel noise by the per-row seed, so a run resumed from a
checkpoint repeats exactly what the uninterrupted run would have done.

Callbacks (``on_step(run, step, trace, metrics)``, ``on_checkpoint(run, path)``, ``on_end(run)``)
let a Flyte task stream MLflow metrics or upload checkpoints without the loop knowing them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from diffusionrl.algorithms.advantages import group_advantages
from diffusionrl.training.checkpoint import (
    CheckpointState,
    check_metadata,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)

from . import trace as trace_store
from .config import BDLMConfig
from .grpo import OBJECTIVE, TraceGRPO
from .model import BDLMAdapter, frozen_copy, load_bdlm, weights_digest
from .sampler import decode
from .task import Example, encode_prompts, make_splits, score
from .trace import TraceBatch
from .warmstart import train_warm_start

log = logging.getLogger(__name__)

RUN_INFO = "bdlm_run.json"


@dataclass
class GRPOResult:
    out_dir: Path
    model_dir: Path  # the trained policy (load_bdlm(model_dir))
    metrics: list[dict[str, float]]  # one dict per completed step
    steps_done: int
    checkpoint: Path | None


# -- decoding and evaluation ---------------------------------------------------------------------


def decode_examples(cfg: BDLMConfig, adapter: BDLMAdapter, examples: list[Example], seeds: torch.Tensor | None,
                    batch_size: int, threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Decode ``examples`` in batches of ``batch_size`` rows (``seeds=None``: greedy).

    Returns prompts ``[B, P]``, tokens ``[B, L]``, action steps ``[B, L]``, log-probs ``[B, L]``.
    """
    mc = cfg.model
    prompts = encode_prompts(examples, cfg.task.prompt_length, adapter.vocab)  # [B, P]
    parts = []
    for i in range(0, len(examples), batch_size):
        rows = slice(i, i + batch_size)
        parts.append(decode(adapter, prompts[rows], gen_length=mc.gen_length, block_size=mc.block_size,
                            temperature=mc.temperature, threshold=mc.threshold if threshold is None else threshold,
                            seeds=None if seeds is None else seeds[rows]))
    cat = [torch.cat([getattr(d, k) for d in parts]) for k in ("tokens", "action_steps", "log_probs")]
    return prompts, cat[0], cat[1], cat[2]


def evaluate_adapter(cfg: BDLMConfig, adapter: BDLMAdapter, examples: list[Example]) -> dict[str, float]:
    """Greedy decoding (argmax proposals, eval threshold) scored on ``examples``."""
    ec = cfg.eval
    if ec.num_samples:
        examples = examples[: ec.num_samples]
    _, tokens, _, _ = decode_examples(cfg, adapter, examples, None, ec.batch_size, ec.threshold)
    s = score(tokens[:, cfg.task.prompt_length :], examples, cfg.task.partial_weight, adapter.vocab)
    return {
        "eval/exact_match": float(s["exact"].mean()),
        "eval/reward_mean": float(s["reward"].mean()),
        "eval/partial_mean": float(s["partial"].mean()),
        "eval/num_samples": float(len(examples)),
    }


def evaluate(cfg: BDLMConfig, model_dir: str | Path, split: str = "test") -> dict[str, float]:
    """Exact-match accuracy and mean reward of the model in ``model_dir`` on a split of the task."""
    splits = make_splits(cfg.task)
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r} is not one of ['train', 'test']")
    return evaluate_adapter(cfg, load_bdlm(model_dir, cfg.model), getattr(splits, split))


# -- warm start ----------------------------------------------------------------------------------


def warm_start(cfg: BDLMConfig, out_dir: str | Path, progress: bool | None = None) -> Path:
    """Masked-diffusion supervised stage from ``cfg.model.name``; returns the saved model folder
    (``out_dir/model``). ``out_dir/metrics.jsonl`` holds the per-step loss."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter = load_bdlm(cfg.model.name, cfg.model)
    torch.manual_seed(cfg.warm_start.seed)
    splits = make_splits(cfg.task)
    history = train_warm_start(adapter, splits.train, cfg.warm_start, prompt_length=cfg.task.prompt_length,
                               gen_length=cfg.model.gen_length, progress=progress)
    _write_jsonl(out_dir / "metrics.jsonl", history)
    model_dir = adapter.save(out_dir / "model")
    info = {"stage": "warm_start", "objective": "masked_diffusion_sft", "base_model": cfg.model.name,
            "steps": cfg.warm_start.steps, "config_digest": cfg.digest(), "weights_digest": weights_digest(adapter)}
    (model_dir / RUN_INFO).write_text(json.dumps(info, indent=1))
    return model_dir


# -- GRPO ----------------------------------------------------------------------------------------


class BDLMRun:
    """Live policy, frozen reference, optimizer, objective and data of one GRPO run."""

    def __init__(self, cfg: BDLMConfig, out_dir: str | Path, init_dir: str | Path,
                 callbacks: list[Any] | None = None, progress: bool | None = None):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.callbacks = list(callbacks or [])
        self.progress = progress
        self.init_dir = str(init_dir)
        self.splits = make_splits(cfg.task)
        self.live = load_bdlm(init_dir, cfg.model)
        self.init_digest = weights_digest(self.live)
        self.reference = frozen_copy(self.live) if cfg.grpo.kl_beta > 0 else None
        gc = cfg.grpo
        self.optimizer = torch.optim.AdamW(self.live.module.parameters(), lr=gc.lr, weight_decay=gc.weight_decay)
        self.objective = TraceGRPO(gc, self.live, self.reference)
        self.step = 0
        self.history: list[dict[str, float]] = []

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed: objective, model, initial weights, task."""
        return {
            "objective": OBJECTIVE,
            "model": self.cfg.model.name,
            "init_weights_digest": self.init_digest,
            "task": {"kind": self.cfg.task.kind, "min_len": self.cfg.task.min_len, "max_len": self.cfg.task.max_len},
            "trace_schema_version": trace_store.SCHEMA_VERSION,
        }

    # -- one step --------------------------------------------------------------------------------
    def sample_batch(self, step: int) -> tuple[list[Example], torch.Tensor, torch.Tensor]:
        """Prompts (each repeated ``group_size`` times), group ids and per-row seeds of ``step``."""
        gc = self.cfg.grpo
        rng = np.random.default_rng([gc.seed, step])
        picked = rng.choice(len(self.splits.train), size=gc.prompts_per_step, replace=False)
        examples = [self.splits.train[int(i)] for i in picked for _ in range(gc.group_size)]
        group_ids = torch.arange(step * gc.prompts_per_step, (step + 1) * gc.prompts_per_step).repeat_interleave(gc.group_size)
        seeds = torch.as_tensor(rng.integers(0, 2**31 - 1, size=len(examples)), dtype=torch.int64)
        return examples, group_ids, seeds

    def rollout(self, step: int) -> tuple[TraceBatch, list[Example]]:
        examples, group_ids, seeds = self.sample_batch(step)
        mb = self.cfg.grpo.micro_batch_size
        prompts, tokens, steps, log_probs = decode_examples(self.cfg, self.live, examples, seeds, mb)
        trace = TraceBatch(
            targets=tokens, action_steps=steps, loss_weights=(steps >= 0).float(), log_probs=log_probs,
            prompt_length=prompts.shape[1], temperature=self.cfg.model.temperature, group_ids=group_ids,
            seeds=seeds, micro_batch_size=mb, policy_version=step, vocab=self.live.vocab,
            metadata=[{"prompt": ex.prompt, "answer": ex.answer} for ex in examples],
        )
        return trace, examples

    def score(self, trace: TraceBatch, examples: list[Example]) -> tuple[TraceBatch, torch.Tensor, dict[str, float]]:
        gc = self.cfg.grpo
        s = score(trace.targets[:, trace.prompt_length :], examples, self.cfg.task.partial_weight, trace.vocab)
        rewards = torch.as_tensor(s["reward"])
        adv = group_advantages(rewards, trace.group_ids, global_std=gc.global_std, clip_max=gc.adv_clip_max)
        parts = {"exact": torch.as_tensor(s["exact"]), "partial": torch.as_tensor(s["partial"])}
        r = s["reward"]
        metrics = {
            "rollout/reward/raw_mean": float(r.mean()), "rollout/reward/raw_std": float(r.std()),
            "rollout/reward/raw_min": float(r.min()), "rollout/reward/raw_max": float(r.max()),
            "rollout/reward/raw_median": float(np.median(r)), "rollout/reward/num_samples": float(len(r)),
            "rollout/reward/exact_mean": float(s["exact"].mean()), "rollout/reward/partial_mean": float(s["partial"].mean()),
            "rollout/zero_std/count": float(adv.zero_std_groups),
            "rollout/decode_steps_mean": float((trace.action_steps.max(1).values + 1).float().mean()),
        }
        return trace.with_rewards(rewards, parts, adv.advantages), adv.active, metrics

    def run_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        trace, examples = self.rollout(step)
        t1 = time.perf_counter()
        trace, active, metrics = self.score(trace, examples)
        t2 = time.perf_counter()
        metrics.update(self.objective.train_step(self.optimizer, trace, active))
        t3 = time.perf_counter()
        metrics.update({"perf/rollout_time": t1 - t0, "perf/reward_time": t2 - t1, "perf/train_time": t3 - t2,
                        "perf/step_time": t3 - t0, "step": float(step + 1)})
        self.step = step + 1
        self.history.append(metrics)
        _write_jsonl(self.out_dir / "metrics.jsonl", [metrics], append=True)
        if self.cfg.grpo.save_traces:
            trace_store.write_step(self.out_dir / "traces", trace, run_id=self.out_dir.name, step=self.step)
        for cb in self.callbacks:
            if hasattr(cb, "on_step"):
                cb.on_step(self, self.step, trace, metrics)
        return metrics

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        """Full policy weights (the checkpoint's ``lora`` slot) + AdamW state + metadata."""
        state = CheckpointState(
            step=self.step, policy_version=self.step, metadata=self.metadata(),
            lora={k: v.detach().clone() for k, v in self.live.module.state_dict().items()},
            optimizer=self.optimizer.state_dict(), extra={"config_digest": self.cfg.digest(), "init_dir": self.init_dir},
        )
        path = save_checkpoint(self.ckpt_dir / f"step-{self.step:06d}", state)
        prune_checkpoints(self.ckpt_dir, self.cfg.grpo.keep_checkpoints)
        for cb in self.callbacks:
            if hasattr(cb, "on_checkpoint"):
                cb.on_checkpoint(self, path)
        return path

    def restore(self, path: str | Path) -> None:
        state = load_checkpoint(path, restore_rng=False)
        check_metadata(state.metadata, self.metadata(), str(path))
        self.live.module.load_state_dict(state.lora)
        self.optimizer.load_state_dict(state.optimizer)
        self.step = state.step
        self.history = _read_metrics(self.out_dir / "metrics.jsonl", upto=self.step)
        log.info("resumed from %s at step %d", path, self.step)

    # -- the run ---------------------------------------------------------------------------------
    def run(self, resume: str | Path | None = "auto", stop_after: int | None = None) -> GRPOResult:
        """Train to ``grpo.steps`` (or ``stop_after`` more steps). ``resume="auto"``: the latest
        checkpoint of this folder if any; a path: that checkpoint; ``None``: start fresh."""
        path = latest_checkpoint(self.ckpt_dir) if resume == "auto" else resume
        if path:
            self.restore(path)
        else:
            (self.out_dir / "metrics.jsonl").unlink(missing_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
        gc = self.cfg.grpo
        last = gc.steps if stop_after is None else min(gc.steps, self.step + stop_after)
        ckpt = latest_checkpoint(self.ckpt_dir)
        bar = tqdm(range(self.step, last), desc="grpo", initial=self.step, total=gc.steps,
                   disable=None if self.progress is None else not self.progress)
        for step in bar:
            metrics = self.run_step(step)
            bar.set_postfix(reward=f"{metrics['rollout/reward/raw_mean']:.3f}")
            if (gc.checkpoint_every and self.step % gc.checkpoint_every == 0) or self.step == last:
                ckpt = self.checkpoint()
        model_dir = self.save_model()
        for cb in self.callbacks:
            if hasattr(cb, "on_end"):
                cb.on_end(self)
        return GRPOResult(self.out_dir, model_dir, list(self.history), self.step, ckpt)

    def save_model(self) -> Path:
        model_dir = self.live.save(self.out_dir / "model")
        info = {"stage": "grpo", "objective": OBJECTIVE, "step": self.step, "init_dir": self.init_dir,
                "init_weights_digest": self.init_digest, "config_digest": self.cfg.digest(),
                "weights_digest": weights_digest(self.live)}
        (model_dir / RUN_INFO).write_text(json.dumps(info, indent=1))
        return model_dir


def train_grpo(cfg: BDLMConfig, out_dir: str | Path, init_dir: str | Path, resume: str | Path | None = "auto",
               stop_after: int | None = None, callbacks: list[Any] | None = None,
               progress: bool | None = None) -> GRPOResult:
    """GRPO with exact trace replay from the model in ``init_dir`` (e.g. ``warm_start``'s output)."""
    return BDLMRun(cfg, out_dir, init_dir, callbacks=callbacks, progress=progress).run(resume=resume, stop_after=stop_after)


# -- metrics files -------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[dict], append: bool = False) -> None:
    with path.open("a" if append else "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def _read_metrics(path: Path, upto: int) -> list[dict[str, float]]:
    """Metrics of the steps a checkpoint covers (later lines belong to lost, re-run steps)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) <= upto]
    _write_jsonl(path, rows)
    return rows
