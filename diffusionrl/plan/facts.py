"""What the planner needs to know of a model, counted from the modules themselves: parameters of
the transformer (per FSDP unit and the root), of every frozen module beside it, the linear layers
a LoRA can target, the VAE's scale factors, and FLOPs of one sample's forward and backward:
``torch.utils.flop_counter.FlopCounterMode`` over the whole model at the real token count on the
``meta`` device (no memory, exact shapes), forward, and backward of the input gradient (the frozen
base computes no weight gradients; LoRA's are negligible).

Hub models are built from their configs (``archs.py``) on the meta device; a ``builtin:`` model is
built (it is tiny) and read exactly. Hub figures are cached in ``measured.json`` with the
activation fits (``python -m diffusionrl.plan.refresh`` rewrites them).
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter

import torch

from .archs import FAMILIES, GPU_REWARDS, module_params
from .measure import AMP, CACHE, forward_inputs, load_cache, stub_adapter

BLOCK_INDEX = re.compile(r"blocks[.][0-9]+[.]")  # transformer_blocks.7.attn.to_q -> transformer_blocks.*.attn.to_q


def model_config(reference: str) -> tuple[str, dict]:
    """(family, transformer config) of a builtin (read from its builder, once per process) or a hub
    model the planner knows the sizes of."""
    from .archs import HUB_MODELS

    if reference.startswith("builtin:"):
        facts = builtin_facts(reference)
        return facts["family"], facts["config"]
    if reference in HUB_MODELS:
        family = HUB_MODELS[reference]
        return family, dict(FAMILIES[family].config)
    from diffusionrl.config import ConfigError

    raise ConfigError(f"model.name={reference!r}: the planner knows the sizes of {sorted(HUB_MODELS)} and the "
                      "builtin models; add the hub config to diffusionrl/plan/archs.py (HUB_MODELS)")


def plannable(reference: str) -> bool:
    """Whether the planner has measured sizes for ``reference``: a hub model of ``HUB_MODELS`` or a
    builtin of a family in ``FAMILIES`` (Z-Image and FLUX.2 have adapters but no planner figures yet)."""
    from .archs import HUB_MODELS

    if reference.startswith("builtin:"):
        from diffusionrl.models.families import adapter_class

        return adapter_class(reference).family in FAMILIES
    return reference in HUB_MODELS


def _transformer_facts(family: str, transformer: torch.nn.Module) -> dict:
    spec = FAMILIES[family]
    adapter = stub_adapter(family, transformer, "no", "meta")
    dead = adapter.dead_lora_targets()
    total = sum(p.numel() for p in transformer.parameters())
    buffers = sum(b.numel() for b in transformer.buffers() if b.is_floating_point())
    linears: Counter = Counter()  # "<name, block index as *>|in|out" -> how many (a small cache)
    for n, m in transformer.named_modules():
        if isinstance(m, torch.nn.Linear) and n not in dead:
            linears[f"{BLOCK_INDEX.sub(r'blocks.*.', n)}|{m.in_features}|{m.out_features}"] += 1
    # Every block of every block list is an FSDP unit (distributed/fsdp.block_units), the rest the root.
    blocks = [sum(p.numel() for p in b.parameters()) for name in spec.blocks for b in getattr(transformer, name)]
    return {"family": family, "params": total, "buffers": buffers, "fsdp_units": blocks,
            "fsdp_root": total - sum(blocks), "largest_block": max(blocks), "linears": dict(linears)}


def hub_facts(reference: str) -> dict:
    """Facts of a hub model the planner knows (``archs.HUB_MODELS``), built on the meta device."""
    family, config = model_config(reference)
    spec = FAMILIES[family]
    facts = _transformer_facts(family, spec.build(config, "meta"))
    facts["others"] = {name: module_params(s) for name, s in spec.others.items()}
    facts.update(config=config, vae_scale=8, temporal_scale=4)
    return facts


@functools.cache
def builtin_facts(reference: str) -> dict:
    """Facts of a builtin tiny model, read from its built pipeline (once per process; do not modify)."""
    from diffusionrl.models.families import adapter_class, builtin_builder

    cls = adapter_class(reference)
    pipe = builtin_builder(reference)()
    facts = _transformer_facts(cls.family, pipe.transformer)
    facts["others"] = {name: sum(p.numel() for p in getattr(pipe, name).parameters())
                       for name in cls.components if name != "transformer" and getattr(pipe, name, None) is not None}
    vae = pipe.vae.config
    scale = (2 ** (len(vae.block_out_channels) - 1) if "block_out_channels" in vae
             else 2 ** len(vae.temperal_downsample))
    temporal = 2 ** sum(vae.temperal_downsample) if "temperal_downsample" in vae else 1
    facts.update(config=dict(pipe.transformer.config), vae_scale=scale, temporal_scale=temporal)
    return facts


def model_facts(reference: str, cache: dict | None = None) -> dict:
    """Facts of ``reference``: cached for hub models, built for builtins (of a family the planner has
    figures for: else one ``ConfigError`` naming the families it knows)."""
    if reference.startswith("builtin:"):
        if not plannable(reference):
            from diffusionrl.config import ConfigError
            from diffusionrl.models.families import adapter_class

            raise ConfigError(f"model.name={reference!r}: the planner has no figures for the "
                              f"{adapter_class(reference).family} family yet (it plans {', '.join(sorted(FAMILIES))}); "
                              "add it to diffusionrl/plan/archs.py (FAMILIES)")
        return builtin_facts(reference)
    cache = load_cache(CACHE) if cache is None else cache
    if reference in cache.get("facts", {}):
        return cache["facts"][reference]
    return hub_facts(reference)


def lora_params(facts: dict, suffixes: list[str], rank: int) -> int:
    """Trainable LoRA parameters: ``rank * (in + out)`` of every matched linear (``LoraPolicy``'s rule)."""
    total = 0
    for key, count in facts["linears"].items():
        name, i, o = key.rsplit("|", 2)
        if any(name.endswith(s) for s in suffixes):
            total += count * rank * (int(i) + int(o))
    return total


def reward_params(weights: dict[str, float]) -> int:
    """Parameters of the reward models that score on a GPU (PickScore); the others run on CPUs."""
    return sum(_reward_params(name) for name in weights if name in GPU_REWARDS)


@functools.cache
def _reward_params(name: str) -> int:
    return module_params(GPU_REWARDS[name])


# -- FLOPs ---------------------------------------------------------------------------------------
def measure_flops(family: str, config: dict, side: int, text: int, frames: int = 1, amp: str = "bf16") -> dict:
    key = (family, json.dumps(config, sort_keys=True, default=list), side, text, frames, amp)
    if key not in _FLOPS:
        _FLOPS[key] = _measure_flops(family, config, side, text, frames, amp)
    return _FLOPS[key]


_FLOPS: dict = {}


def _measure_flops(family: str, config: dict, side: int, text: int, frames: int = 1, amp: str = "bf16") -> dict:
    """Forward and input-gradient backward FLOPs of one sample on the meta device (exact shapes)."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = FAMILIES[family]
    dtype = AMP[amp] or torch.float32
    model = spec.build(config, "meta", dtype)
    adapter = stub_adapter(family, model, "no", "meta")
    x, t, cond = forward_inputs(family, config, 1, side, text, device="meta", dtype=dtype)
    if family == "wan" and frames > 1:
        x = torch.empty(1, x.shape[1], frames, side, side, device="meta")
    x.requires_grad_(True)
    with FlopCounterMode(display=False) as fwd:
        v = adapter.velocity(model, x, t, cond, 1.0)
    with FlopCounterMode(display=False) as bwd:
        v.sum().backward()
    return {"forward": int(fwd.get_total_flops()), "backward": int(bwd.get_total_flops())}


def flops(reference: str, facts: dict, side: int, text: int, frames: int, cache: dict | None = None) -> dict:
    """Forward and backward FLOPs of one sample (cached for hub models at the presets' shapes)."""
    key = f"{reference}|{side}|{text}|{frames}"
    cache = load_cache(CACHE) if cache is None else cache
    if key in cache.get("flops", {}):
        return cache["flops"][key]
    return measure_flops(facts["family"], facts["config"], side, text, frames)
