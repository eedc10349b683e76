"""``LocalPolicyWorker``: the policy side of a run in this process.

It holds the family adapter, the LoRA policy, the trainer, the objective and the rollout engine;
``training.backend.ImageBackend`` drives it (``distributed.ranks.RankGroup`` is the same interface
over trainer ranks in Ray actors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffusionrl.models import load_adapter
from diffusionrl.rollout.factory import make_engine
from diffusionrl.run import CheckpointState
from diffusionrl.trajectory import Trajectory

from .full import build_policy
from .objective import build_objective, checkpointed_tensors
from .policy import warm_start
from .preflight import check_inputs
from .trainer import Trainer

EngineFactory = Callable[..., Any]  # (cfg, adapter, policy) -> engine, like rollout.factory.make_engine


class LocalPolicyWorker:
    """Adapter, LoRA policy, trainer, objective and engine of one single-process run.

    ``model_path`` loads the base weights from a fetched folder; the run's identity (checkpoint
    metadata, lineage) stays ``cfg.model.name`` and the weights' digest.
    """

    def __init__(self, cfg, model_path: str | None = None, engine_factory: EngineFactory | None = None):
        self.cfg = cfg
        check_inputs(cfg, model_path)  # a mistake in the model or init_lora: one line, before the weights load
        model_cfg = dataclasses.replace(cfg.model, name=model_path) if model_path else cfg.model
        self.adapter = load_adapter(model_cfg, cfg.train.mixed_precision)
        self.policy = build_policy(self.adapter, cfg)
        warm_start(cfg, self.policy)  # e.g. an SFT run's LoRA, before the optimizer and old copies
        self.trainer = Trainer(cfg, self.policy)
        self.objective = build_objective(cfg, self.policy)
        self.engine = (engine_factory or make_engine)(cfg, self.adapter, self.policy)

    def digest(self) -> str:
        return self.adapter.digest()

    def info(self) -> dict[str, Any]:
        """What this layout adds to checkpoints and saved adapters (nothing for one process)."""
        return {}

    # -- one step --------------------------------------------------------------------------------
    def generate(self, prompts, group_ids, seeds, spec, mask, metadata) -> Trajectory:
        return self.engine.generate(prompts, group_ids, seeds, spec, mask, metadata)

    def train_step(self, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]:
        self.trainer.begin_step(step)
        return self.objective.train_step(self.trainer, traj, active, step)

    def push_weights(self, version: int) -> dict[str, float]:
        """Hand the engine the LoRA it samples with: the live policy, or the objective's own
        (NFT's old policy). Returns extra perf metrics (none here)."""
        getter = getattr(self.objective, "rollout_state", None)
        self.engine.update_weights(getter() if getter else self.policy.lora_state(), version)
        return {}

    # -- checkpoint state ------------------------------------------------------------------------
    def checkpoint_parts(self) -> dict[str, Any]:
        """LoRA, optimizer, scaler and extra tensor groups (EMA, the objective's own); with
        ``train.checkpoint_format=sharded`` the tensors go into DCP's files instead (``distributed.sharded``)."""
        trainer = self.trainer
        scaler = trainer.scaler.state_dict() if trainer.scaler.is_enabled() else {}
        if self.cfg.train.checkpoint_format == "sharded":
            from diffusionrl.distributed import sharded

            def write(folder):
                plain, _ = sharded.save(self.policy, trainer, self.objective, str(folder), no_dist=True)
                return {"optimizer": plain, "world_size": 1}

            return {"lora": {}, "optimizer": {}, "scaler": scaler, "tensors": {}, "write_shards": write}
        return {"lora": self.policy.lora_state(), "optimizer": trainer.optimizer.state_dict(), "scaler": scaler,
                "tensors": checkpointed_tensors(trainer, self.objective)}

    def load_checkpoint_parts(self, state: CheckpointState) -> None:
        """Either format, whatever world size wrote it."""
        trainer = self.trainer
        if state.scaler and trainer.scaler.is_enabled():
            trainer.scaler.load_state_dict(state.scaler)
        if state.sharded is not None:
            from diffusionrl.distributed import sharded

            sharded.load(self.policy, trainer, self.objective, state.sharded["folder"], state.sharded["optimizer"],
                         no_dist=True)
            return
        self.policy.load_lora_state(state.lora)
        trainer.optimizer.load_state_dict(state.optimizer)
        if trainer.ema is not None and "ema" in state.tensors:
            device = self.adapter.device
            trainer.ema.shadow = {k: v.to(device).clone() for k, v in state.tensors["ema"].items()}
        loader = getattr(self.objective, "load_state_tensors", None)
        if loader:
            loader(state.tensors)

    # -- outputs ---------------------------------------------------------------------------------
    def save_lora(self, out_dir: Path, info: dict[str, Any]) -> tuple[Path, dict[str, Path]]:
        """The trained adapter in peft format (``adapter_model.safetensors``), and its EMA, each with
        its model card (``serving.model_card``) in place of peft's empty template; with full fine-tuning the
        trained transformer(s) as diffusers model folders under ``model/`` (``model_ema/``)."""
        from diffusionrl.serving.model_card import adapter_facts, describe_folder

        info = {**info, **adapter_facts(self.cfg, self.adapter.family, self.adapter.pipeline_class)}
        if self.policy.finetune == "full":  # every transformer weight: diffusers model folders
            from .full import transformer_parts, write_full_outputs

            ema = self.trainer.ema.state() if self.trainer.ema is not None else None
            return write_full_outputs(transformer_parts(self.policy.live), self.policy.lora_state(), ema, out_dir,
                                      info, self.cfg.train.ema_decay)
        out = out_dir / "lora"
        self.policy.model.save_pretrained(str(out))
        describe_folder(out, info)
        extra = {}
        if self.trainer.ema is not None:
            ema_dir = out_dir / "lora_ema"
            live = self.policy.lora_state()
            self.policy.load_lora_state(self.trainer.ema.state())
            try:
                self.policy.model.save_pretrained(str(ema_dir))
            finally:
                self.policy.load_lora_state(live)
            describe_folder(ema_dir, {**info, "ema_decay": self.cfg.train.ema_decay})
            extra["ema"] = ema_dir
        return out, extra

    def close(self) -> None:
        self.engine.close()
