"""Throughput of the OCR reward on Ray CPU actors: one actor vs a pool, on clean text renders.

    .venv/bin/python bench/rewards.py [--images 64] [--size 512] [--actors N] [--threads 1]

Prints one JSON object: images/s with 1 actor and with the pool, the pool size and the mean OCR
reward of the renders (black text in Pillow's built-in font on white; should be >= 0.9).
Each actor runs onnxruntime with ``--threads`` intra-op threads so actors do not fight for cores.
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
from diffusionrl.data_ocr import generate_ocr_prompts
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


def images_per_s(pool: RewardActorPool, batch, repeats: int) -> tuple[float, np.ndarray]:
    images, prompts, meta = batch
    pool(images[: pool.num_actors], prompts[: pool.num_actors], meta[: pool.num_actors])  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        _, parts = pool(images, prompts, meta)
    elapsed = time.perf_counter() - start
    return repeats * len(prompts) / elapsed, parts["ocr"].scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--actors", type=int, default=os.cpu_count() or 2, help="pool size (default: CPU count)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads per actor")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    batch = make_batch(args.images, args.size)
    started = ensure_ray(num_cpus=max(args.actors, 1))
    cfg = RewardConfig(weights={"ocr": 1.0}, num_actors=args.actors)
    result = {}
    for key, actors in (("ocr_images_per_s_1_actor", 1), ("ocr_images_per_s_pool", args.actors)):
        pool = RewardActorPool(cfg, num_actors=actors, threads_per_actor=args.threads)
        rate, scores = images_per_s(pool, batch, args.repeats)
        pool.close()
        result[key] = round(rate, 2)
    result["pool_size"] = args.actors
    result["clean_render_mean_reward"] = round(float(np.mean(scores)), 4)
    result["speedup"] = round(result["ocr_images_per_s_pool"] / result["ocr_images_per_s_1_actor"], 2)
    result["threads_per_actor"] = args.threads
    result["num_images"] = args.images
    result["image_size"] = args.size
    result["cpu_count"] = os.cpu_count()
    if started:
        import ray

        ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
