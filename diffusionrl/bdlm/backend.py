"""``BDLMBackend``: one GRPO step of a block-diffusion LM, driven by ``run.loop.RunLoop``, and
``train_grpo``, the stage a workflow calls.

A step is ``sample_batch -> rollout -> score -> update``. Every random choice of step ``s`` (its
prompts, sample seeds) is seeded by ``(grpo.seed, s)`` and the rollout's Gumbel noise by the
per-row seed, so a run resumed from a checkpoint repeats exactly what the uninterrupted run would
have done.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffusionrl.run import RUN_CONTROL_KEYS, Callback, CheckpointState, RunLoop, RunResult, Schedule

from . import trace as trace_store
from .config import BDLMConfig
from .dynamic_sampling import REFILL_GROUP_OFFSET, concat_rows, keep_groups
from .evaluation import decode_examples
from .grpo import TraceGRPO
from .loading import load_bdlm
from .model import RUN_INFO, frozen_copy, weights_digest
from .objectives import OBJECTIVES, advantages_for
from .task import Example, encode_prompts, make_splits, score
from .trace import TraceBatch

# Config keys a resumed GRPO run may change (``run.loop.RUN_CONTROL_KEYS`` and these): how long to
# run, checkpoint cadence, whether traces are written. Every other key must match the checkpoint's.
FREE_KEYS = RUN_CONTROL_KEYS + ("grpo.steps", "grpo.checkpoint_every", "grpo.keep_checkpoints", "grpo.save_traces",
                                 "grpo.max_idle_steps", "grpo.max_skipped_fraction")


class BDLMBackend:
    """Live policy, frozen reference, optimizer, objective and data of one GRPO run."""

    progress_label = "grpo"
    restore_rng = False

    def __init__(self, cfg: BDLMConfig, out_dir: str | Path, init_dir: str | Path):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.init_dir = str(init_dir)
        self.splits = make_splits(cfg.task)
        self.live = load_bdlm(init_dir, cfg.model)
        self.init_digest = weights_digest(self.live)
        self.reference = frozen_copy(self.live) if cfg.grpo.kl_beta > 0 else None
        gc = cfg.grpo
        if gc.objective == "opd" and not gc.teacher:
            raise ValueError("grpo.objective=opd needs grpo.teacher: a model folder (e.g. a longer warm start's)")
        self.teacher = frozen_copy(load_bdlm(gc.teacher, cfg.model)) if gc.objective == "opd" else None
        if self.teacher is not None and getattr(self.teacher, "kind", "") != getattr(self.live, "kind", ""):
            raise ValueError(f"grpo.teacher={gc.teacher} is a {self.teacher.kind} model, the student a "
                             f"{self.live.kind}: the teacher scores the student's own canvases; the kinds must match")
        self.kind = getattr(self.live, "kind", "")
        if self.kind in ("diffusiongemma", "llada2"):  # rollouts through the stock pipelines
            if self.kind == "diffusiongemma":
                from .gemma_rollout import check_replayable

                check_replayable(cfg.model, self.live)  # fail before training, naming the option
            else:
                from .llada2 import check_replayable

                check_replayable(cfg.model)
            self.live.check_digit_vocab()
        self.optimizer = torch.optim.AdamW(self.live.module.parameters(), lr=gc.lr, weight_decay=gc.weight_decay)
        self.objective = TraceGRPO(gc, self.live, self.reference, self.teacher)

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed: objective, model, initial weights, task."""
        meta = {
            "objective": OBJECTIVES[self.cfg.grpo.objective],
            "model": self.cfg.model.name,
            "init_weights_digest": self.init_digest,
            "task": {"kind": self.cfg.task.kind, "min_len": self.cfg.task.min_len, "max_len": self.cfg.task.max_len},
            "trace_schema_version": trace_store.SCHEMA_VERSION,
        }
        if self.teacher is not None:
            meta["teacher_weights_digest"] = weights_digest(self.teacher)
        return meta

    # -- one step --------------------------------------------------------------------------------
    def sample_batch(self, step: int, attempt: int = 0) -> tuple[list[Example], torch.Tensor, torch.Tensor]:
        """Prompts (each repeated ``group_size`` times), group ids and per-row seeds of ``step``
        (``attempt`` > 0: dapo's refill batches, drawn from their own seeded stream)."""
        gc = self.cfg.grpo
        rng = np.random.default_rng([gc.seed, step] + ([attempt] if attempt else []))
        picked = rng.choice(len(self.splits.train), size=gc.prompts_per_step, replace=False)
        examples = [self.splits.train[int(i)] for i in picked for _ in range(gc.group_size)]
        group_ids = torch.arange(step * gc.prompts_per_step,
                                 (step + 1) * gc.prompts_per_step).repeat_interleave(gc.group_size)
        seeds = torch.as_tensor(rng.integers(0, 2**31 - 1, size=len(examples)), dtype=torch.int64)
        return examples, group_ids + attempt * REFILL_GROUP_OFFSET, seeds

    def rollout(self, step: int, attempt: int = 0) -> tuple[TraceBatch, list[Example]]:
        examples, group_ids, seeds = self.sample_batch(step, attempt)
        mb = self.cfg.grpo.micro_batch_size
        if self.kind in ("diffusiongemma", "llada2"):  # the stock pipelines, recorded
            from dataclasses import replace

            vocab = self.live.vocab
            prompts = encode_prompts(examples, self.cfg.task.prompt_length, vocab)
            if self.kind == "diffusiongemma":
                from .gemma_rollout import rollout

                trace = rollout(self.live, self.cfg.model, [vocab.decode(r) for r in prompts], seeds, mb, group_ids)
            else:
                from .llada2 import rollout as llada2_rollout

                trace = llada2_rollout(self.live, self.cfg.model, prompts, seeds, mb, group_ids)
            meta = [{"prompt": ex.prompt, "answer": ex.answer} for ex in examples]
            return replace(trace, policy_version=step, metadata=meta), examples
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
        adv = advantages_for(gc.objective, rewards, trace.group_ids, global_std=gc.global_std,
                             clip_max=gc.adv_clip_max)
        parts = {"exact": torch.as_tensor(s["exact"]), "partial": torch.as_tensor(s["partial"])}
        r = s["reward"]
        metrics = {
            "rollout/reward/raw_mean": float(r.mean()), "rollout/reward/raw_std": float(r.std()),
            "rollout/reward/raw_min": float(r.min()), "rollout/reward/raw_max": float(r.max()),
            "rollout/reward/raw_median": float(np.median(r)), "rollout/reward/num_samples": float(len(r)),
            "rollout/reward/exact_mean": float(s["exact"].mean()),
            "rollout/reward/partial_mean": float(s["partial"].mean()),
            "rollout/zero_std/count": float(adv.zero_std_groups),
            "rollout/active_groups": float(len(torch.unique(trace.group_ids[adv.active]))),  # dapo: kept by sampling
            "rollout/decode_steps_mean": float((trace.action_steps.max(1).values + 1).float().mean()),
        }
        return trace.with_rewards(rewards, parts, adv.advantages), adv.active, metrics

    def refill(self, step: int, trace, active: torch.Tensor, metrics: dict[str, float]):
        """dapo's dynamic sampling (``dynamic_sampling``): further batches until the step holds
        ``prompts_per_step`` groups with reward variance or ``dapo_max_refills`` were drawn.
        Reward metrics stay those of the first batch; ``rollout/dapo/*`` count the refill."""
        gc = self.cfg.grpo
        traces, actives, attempt = [trace], [active], 0

        def groups() -> int:
            return sum(len(torch.unique(t.group_ids[a])) for t, a in zip(traces, actives))

        while groups() < gc.prompts_per_step and attempt < gc.dapo_max_refills:
            attempt += 1
            extra, examples = self.rollout(step, attempt)
            extra, extra_active, _ = self.score(extra, examples)
            traces.append(extra)
            actives.append(extra_active)
        keep = keep_groups(torch.cat(actives), torch.cat([t.group_ids for t in traces]), gc.prompts_per_step)
        if attempt and bool(keep.any()):  # else: the first batch as it is (nothing to learn from)
            mb = gc.micro_batch_size
            rows = torch.nonzero(keep.view(-1, mb).any(1).repeat_interleave(mb)).flatten()  # whole micro-batches
            trace, active = concat_rows(traces, rows), keep[rows]
        kept = len(torch.unique(trace.group_ids[active]))
        metrics.update({"rollout/dapo/refill_batches": float(attempt), "rollout/active_groups": float(kept),
                        "rollout/dapo/missing_groups": float(max(0, gc.prompts_per_step - kept))})
        return trace, active

    def run_step(self, step: int) -> tuple[TraceBatch, dict[str, float]]:
        t0 = time.perf_counter()
        trace, examples = self.rollout(step)
        t1 = time.perf_counter()
        trace, active, metrics = self.score(trace, examples)
        if self.cfg.grpo.objective == "dapo" and self.cfg.grpo.dapo_max_refills:
            trace, active = self.refill(step, trace, active, metrics)
            t1 = time.perf_counter()  # rollout time includes the refill batches
        t2 = time.perf_counter()
        metrics.update(self.objective.train_step(self.optimizer, trace, active))
        t3 = time.perf_counter()
        metrics.update({"perf/rollout_time": t1 - t0, "perf/reward_time": t2 - t1, "perf/train_time": t3 - t2,
                        "perf/step_time": t3 - t0, "step": float(step + 1)})
        if self.cfg.grpo.save_traces:
            if isinstance(trace, TraceBatch):
                trace_store.write_step(self.out_dir / "traces", trace, run_id=self.out_dir.name, step=step + 1)
            else:  # the pipeline traces: tensor_trace.read_tensor_trace reads them back
                from .tensor_trace import write_tensor_trace

                write_tensor_trace(self.out_dir / "traces", trace, run_id=self.out_dir.name, step=step + 1)
        return trace, metrics

    # -- run lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        pass  # decoding uses the live policy itself: nothing to push

    def state(self, step: int) -> CheckpointState:
        """Full policy weights (the checkpoint's ``lora`` slot) + AdamW state + metadata."""
        return CheckpointState(
            step=step, policy_version=step, metadata=self.metadata(),
            lora={k: v.detach().clone() for k, v in self.live.module.state_dict().items()},
            optimizer=self.optimizer.state_dict(),
            extra={"config_digest": self.cfg.digest(), "init_dir": self.init_dir},
        )

    def load_state(self, state: CheckpointState) -> None:
        self.live.module.load_state_dict(state.lora)
        self.optimizer.load_state_dict(state.optimizer)

    def save_outputs(self, step: int) -> tuple[Path, dict[str, Path]]:
        model_dir = self.live.save(self.out_dir / "model")
        info = {"stage": "grpo", "objective": OBJECTIVES[self.cfg.grpo.objective], "step": step,
                "init_dir": self.init_dir,
                "init_weights_digest": self.init_digest, "config_digest": self.cfg.digest(),
                "weights_digest": weights_digest(self.live)}
        (model_dir / RUN_INFO).write_text(json.dumps(info, indent=1))
        return model_dir, {}

    def close(self) -> None:
        pass


