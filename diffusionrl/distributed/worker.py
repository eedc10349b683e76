"""One trainer rank: a Ray actor holding the adapter, the FSDP2-sharded LoRA policy, the trainer
and (ranks ``< train.rollout_engines``) a rollout engine.

Exact accumulation across ranks (docs/algorithms.md section 6): the driver replays the single-process
schedule (``grpo_plan``: which micro-batches form each optimizer step, and each micro-batch's step
order, from the same seeded generator), every rank builds the units of the micro-batches it
owns, the count of each optimizer step is all-reduced *before* any backward, every unit's summed
loss is divided once by that global count, and FSDP2 reduce-scatters gradient *sums*. N ranks x M
micro-batches therefore give the gradient of one process (up to float summation order).

FSDP2 runs collectives in every forward and backward, so ranks must run the same units in the same
order per optimizer step (``aligned_work``): ranks with fewer units run zero-weight padding units
(loss x 0 on one of their own micro-batches). A model with two experts (Wan2.2 A14B: each step runs
the expert of its timestep, each expert's blocks their own FSDP units) runs its units grouped by
expert, every rank the same count of each (padded with that expert's steps), so every all-gather
and reduce-scatter pairs up one expert's block on all ranks. The step's gradient is a sum over its
units, so the order changes only the float summation order. A non-finite loss is not returned early
(that would deadlock the others): its backward makes the global gradient norm non-finite, and every
rank skips the step together.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from diffusionrl.training.trainer import Trainer, Unit, UpdateStats, minibatch_schedule

from .fsdp import (
    full_state,
    full_tensor,
    load_full_state,
    offload_optimizer_state,
    shard_policy,
)
from .group import all_gather_keys, all_reduce_scalar, all_reduce_sums, init_group
from .scaler import SyncedGradScaler

log = logging.getLogger(__name__)

# A plan: per optimizer step, [(global micro-batch index, [SDE step order])] in single-process order.
Plan = list[list[tuple[int, list[int]]]]


def grpo_plan(traj, active: torch.Tensor, train_cfg, step: int) -> Plan:
    """The schedule ``FlowGRPOObjective.train_step`` would follow in one process, same generator
    and same order of draws (epoch permutation, then one step permutation per micro-batch)."""
    rng = np.random.default_rng([train_cfg.seed, step, 0x5EED])
    m = traj.micro_batch_size
    plan: Plan = []
    for _epoch, selected in minibatch_schedule(traj, train_cfg, rng):
        entry = []
        for sl in selected:
            pairs = traj.sde_mask[sl] & active[sl, None]  # [m, T]
            steps = [j for j in range(traj.num_steps) if bool(pairs[:, j].any())]
            entry.append((sl.start // m, [int(j) for j in rng.permutation(steps)] if steps else []))
        plan.append(entry)
    return plan


def expert_of(adapter, t) -> str | None:
    """The expert a forward at timestep ``t`` runs (``WanExperts.expert``); None for one transformer."""
    experts = getattr(adapter, "experts", None)
    return None if experts is None else experts.expert(t)


def aligned_work(units: list[tuple[str | None, Unit]], experts: list[str | None], pad) -> list[tuple[Unit, bool]]:
    """This rank's ``(expert, unit)`` pairs as ``(unit, real)`` in the order every rank runs them: grouped
    by expert in ``experts``' order (the same on every rank: it comes from the shared timesteps), each
    group padded with ``pad(expert)`` zero-weight units to the largest count of that expert over ranks.
    A collective: every rank calls it with the same ``experts``."""
    work: list[tuple[Unit, bool]] = []
    for expert in experts:
        mine = [u for e, u in units if e == expert]
        n = int(all_reduce_scalar(len(mine), dist.ReduceOp.MAX))
        work += [(u, True) for u in mine] + [(pad(expert), False) for _ in range(n - len(mine))]
    return work


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return full_tensor(norm)


class DistributedTrainer(Trainer):
    """``Trainer`` whose counts, skip decisions and gradient norm are global over the group."""

    def __init__(self, cfg, policy, device: torch.device, loss_factor: float = 1.0):
        super().__init__(cfg, policy)
        self.device = device
        self.loss_factor = loss_factor  # see fsdp.set_sum_reduction
        self.scaler = SyncedGradScaler(device.type, enabled=cfg.train.mixed_precision == "fp16")

    def apply_sharded(self, work: list[tuple[Unit, bool]], stats: UpdateStats) -> bool:
        """One optimizer step over this rank's ``aligned_work`` (``(unit, real)``: padding is not real)."""
        total = all_reduce_scalar(sum(u.count for u, real in work if real))
        if total <= 0:
            return False
        denom = total / self.loss_factor
        self.optimizer.zero_grad(set_to_none=True)
        finite = True
        for unit, real in work:
            loss_sum, unit_stats = unit.compute()
            finite = finite and bool(torch.isfinite(loss_sum))
            if loss_sum.requires_grad:  # else an expert without a LoRA (on every rank: same expert, same unit)
                self.scaler.scale(loss_sum / denom).backward()
            if real:
                for key, value in unit_stats.items():
                    stats.add(key, float(value), unit.count)
        if all_reduce_scalar(float(finite), dist.ReduceOp.MIN) < 1:
            log.warning("non-finite loss on some rank: optimizer step skipped on every rank")
            self.optimizer.zero_grad(set_to_none=True)
            stats.skipped += 1
            return False
        self.scaler.unscale_(self.optimizer)  # found-inf is MAX-reduced over ranks inside
        params = self.policy.parameters()
        norm = global_grad_norm(params)  # the same on every rank, so every rank skips or steps together
        if self.cfg.train.max_grad_norm and math.isfinite(float(norm)):
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.train.max_grad_norm, norm)
        return self.step_optimizer(float(norm), stats)


