"""One trainer rank: a Ray actor holding the adapter, the FSDP2-sharded LoRA policy, the trainer, the
objective (with its old-policy or EMA copies, sharded like the policy) and (ranks
``< train.rollout_engines``) a rollout engine.

Exact accumulation across ranks (docs/algorithms.md section 12): every rank receives the whole
scored batch and runs the objective's own ``train_step``: the same schedule, the same random draws,
the same advantages, pairs and noise levels as one process, since all of them are functions of the
batch, the step and ``train.seed``. Only the work differs: of each optimizer step's units (one
forward/backward each, identical lists on every rank) rank ``r`` computes every ``world_size``-th
(``deal``); every unit's summed loss is divided once by the step's global count, and FSDP2
reduce-scatters gradient *sums*. N ranks therefore give the gradient of one process (up to float
summation order), for every objective, whatever its units are.

FSDP2 runs collectives in every forward and backward, so ranks must run the same number of units
of each expert in the same order per optimizer step: ranks with fewer units run zero-weight padding
units (a unit of the same expert, loss x 0). A model with two experts (Wan2.2 A14B: each step runs the
expert of its timestep, each expert's blocks their own FSDP units) runs its units grouped by expert,
so every all-gather and reduce-scatter pairs up one expert's block on all ranks. The step's
gradient is a sum over its units, so the order changes only the float summation order. A non-finite
loss is not returned early (that would deadlock the others): its backward makes the global gradient
norm non-finite, and every rank skips the step together. Metrics are summed over ranks before the
objective takes their means (``global_stats``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from diffusionrl.training.trainer import Trainer, Unit, UpdateStats

from .fsdp import full_state, full_tensor, load_full_state, offload_optimizer_state, shard_like, shard_policy
from .group import all_gather_keys, all_reduce_scalar, all_reduce_sums, init_group
from .scaler import SyncedGradScaler

log = logging.getLogger(__name__)

def deal(units: list[Unit], rank: int, world_size: int) -> list[tuple[Unit, bool]]:
    """Rank ``rank``'s share of one optimizer step's ``units`` (the same list on every rank) as
    ``(unit, real)`` in the order every rank runs them: grouped by expert (in the order the experts
    first appear), every ``world_size``-th unit of each group from the ``rank``-th, padded with
    zero-weight copies of the group's first unit to the same count on every rank."""
    groups: dict[str | None, list[Unit]] = {}
    for unit in units:
        groups.setdefault(unit.expert, []).append(unit)
    work: list[tuple[Unit, bool]] = []
    for group in groups.values():
        mine = group[rank::world_size]
        work += [(u, True) for u in mine] + [(_padding(group[0]), False)] * (-(-len(group) // world_size) - len(mine))
    return work


def _padding(unit: Unit) -> Unit:
    """``unit``'s forwards and backward with loss x 0 and no statistics."""

    def compute():
        loss, _ = unit.compute()
        return loss * 0.0, {}

    return Unit(0.0, compute, unit.expert)


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return full_tensor(norm)


class DistributedTrainer(Trainer):
    """``Trainer`` that computes this rank's share of every optimizer step's units (``deal``) and whose
    counts, skip decisions, gradient norm and statistics are global over the group.

    ``capture``: when a dict, the first optimizer step only gathers its full gradient into it and
    steps nothing (``TrainerRank.gradients``)."""

    def __init__(self, cfg, policy, device: torch.device, loss_factor: float = 1.0):
        super().__init__(cfg, policy)
        self.device = device
        self.loss_factor = loss_factor  # see fsdp.set_sum_reduction
        self.scaler = SyncedGradScaler(device.type, enabled=cfg.train.mixed_precision == "fp16")
        self.capture: dict | None = None

    def apply(self, units, stats: UpdateStats, prefix: str = "") -> bool:
        """One optimizer step over this rank's share of ``units`` (every rank passes the same list)."""
        units = list(units)
        total = sum(u.count for u in units)
        if total <= 0:
            return False
        work = deal(units, dist.get_rank(), dist.get_world_size())
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
                    stats.add(prefix + key, float(value), unit.count)
        if self.capture is not None:
            if not self.capture:
                grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in self.policy.params.items()}
                self.capture.update(full_state(grads))  # None: no unit of the step reached the tensor
            self.optimizer.zero_grad(set_to_none=True)
            return False
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

    def global_stats(self, stats: UpdateStats) -> UpdateStats:
        """Sums and counts over ranks (a collective); optimizer-step counts are already global."""
        keys = all_gather_keys(list(stats.sums))
        sums = all_reduce_sums({k: stats.sums.get(k, 0.0) for k in keys})
        counts = all_reduce_sums({k: stats.counts.get(k, 0.0) for k in keys})
        return dataclasses.replace(stats, sums=sums, counts=counts)


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
        from diffusionrl.training.full import build_policy
        from diffusionrl.training.objective import build_objective
        from diffusionrl.training.policy import warm_start

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
        self.policy = build_policy(self.adapter, cfg)
        warm_start(cfg, self.policy)  # algorithm.init_lora, before the engine copies the policy
        # The engine is built before sharding: it copies/keeps the full base weights it serves.
        self.engine = (engine_factory or make_engine)(cfg, self.adapter, self.policy) if holds_engine else None
        _, self.loss_factor = shard_policy(self.policy, cfg.train.mixed_precision, self.device, world_size)
        self.trainer = DistributedTrainer(cfg, self.policy, self.device, self.loss_factor)
        # After sharding: the objective's copies of the LoRA (old policy) are sharded like it.
        self.objective = build_objective(cfg, self.policy)
        self.optimizer_on = "device"
        self._start: dict[str, torch.Tensor] | None = None  # the LoRA ``reset`` returns to

    def reset(self, cfg_dict: dict) -> None:
        """Start over under another configuration of the same model: the LoRA back to its start, a new
        trainer (optimizer, EMA) and objective (benchmarks and tests: one group, many objectives)."""
        from diffusionrl.config import Config
        from diffusionrl.training.objective import build_objective

        cfg = Config.from_dict(cfg_dict)
        if cfg.model != self.cfg.model:
            raise ValueError("TrainerRank.reset keeps the model: its model section must be the rank's")
        if self._start is None:
            raise RuntimeError("TrainerRank.reset before mark_start()")
        load_full_state(self.policy.params, self._start)
        self.cfg = cfg
        self.trainer = DistributedTrainer(cfg, self.policy, self.device, self.loss_factor)
        self.objective = build_objective(cfg, self.policy)

    def mark_start(self) -> None:
        """Remember the LoRA as it is now for ``reset`` (a collective)."""
        self._start = full_state(self.policy.params)

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
    def train_step(self, traj, active: torch.Tensor, step: int) -> dict[str, float]:
        """The objective's step on the whole scored batch, this rank computing its share of every
        optimizer step's units; metrics are global."""
        if self.cfg.train.offload_optimizer:
            offload_optimizer_state(self.trainer.optimizer, self.device)
        self.trainer.begin_step(step)
        return self.objective.train_step(self.trainer, traj, active, step)

    def gradients(self, traj, active: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """The full LoRA gradient of the first optimizer step of the objective's step ``step`` on
        ``traj`` (nothing is updated; tests and benchmarks)."""
        self.trainer.capture = {}
        try:
            self.objective.train_step(self.trainer, traj, active, step)
            return self.trainer.capture
        finally:
            self.trainer.capture = None

    # -- weights ----------------------------------------------------------------------------------
    def lora_state(self) -> dict[str, torch.Tensor]:
        """The full LoRA on CPU (a collective: call it on every rank)."""
        return full_state(self.policy.params)

    def push_weights(self, version: int) -> float:
        """Gather the LoRA the engine samples with (every rank: the live policy, or the objective's own,
        NFT's old policy) and push it to this rank's engine; seconds of the push."""
        getter = getattr(self.objective, "rollout_state", None)
        state = full_state(getter() if getter else self.policy.params, to_cpu=self.device.type != "cuda")
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

    def objective_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The objective's own tensor groups (NFT's old policy), full tensors on CPU."""
        getter = getattr(self.objective, "state_tensors", None)
        return {group: full_state(tensors) for group, tensors in (getter() if getter else {}).items()}

    def load_objective_state(self, groups: dict[str, dict[str, torch.Tensor]]) -> None:
        """Each group's full tensors cut into this rank's shards (like the LoRA's) and handed to the
        objective; it checks that they are its own."""
        loader = getattr(self.objective, "load_state_tensors", None)
        if loader:
            loader({group: shard_like(self.policy.params, tensors) for group, tensors in groups.items()})

    def save_sharded(self, folder: str, marker: dict[str, int]) -> tuple[dict, dict[str, bytes]]:
        """This rank's shards of a sharded checkpoint (``distributed.sharded``): into the driver's ``folder`` where
        this rank sees it (``marker``), else returned as files (a collective: every rank)."""
        from . import sharded

        target = folder if sharded.sees(folder, marker) else None
        return sharded.save(self.policy, self.trainer, self.objective, target)

    def sees_sharded(self, folder: str, listing: dict[str, int]) -> bool:
        from . import sharded

        return sharded.sees(folder, listing)

    def load_sharded(self, folder: str, listing: dict[str, int], plain: dict, files: list | None) -> None:
        """Load a sharded checkpoint, resharded to this world size: from ``folder`` where this rank sees it, else
        from the driver's copy of its files (``[ObjectRef]``) (a collective: every rank)."""
        import ray

        from . import sharded

        data = None if files is None or sharded.sees(folder, listing) else ray.get(files[0])
        sharded.load(self.policy, self.trainer, self.objective, folder, plain, data)

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

    def full_model(self, ema: bool = False) -> tuple[list, dict[str, torch.Tensor]]:
        """Full fine-tuning: ``training.full.transformer_parts`` and the gathered weights (their EMA with
        ``ema``), full tensors on CPU (a collective: every rank)."""
        from diffusionrl.training.full import transformer_parts

        state = full_state(self.trainer.ema.shadow if ema else self.policy.params)
        return transformer_parts(self.policy.live), state

    def peft_config(self):
        return self.policy.model.peft_config["default"]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