def build_grpo_loop(cfg: BDLMConfig, out_dir: str | Path, init_dir: str | Path,
                    callbacks: list[Callback] | None = None, progress: bool | None = None) -> RunLoop:
    gc = cfg.grpo
    schedule = Schedule(steps=gc.steps, checkpoint_every=gc.checkpoint_every, keep_checkpoints=gc.keep_checkpoints)
    from diffusionrl.training.guard import UpdateGuard  # a run that never updates stops, as image runs do

    return RunLoop(BDLMBackend(cfg, out_dir, init_dir), out_dir, schedule, cfg.to_dict(),
                   callbacks=[*(callbacks or []), UpdateGuard(gc, "grpo")], progress=progress, free_keys=FREE_KEYS)


def train_grpo(cfg: BDLMConfig, out_dir: str | Path, init_dir: str | Path, resume: str | Path | None = "auto",
               stop_after: int | None = None, callbacks: list[Callback] | None = None,
               progress: bool | None = None, allow_config_change: bool = False) -> RunResult:
    """GRPO with exact trace replay from the model in ``init_dir`` (e.g. ``warm_start``'s output).
    ``result.model_dir`` is the trained policy (``load_bdlm(result.model_dir)``). Resuming follows
    ``RunLoop.run`` (``allow_config_change`` included)."""
    loop = build_grpo_loop(cfg, out_dir, init_dir, callbacks=callbacks, progress=progress)
    try:
        return loop.run(resume=resume, stop_after=stop_after, allow_config_change=allow_config_change)
    finally:
        loop.close()