class TrainerRank:
    """Rank ``rank`` of ``world_size`` (made a Ray actor by ``ranks.RankGroup``).

    ``engine_factory`` (default ``rollout.factory.make_engine``) builds the engine of an engine rank.
    """

    def __init__(self, cfg_dict: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                 holds_engine: bool = False, model_path: str | None = None, threads: int = 1,
                 engine_factory=None):
        from diffusionrl.config import Config
        from diffusionrl.models import load_adapter
        from diffusionrl.models.sd3 import resolve_device
        from diffusionrl.rollout.factory import make_engine
        from diffusionrl.training.flow_grpo import FlowGRPOObjective
        from diffusionrl.training.policy import LoraPolicy

        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        self.cfg = cfg = Config.from_dict(cfg_dict)
        self.rank, self.world_size = rank, world_size
        if cfg.train.deterministic:
            from .deterministic import enable_deterministic

            enable_deterministic()
        self.device = resolve_device(cfg.model.device)
        init_group(rank, world_size, master_addr, master_port, self.device)
        torch.manual_seed(cfg.train.seed)
        model_cfg = dataclasses.replace(cfg.model, name=model_path) if model_path else cfg.model
        self.adapter = load_adapter(model_cfg, cfg.train.mixed_precision)
        self.policy = LoraPolicy(self.adapter, cfg.model, seed=cfg.train.seed)
        # The engine is built before sharding: it copies/keeps the full base weights it serves.
        self.engine = (engine_factory or make_engine)(cfg, self.adapter, self.policy) if holds_engine else None
        _, loss_factor = shard_policy(self.policy, cfg.train.mixed_precision, self.device, world_size)
        self.trainer = DistributedTrainer(cfg, self.policy, self.device, loss_factor)
        self.objective = FlowGRPOObjective(cfg, self.policy)
        self.optimizer_on = "device"

    # -- identity --------------------------------------------------------------------------------
    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "digest": self.adapter.digest(),
                "backend": dist.get_backend(), "engine": getattr(self.engine, "name", None),
                "params": len(self.policy.params), "family": self.adapter.family,
                "pipeline_class": self.adapter.pipeline_class}

    # -- rollout ----------------------------------------------------------------------------------
    def rollout(self, prompts, group_ids, seeds, spec, mask, metadata):
        """This engine's share of a step (the engine sees the same micro-batches as training)."""
        train_cfg = self.cfg.train
        if train_cfg.offload_optimizer:
            offload_optimizer_state(self.trainer.optimizer, "cpu")
        self._engine_memory("resume")
        traj = self.engine.generate(prompts, group_ids, seeds, spec, mask, metadata)
        self._engine_memory("release")
        return traj

    def _engine_memory(self, what: str) -> None:
        """The engine's memory handoff (SGLang: ``/release_memory_occupation`` / ``/resume_memory_occupation``;
        a no-op for the local engine, which shares this process's allocator)."""
        if self.engine is None or not self.cfg.train.memory_handoff or self.device.type != "cuda":
            return
        if what == "resume":
            self.engine.resume_memory()
        else:
            self.engine.release_memory()

    # -- training ---------------------------------------------------------------------------------
    def _work(self, share, active, entry, first_chunk: int, probe) -> list[tuple[Unit, bool]]:
        """This rank's units of one optimizer step (``entry`` of the plan), aligned over ranks."""
        m = share.micro_batch_size
        n_local = share.batch_size // m
        units = []
        for chunk, order in entry:
            local = chunk - first_chunk
            if not 0 <= local < n_local:
                continue
            sl = slice(local * m, (local + 1) * m)
            pairs = share.sde_mask[sl] & active[sl, None]
            for j in order:
                mask = pairs[:, j]
                units.append((expert_of(self.adapter, share.timesteps[j]),
                              Unit(float(mask.sum()), self.objective._make(share, sl, j, mask, probe))))
        # each expert's first step: its padding units run it (the timesteps are the same on every rank)
        first: dict[str | None, int] = {}
        for j, t in enumerate(share.timesteps):
            first.setdefault(expert_of(self.adapter, t), j)
        return aligned_work(units, list(first), self._pad(share, first))

    def _pad(self, share, first: dict[str | None, int]):
        """``pad(expert)``: a zero-weight unit on a step of ``expert`` (its forwards and backward, loss x 0)."""
        m = share.micro_batch_size

        def pad(expert) -> Unit:
            make = self.objective._make(share, slice(0, m), first[expert], torch.zeros(m, dtype=torch.bool), None)

            def compute():
                loss, _ = make()
                return loss * 0.0, {}

            return Unit(0.0, compute)

        return pad

    def train_step(self, share, active: torch.Tensor, plan: Plan, first_chunk: int, step: int) -> dict[str, float]:
        """Every optimizer step of ``plan`` on this rank's ``share``; metrics reduced over ranks."""
        if self.cfg.train.offload_optimizer:
            offload_optimizer_state(self.trainer.optimizer, self.device)
        self.trainer.begin_step(step)
        stats = UpdateStats()
        probe = {"open": True}
        for entry in plan:
            self.trainer.apply_sharded(self._work(share, active, entry, first_chunk, probe), stats)
            probe["open"] = False
        keys = all_gather_keys(list(stats.sums))
        sums = all_reduce_sums({k: stats.sums.get(k, 0.0) for k in keys})
        counts = all_reduce_sums({k: stats.counts.get(k, 0.0) for k in keys})
        stats.sums, stats.counts = sums, counts
        metrics = stats.means()
        diff = all_reduce_sums({"count": probe.get("count", 0), "sum": probe.get("sum", 0.0)})
        if diff["count"]:
            metrics["train/log_prob_mean_abs_diff"] = diff["sum"] / diff["count"]
        metrics["train/lr"] = self.trainer.lr()
        return metrics

    def gradients(self, share, active: torch.Tensor, entry, first_chunk: int) -> dict[str, torch.Tensor]:
        """Accumulated LoRA gradients of one optimizer step (no update), gathered (tests/benchmarks)."""
        work = self._work(share, active, entry, first_chunk, None)
        total = all_reduce_scalar(sum(u.count for u, real in work if real))
        self.trainer.optimizer.zero_grad(set_to_none=True)
        for unit, _real in work:
            loss_sum, _ = unit.compute()
            if loss_sum.requires_grad:
                (loss_sum / (total / self.trainer.loss_factor)).backward()
        grads = {name: p.grad for name, p in self.policy.params.items()}
        out = full_state(grads)
        self.trainer.optimizer.zero_grad(set_to_none=True)
        return out

    # -- weights ----------------------------------------------------------------------------------
    def lora_state(self) -> dict[str, torch.Tensor]:
        """The full LoRA on CPU (a collective: call it on every rank)."""
        return full_state(self.policy.params)

    def push_weights(self, version: int) -> float:
        """Gather the LoRA (every rank) and push it to this rank's engine; seconds of the push."""
        state = full_state(self.policy.params, to_cpu=self.device.type != "cuda")
        if self.engine is None:
            return 0.0
        t0 = time.perf_counter()
        self.engine.update_weights(state, version)
        return time.perf_counter() - t0

    def load_lora_state(self, state: dict[str, torch.Tensor]) -> None:
        load_full_state(self.policy.params, state)

    # -- checkpoint state (collectives: every rank) ---------------------------------------------------
    def optimizer_state(self) -> dict:
        """The optimizer state with full tensors, in the single-process format (int param indices)."""
        sd = self.trainer.optimizer.state_dict()
        state = {idx: {k: (full_tensor(v).cpu() if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                       for k, v in per.items()} for idx, per in sd["state"].items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_optimizer_state(self, sd: dict) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = self.policy.parameters()
        local = {"state": {}, "param_groups": sd["param_groups"]}
        for idx, per in sd["state"].items():
            p = params[int(idx)]
            local["state"][int(idx)] = {
                k: (distribute_tensor(v.to(p.device_mesh.device_type), p.device_mesh, p.placements)
                    if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for k, v in per.items()
            }
        self.trainer.optimizer.load_state_dict(local)

    def scaler_state(self) -> dict:
        return self.trainer.scaler.state_dict() if self.trainer.scaler.is_enabled() else {}

    def load_scaler_state(self, sd: dict) -> None:
        if sd and self.trainer.scaler.is_enabled():
            self.trainer.scaler.load_state_dict(sd)

    def ema_state(self) -> dict[str, torch.Tensor] | None:
        return None if self.trainer.ema is None else full_state(self.trainer.ema.shadow)

    def load_ema_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.trainer.ema is not None:
            load_full_state(self.trainer.ema.shadow, state)

    def peft_state(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The adapter in peft's saved format (of ``state`` if given), full tensors on CPU."""
        from peft import get_peft_model_state_dict

        live = full_state(self.policy.params) if state is not None else None
        if state is not None:
            load_full_state(self.policy.params, state)
        try:
            sd = get_peft_model_state_dict(self.policy.model)
            return {k: full_tensor(v.detach()).cpu().clone() for k, v in sorted(sd.items())}
        finally:
            if live is not None:
                load_full_state(self.policy.params, live)

    def peft_config(self):
        return self.policy.model.peft_config["default"]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
