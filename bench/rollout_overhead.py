"""Our rollout (SDE log-probs + trajectory recording) vs stock ``StableDiffusion3Pipeline.__call__``.

Same tiny model and transformer module, same prompts (4 prompts x 4 samples), steps, CFG, size
and batch; the two are timed alternately in one process and the medians compared.

Prints {"ours_s": ..., "stock_s": ..., "ratio": ...}.

    python bench/rollout_overhead.py [--images 16] [--steps 10] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common  # sets sys.path and offline env
import torch

from diffusionrl.models import SD3Adapter, build_tiny_sd3_pipeline
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    adapter = SD3Adapter(build_tiny_sd3_pipeline())
    pipe = adapter.pipe
    pipe.set_progress_bar_config(disable=True)
    engine = LocalRolloutEngine(adapter, pipe.transformer, micro_batch_size=args.images)
    spec = SamplingSpec(resolution=args.resolution, num_steps=args.steps, guidance_scale=4.5, max_sequence_length=32)
    groups = args.images // args.group_size
    base = ["a red cat on the beach", "a blue car in the city", "a small house", "a golden cake on a table",
            "a green tree", "a black dog", "a silver robot", "a wooden boat"]
    prompts = [base[g % len(base)] for g in range(groups) for _ in range(args.group_size)]
    group_ids = [g for g in range(groups) for _ in range(args.group_size)]
    seeds = list(range(args.images))

    def ours() -> None:
        engine.generate(prompts, group_ids, seeds, spec)

    def stock() -> None:
        pipe(prompt=prompts, num_inference_steps=args.steps, guidance_scale=4.5, height=args.resolution,
             width=args.resolution, max_sequence_length=32, output_type="np",
             generator=[torch.Generator().manual_seed(s) for s in seeds])

    for fn in (ours, stock):  # warm-up
        fn()
    times: dict[str, list[float]] = {"ours": [], "stock": []}
    with torch.no_grad():
        for i in range(args.repeats):
            order = (("ours", ours), ("stock", stock)) if i % 2 == 0 else (("stock", stock), ("ours", ours))
            for name, fn in order:
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    ours_s, stock_s = statistics.median(times["ours"]), statistics.median(times["stock"])
    _common.emit({
        "ours_s": round(ours_s, 4),
        "stock_s": round(stock_s, 4),
        "ratio": round(ours_s / stock_s, 4),
        "images": args.images,
        "steps": args.steps,
        "resolution": args.resolution,
        "repeats": args.repeats,
    })


if __name__ == "__main__":
    main()
