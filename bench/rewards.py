"""Throughput of the OCR reward on Ray CPU actors: the scaling curve over pool sizes, on clean text renders.

    .venv/bin/python bench/rewards.py [--images 64] [--size 512] [--curve 1,2,4] [--actors N] [--threads 1]
                                      [--no-pin] [--repeats 2]

Each pool gets the whole batch per call, cut into one contiguous shard per actor (one batched
``score`` call per actor). Each actor runs onnxruntime with ``--threads`` intra-op threads and, unless
``--no-pin``, is pinned to its own cores (``rewards.pool.pin_to_cores``). Pool sizes above the CPU
count are measured too (oversubscribed: the curve shows what that costs). Each size is timed
``--repeats`` times over the batch, rounds alternating between sizes, and its fastest round counts
(other load on a shared machine hits every size alike).

Prints one JSON object: ``curve`` (images/s per pool size), ``speedup_curve`` (each over 1 actor),
the headline ``ocr_images_per_s_1_actor`` / ``ocr_images_per_s_pool`` / ``speedup`` for the pool of
``--actors`` (default: the CPU count), and the mean OCR reward of the renders (black text in
Pillow's built-in font on white; should be >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from diffusionrl.config import RewardConfig
from diffusionrl.data.ocr import generate_ocr_prompts
from diffusionrl.rewards.ocr import render_text_image
from diffusionrl.rewards.pool import RewardActorPool, ensure_ray


def make_batch(n: int, size: int, seed: int = 0):
    """``n`` generator prompts and clean renders of their texts: varied size, height and ink colour."""
    rows, _ = generate_ocr_prompts(n, seed=seed, test_fraction=0.0)
    rng = np.random.default_rng(seed)
    images = [
        render_text_image(
            row["text"], size=size, font_size=int(rng.integers(size // 14, size // 8)),
            y=float(rng.uniform(0.1, 0.8)) * size, color=tuple(int(c) for c in rng.integers(0, 90, 3)),
            background=(250, 248, 240),
        )
        for row in rows
    ]
    return np.stack(images), [r["prompt"] for r in rows], [{} for _ in rows]


def one_round(pool: RewardActorPool, batch) -> tuple[float, np.ndarray]:
    images, prompts, meta = batch
    start = time.perf_counter()
    _, parts = pool(images, prompts, meta)
    return len(prompts) / (time.perf_counter() - start), parts["ocr"].scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--actors", type=int, default=os.cpu_count() or 2, help="headline pool size (default: CPUs)")
    parser.add_argument("--curve", default="1,2,4", help="pool sizes to measure")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads per actor")
    parser.add_argument("--no-pin", action="store_true", help="do not pin actors to cores")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    sizes = sorted({int(v) for v in args.curve.split(",")} | {1, args.actors})
    batch = make_batch(args.images, args.size)
    started = ensure_ray(num_cpus=sum(sizes) * args.threads)  # every pool alive at once (idle ones wait)
    cfg = RewardConfig(weights={"ocr": 1.0}, num_actors=1)
    images, prompts, meta = batch
    pools = {}
    try:
        for n in sizes:  # all pools up first; warm-up: every actor scores one image
            pools[n] = RewardActorPool(cfg, num_actors=n, threads_per_actor=args.threads, pin_cores=not args.no_pin)
            pools[n](images[:n], prompts[:n], meta[:n])
        best = {n: 0.0 for n in sizes}
        scores = None
        for _ in range(args.repeats):
            for n in sizes:
                rate, scores = one_round(pools[n], batch)
                best[n] = max(best[n], rate)
    finally:
        for pool in pools.values():
            pool.close()
    result = {
        "curve": {str(n): round(best[n], 2) for n in sizes},
        "speedup_curve": {str(n): round(best[n] / best[1], 2) for n in sizes},
        "ocr_images_per_s_1_actor": round(best[1], 2),
        "ocr_images_per_s_pool": round(best[args.actors], 2),
        "pool_size": args.actors,
        "speedup": round(best[args.actors] / best[1], 2),
        "clean_render_mean_reward": round(float(np.mean(scores)), 4),
        "threads_per_actor": args.threads,
        "pinned": not args.no_pin,
        "num_images": args.images,
        "image_size": args.size,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
    }
    if started:
        import ray

        ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
