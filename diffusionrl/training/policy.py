"""The LoRA policy: the family adapter's transformer wrapped by peft, plus its EMA."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from diffusionrl.config import ConfigError
from diffusionrl.models.base import FlowAdapter


class TrainedTensors:
    """What every policy does with its trained tensors ``params`` (name -> parameter, as the subclass's
    ``refresh_params`` collects them): the optimizer's list, detached copies, exact loads and swaps."""

    kind = "LoRA"  # what the tensors are, in errors

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def lora_state(self) -> dict[str, torch.Tensor]:
        """Detached copies of the trainable tensors, keyed by ``named_parameters`` names."""
        return {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def load_lora_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.params) - set(state)
        unknown = set(state) - set(self.params)
        if missing or unknown:
            raise KeyError(f"{self.kind} state mismatch: {len(missing)} missing, {len(unknown)} unknown tensors")
        for name, value in state.items():
            self.params[name].copy_(value)

    @contextlib.contextmanager
    def swapped(self, state: dict[str, torch.Tensor]):
        """Inside: the network carries the tensors ``state`` (exact copies; use under ``no_grad`` and before any
        forward whose graph is still needed), the live ones copied back on exit."""
        live = self.lora_state()
        self.load_lora_state(state)
        try:
            yield
        finally:
            self.load_lora_state(live)


class LoraPolicy(TrainedTensors):
    """peft LoRA on the transformer's attention projections; only LoRA tensors train.

    The reference model of the KL term is the same network with the adapter disabled
    (``reference()``), so no second copy of the base weights is held.
    """

    def __init__(self, adapter: FlowAdapter, model_cfg, seed: int = 0):
        self.adapter = adapter
        targets = adapter.lora_targets(list(model_cfg.lora_targets), model_cfg.lora_experts)
        lora_cfg = LoraConfig(
            r=model_cfg.lora_rank,
            lora_alpha=model_cfg.lora_alpha,
            init_lora_weights="gaussian" if model_cfg.lora_init == "gaussian" else True,
            target_modules=targets,
            lora_dropout=0.0,
        )
        adapter.digest()  # digest of the base weights, taken before LoRA layers are injected
        torch.manual_seed(seed)  # the LoRA A init is random: seed it so runs are reproducible
        self.model = get_peft_model(adapter.transformer, lora_cfg)
        self.model.eval()  # no dropout anywhere: rollout and training see the same function
        if model_cfg.gradient_checkpointing:
            self.model.get_base_model().enable_gradient_checkpointing()
        self.lora_config = lora_cfg
        self.refresh_params()
        if not self.params:
            raise RuntimeError("the LoRA policy has no trainable parameters")

    finetune = "lora"

    def sharded_modules(self) -> list[torch.nn.Module]:
        """The modules FSDP2 shards (``distributed.fsdp.shard_policy``): the transformer with its LoRA layers."""
        return [self.model.get_base_model()]

    def refresh_params(self) -> None:
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def load_adapter_folder(self, folder: str | Path, label: str | None = None) -> None:
        """Start from a saved peft LoRA (``adapter_model.safetensors``, e.g. an SFT run's ``lora/``);
        its tensors must be exactly this policy's (same rank, alpha-independent shapes, targets).
        ``label`` names the folder in errors (the URI it was downloaded from)."""
        label = label or str(folder)
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(folder) / "adapter_model.safetensors"
        if not path.is_file():
            raise ConfigError(f"algorithm.init_lora={label}: no adapter_model.safetensors there; give a peft LoRA "
                              "folder (a run's <out>/lora)")
        state = load_file(str(path))
        expected = get_peft_model_state_dict(self.model)
        missing, unknown = set(expected) - set(state), set(state) - set(expected)
        bad = [k for k in set(state) & set(expected) if state[k].shape != expected[k].shape]
        if missing or unknown or bad:
            raise ConfigError(
                f"algorithm.init_lora={label} does not fit this LoRA: {len(missing)} missing, {len(unknown)} unknown, "
                f"{len(bad)} mis-shaped tensors, e.g. {sorted(missing | unknown | set(bad))[:2]}; set model.lora_rank "
                "and model.lora_targets to the LoRA's (its adapter_config.json), or start fresh (init_lora='')"
            )
        set_peft_model_state_dict(self.model, state)

    def engine_copy(self) -> torch.nn.Module:
        """A separate copy of the wrapped transformer for an in-process rollout engine."""
        return copy.deepcopy(self.model)

    def reference(self):
        """Context manager: inside it the model is the base model (LoRA disabled)."""
        return self.model.disable_adapter()


def warm_start(cfg, policy: LoraPolicy) -> None:
    """Load ``algorithm.init_lora`` (a peft LoRA folder or a run folder's URI, downloaded first) into
    ``policy``; nothing when it is empty. Before the optimizer, the old-policy copies and any engine copy."""
    if not cfg.algorithm.init_lora:
        return
    import tempfile

    from diffusionrl.run import local_copy

    with tempfile.TemporaryDirectory() as tmp:
        folder = local_copy(cfg.algorithm.init_lora, Path(tmp) / "init_lora")
        policy.load_adapter_folder(folder, label=cfg.algorithm.init_lora)


class EMA:
    """Exponential moving average of tensors: ``shadow <- decay * shadow + (1 - decay) * value``."""

    def __init__(self, state: dict[str, torch.Tensor], decay: float):
        self.decay = decay
        self.shadow = {n: t.detach().clone().float() for n, t in state.items()}

    @torch.no_grad()
    def update(self, params: dict[str, torch.Tensor], decay: float | None = None) -> None:
        d = self.decay if decay is None else decay
        for name, value in params.items():
            self.shadow[name].mul_(d).add_(value.detach().float(), alpha=1.0 - d)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.shadow.items()}
