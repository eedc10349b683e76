"""``python -m diffusionrl.plan.refresh``: measure again what ``measured.json`` caches for every
preset's model (and Qwen-Image): the activation fits (``measure.measure_saved``), and for hub models
their parameter facts and FLOP counts at the presets' shapes (``facts.py``). ``--only FLUX`` for one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .archs import tokens
from .facts import hub_facts, measure_flops, model_config, plannable
from .measure import CACHE, cache_key, load_cache, lora_suffixes, measure_saved

# Hub models no preset uses yet, measured too: Qwen-Image in bf16 with flow_grpo's LoRA (r64, both streams).
EXTRA = [("Qwen/Qwen-Image", "bfloat16", "bf16", 64,
          ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
           "txt_mlp.net.2"], [(512, 1, 512)])]


def cached_entries() -> list[tuple]:
    """(reference, weights dtype, amp, LoRA rank, LoRA targets (``None``: a full fine-tune), [(resolution, frames,
    prompt tokens), ...]) of every preset's model the planner knows (``facts.plannable``; the shapes: those of
    the presets using it, for the FLOP counts)."""
    from diffusionrl.config import get_preset
    from diffusionrl.config.presets import PRESETS

    out: dict[str, tuple] = {}
    for name in PRESETS:
        cfg = get_preset(name)
        m, s = cfg.model, cfg.sampling
        if not plannable(m.name):  # a family the planner has no figures for yet (check.check_fits says so)
            continue
        full = m.finetune == "full"
        targets = None if full else lora_suffixes(model_config(m.name)[0], m.lora_targets)
        entry = (m.name, m.dtype, cfg.train.mixed_precision, m.lora_rank, targets, [])
        out.setdefault(cache_key(m.name, m.dtype, cfg.train.mixed_precision, m.finetune), entry)[5].append(
            (s.resolution, s.num_frames, m.max_sequence_length))
    out.update({cache_key(*e[:3]): e for e in EXTRA})
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Re-measure the planner's cached activation figures (measured.json)")
    ap.add_argument("--only", default="", help="measure only references containing this string")
    ap.add_argument("--out", default=str(CACHE))
    args = ap.parse_args(argv)
    cache = load_cache(Path(args.out))
    cache.setdefault("facts", {})
    for reference, wd, amp, rank, targets, shapes in cached_entries():
        if args.only and args.only not in reference:
            continue
        t0 = time.perf_counter()
        family, config = model_config(reference)
        finetune = "full" if targets is None else "lora"
        cache["saved"][cache_key(reference, wd, amp, finetune)] = measure_saved(family, config, wd, amp, rank, targets)
        if not reference.startswith("builtin:"):  # builtins are read from their builders
            facts = cache["facts"][reference] = hub_facts(reference)
            for resolution, frames, text in shapes:
                _, n_txt = tokens(family, config, resolution, frames, text, facts["vae_scale"], facts["temporal_scale"])
                side = resolution // facts["vae_scale"]
                latent_frames = (frames - 1) // facts["temporal_scale"] + 1 if family == "wan" else 1
                cache["flops"][f"{reference}|{side}|{n_txt}|{latent_frames}"] = measure_flops(
                    family, config, side, n_txt, latent_frames)
        print(f"{reference} {wd}/{amp} {finetune}: {time.perf_counter() - t0:.1f} s", flush=True)
        Path(args.out).write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
