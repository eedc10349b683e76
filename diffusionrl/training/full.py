"""Full fine-tuning (``model.finetune=full``): every weight of the family's transformer trains.

``FullPolicy`` has ``LoraPolicy``'s interface, so the trainer, every objective, the engines, the
checkpoints and the ranks drive either: ``params`` are all the transformer's parameters (fp32 master
weights; ``train.mixed_precision`` sets the compute precision: autocast in one process, FSDP2's
``param_dtype`` on ranks), ``lora_state`` / ``load_lora_state`` / ``swapped`` copy all of them. The
KL term's reference (``reference()``) cannot be the same network with an adapter disabled: it is a
frozen copy of the base transformer, built only when the run needs one (``needs_reference``), and
inside ``reference()`` ``policy.model`` is that copy. A copy rather than swapping the base weights in:
the live forward's graph, which the backward still needs, holds the live weights.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from diffusionrl.config import ConfigError
from diffusionrl.config.objectives import needs_reference
from diffusionrl.models.base import FlowAdapter

from .policy import TrainedTensors


class FullPolicy(TrainedTensors):
    """Every transformer weight trains; ``model`` is the live transformer (the reference copy inside
    ``reference()``); ``lora_state`` / ``load_lora_state`` / ``swapped`` act on all of them."""

    finetune = "full"
    kind = "transformer"

    def __init__(self, adapter: FlowAdapter, model_cfg, reference: bool = False):
        self.adapter = adapter
        adapter.digest()  # digest of the base weights, before any update
        self.live = adapter.transformer
        if any(p.dtype != torch.float32 for p in self.live.parameters()):
            raise ConfigError("model.finetune=full needs fp32 master weights: set model.dtype=float32")
        self.live.requires_grad_(True)
        self.live.eval()  # no dropout anywhere: rollout and training see the same function
        if model_cfg.gradient_checkpointing:
            self.live.enable_gradient_checkpointing()
        self.frozen = copy.deepcopy(self.live).requires_grad_(False) if reference else None
        self._in_reference = False
        self.refresh_params()

    @property
    def model(self) -> torch.nn.Module:
        return self.frozen if self._in_reference else self.live

    def sharded_modules(self) -> list[torch.nn.Module]:
        """The modules FSDP2 shards (``distributed.fsdp.shard_policy``): the live transformer and the reference."""
        return [self.live] + ([self.frozen] if self.frozen is not None else [])

    def refresh_params(self) -> None:
        self.params = {n: p for n, p in self.live.named_parameters()}

    @contextlib.contextmanager
    def reference(self):
        """Inside: ``model`` is the frozen copy of the base transformer."""
        if self.frozen is None:
            raise RuntimeError("this FullPolicy holds no reference copy (built with reference=False)")
        self._in_reference = True
        try:
            yield
        finally:
            self._in_reference = False

    def engine_copy(self) -> torch.nn.Module:
        """A separate copy of the transformer for an in-process rollout engine."""
        return copy.deepcopy(self.live).requires_grad_(False)

    def load_adapter_folder(self, folder, label: str | None = None) -> None:
        raise ConfigError("model.finetune=full starts from the base weights: algorithm.init_lora does not apply")


def build_policy(adapter: FlowAdapter, cfg):
    """The policy ``model.finetune`` names over ``adapter``: a ``LoraPolicy`` or a ``FullPolicy``."""
    if cfg.model.finetune == "full":
        return FullPolicy(adapter, cfg.model, reference=needs_reference(cfg))
    from .policy import LoraPolicy

    return LoraPolicy(adapter, cfg.model, seed=cfg.train.seed)


def _components(module: torch.nn.Module) -> list[tuple[str, str, torch.nn.Module]]:
    """``(pipeline component, parameter-name prefix, module)`` of each transformer in ``module``: Wan2.2's
    ``WanExperts`` holds ``transformer`` (``high``) and ``transformer_2`` (``low``), every other family one."""
    if all(hasattr(module, a) for a in ("high", "low", "boundary")):
        return [("transformer", "high.", module.high), ("transformer_2", "low.", module.low)]
    return [("transformer", "", module)]


def transformer_parts(module: torch.nn.Module) -> list[tuple[str, str, str, dict[str, torch.Tensor]]]:
    """What a model folder needs besides the trained weights, per transformer in ``module`` (``_components``):
    ``(component, parameter-name prefix, config.json text, persistent buffers on CPU)``. Small: the
    driver receives it from a rank and writes the folders itself."""
    parts = []
    for component, prefix, sub in _components(module):
        params = {n for n, _ in sub.named_parameters()}
        buffers = dict(sub.named_buffers())
        kept = {k: buffers[k].detach().cpu().contiguous() for k in sub.state_dict() if k not in params and k in buffers}
        parts.append((component, prefix, sub.to_json_string(), kept))
    return parts


def save_transformers(parts, state: dict[str, torch.Tensor], folder) -> list:
    """Write the trained weights ``state`` (keyed like the policy's ``named_parameters()``; full tensors) as
    one diffusers model folder per pipeline component under ``folder`` (``transformer/``, and
    ``transformer_2/`` for Wan2.2; ``parts`` from ``transformer_parts``): ``config.json`` and
    ``diffusion_pytorch_model.safetensors``, which ``<TransformerClass>.from_pretrained`` loads. Returns the
    folders written."""
    from pathlib import Path

    from safetensors.torch import save_file

    written = []
    for component, prefix, config_json, buffers in parts:
        out = Path(folder) / component
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(config_json)
        tensors = {k[len(prefix):]: v.detach().cpu().contiguous() for k, v in state.items() if k.startswith(prefix)}
        save_file({**tensors, **buffers}, str(out / "diffusion_pytorch_model.safetensors"))
        written.append(out)
    return written


@torch.no_grad()
def load_transformers(module: torch.nn.Module, folder) -> torch.nn.Module:
    """A copy of ``module`` carrying the weights ``save_transformers`` wrote under ``folder``."""
    from pathlib import Path

    from safetensors.torch import load_file

    tuned = copy.deepcopy(module)
    for component, _prefix, sub in _components(tuned):
        path = Path(folder) / component / "diffusion_pytorch_model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no trained {component} there (a full fine-tune's model folder holds "
                                    "one folder per transformer)")
        sub.load_state_dict(load_file(str(path)), strict=True)
    return tuned.eval().requires_grad_(False)


def write_full_model(parts, state: dict[str, torch.Tensor], folder, info: dict):
    """A full fine-tune's model folder: ``save_transformers``, ``diffusionrl.json`` (``info`` with
    ``finetune`` and the ``components`` written) and the card (``serving.model_card.render_full_card``)."""
    import json
    from pathlib import Path

    from diffusionrl.serving.model_card import render_full_card

    folder = Path(folder)
    written = save_transformers(parts, state, folder)
    info = {**info, "finetune": "full", "components": [f.name for f in written]}
    (folder / "diffusionrl.json").write_text(json.dumps(info, indent=1))
    (folder / "README.md").write_text(render_full_card(info))
    return folder


def is_full_model(folder) -> bool:
    """Whether ``folder`` is a full fine-tune's model folder (``write_full_model``), not a LoRA's."""
    import json
    from pathlib import Path

    info = Path(folder) / "diffusionrl.json"
    return info.is_file() and json.loads(info.read_text()).get("finetune") == "full"


def write_full_outputs(parts, state: dict[str, torch.Tensor], ema_state: dict[str, torch.Tensor] | None, out_dir,
                       info: dict, ema_decay: float):
    """A full fine-tune's outputs under ``out_dir``: ``model/`` (``state``) and, with an EMA, ``model_ema/``
    (``ema_state``), each ``write_full_model``. Returns the model folder and ``{"ema": folder}`` (or ``{}``)."""
    from pathlib import Path

    out = write_full_model(parts, state, Path(out_dir) / "model", info)
    if ema_state is None:
        return out, {}
    return out, {"ema": write_full_model(parts, ema_state, Path(out_dir) / "model_ema",
                                         {**info, "ema_decay": ema_decay})}
