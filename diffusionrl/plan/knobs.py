"""When a plan does not fit: which setting fixes it, and what it costs.

Each knob is a config change (or, for encoder offload, a part that no key moves yet); the plan is
recomputed with it, so the answer is the planner's own arithmetic, not a rule of thumb.
"""

from __future__ import annotations

from diffusionrl.config import Config, ConfigError, apply_overrides, objective

from .model import GIB, PCIE, Plan, plan

WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)


def with_changes(cfg, overrides: list[str]):
    """``cfg`` with dotted overrides, validated (None when the config then fails its checks)."""
    try:
        return Config.from_dict(apply_overrides(cfg.to_dict(), overrides))
    except ConfigError:
        return None


def scaled(cfg, world_size: int):
    """``cfg`` on ``world_size`` GPUs: engines follow the ranks when every rank held one."""
    tc = cfg.train
    over = [f"train.world_size={world_size}"]
    if tc.placement == "colocate" and (tc.rollout_engines == tc.world_size or world_size < tc.rollout_engines):
        over.append(f"train.rollout_engines={world_size}")
    return with_changes(cfg, over)


def candidates(cfg) -> list[tuple[str, list[str]]]:
    """(knob, overrides) worth trying on ``cfg``, cheapest first."""
    m, tc, s = cfg.model, cfg.train, cfg.sampling
    out = []
    if not m.gradient_checkpointing:
        out.append(("model.gradient_checkpointing=true", ["model.gradient_checkpointing=true"]))
    batch = tc.prompts_per_step * tc.group_size
    for mb in range(tc.micro_batch_size - 1, 0, -1):
        if batch % mb == 0:
            out.append((f"train.micro_batch_size={mb}", [f"train.micro_batch_size={mb}"]))
    if not tc.offload_optimizer:
        out.append(("train.offload_optimizer=true", ["train.offload_optimizer=true"]))
    if s.engine == "sglang" and not tc.memory_handoff:
        out.append(("train.memory_handoff=true", ["train.memory_handoff=true"]))
    if s.engine == "local":
        out.append(("sampling.engine=sglang train.memory_handoff=true",
                     ["sampling.engine=sglang", "train.memory_handoff=true"]))
    if m.dtype == "float32":
        out.append(("model.dtype=bfloat16", ["model.dtype=bfloat16"]))
    return out


def cost(base: Plan, new: Plan, knob: str, cfg) -> str:
    if knob.startswith("train.micro_batch_size"):
        return f"the same FLOPs in smaller kernels (step ~{new.step_s:.0f} s planned, lower MFU in practice)"
    if knob.startswith("train.offload_optimizer"):
        moved = new.train.get("optimizer (AdamW, 2 x fp32)", 0.0)
        return f"2 host copies of {moved / GIB:.2f} GiB a step (+{2 * moved / PCIE:.2f} s at {PCIE / 1e9:.0f} GB/s)"
    if knob.startswith("sampling.engine"):
        return ("no local engine copy of the transformer; the SGLang server's weights leave the GPU while the "
                "trainer trains and come back for every rollout")
    if knob.startswith("train.memory_handoff"):
        return "the SGLang server frees and re-takes its weights around every rollout"
    if knob.startswith("model.dtype"):
        return "bf16 frozen weights (the LoRA stays fp32)"
    return f"step {base.step_s:.0f} s -> {new.step_s:.0f} s"


def advise(cfg, gpu: str, gpu_memory: float | None = None, base: Plan | None = None, **kw) -> list[str]:
    """One line per knob that fixes ``cfg`` on ``gpu``, with the peak it gives and what it costs;
    then the smallest world size that fits, and the text encoders' share (no key moves them yet)."""
    base = base or plan(cfg, gpu, gpu_memory, **kw)
    lines, micro_batch_found = [], False
    for knob, over in candidates(cfg):
        is_mb = knob.startswith("train.micro_batch_size")
        new_cfg = None if (is_mb and micro_batch_found) else with_changes(cfg, over)
        if new_cfg is None:
            continue
        new = plan(new_cfg, gpu, gpu_memory, **kw)
        if new.fits:  # the largest micro-batch that fits, and each other knob that does
            micro_batch_found |= is_mb
            lines.append(f"{knob}: peak {new.peak / GIB:.1f} GiB; cost: {cost(base, new, knob, cfg)}")
    for n in WORLD_SIZES:
        if n <= cfg.train.world_size or not objective(cfg.algorithm.name).ranks:  # ranks.py refuses the others
            continue
        new_cfg = scaled(cfg, n)
        if new_cfg is None:
            continue
        new = plan(new_cfg, gpu, gpu_memory, **kw)
        if new.fits:
            lines.append(f"train.world_size={n} (FSDP2 shards base weights, LoRA, gradients and optimizer over "
                         f"{n} GPUs): peak {new.peak / GIB:.1f} GiB; cost: {n} GPUs instead of {cfg.train.world_size}")
            break
    if not lines:  # no single knob: all of them at once
        over = [o for knob, o in candidates(cfg) if not knob.startswith("train.micro_batch_size")]
        over = [x for o in over for x in o] + ["train.micro_batch_size=1"]
        new_cfg = with_changes(cfg, over)
        if new_cfg is not None:
            new = plan(new_cfg, gpu, gpu_memory, **kw)
            lines.append(f"{' '.join(over)} together: peak {new.peak / GIB:.1f} GiB "
                         f"({'fits' if new.fits else 'still over'})")
    enc = base.train.get("text encoders + VAE", 0.0)
    if enc and base.peak - enc * 1.1 <= base.gpu_memory:
        lines.append(f"text encoders + VAE on the CPU (no config key yet: needs code): -{enc / GIB:.1f} GiB; "
                     "cost: prompt encoding on the CPU")
    return lines
