"""Is the update signal or noise? Two runs from one LoRA initialisation, on other prompts and noise.

Each training seed (``train.seed``: its own prompts, sample seeds and SDE steps) starts from the same
LoRA (the first seed's initialisation, loaded into the others before their first step) and trains
``--steps`` steps; the bench prints the cosine between the runs' weight changes ``B A`` (the LoRA's
delta over every target module, flattened). A reward gradient the batches share moves both runs the
same way, a cosine well above 0; updates made of sampling noise give a cosine near 0 (with Adam's
per-parameter steps, the cosine of two noisy gradients' signs is ``(2/pi) arcsin(rho)`` for their
correlation ``rho``). The check for "why does this task not learn": if the cosine stays near 0 as
``train.prompts_per_step`` or ``--steps`` grows, the objective cannot find the reward's direction at
that budget.

    python bench/update_agreement.py [--preset tiny-cpu-shapes] [--steps 3] [--seeds 0,1] [--set key=value ...]

Objectives that sample with a copy of their own (DiffusionNFT's old policy) are refused: the loaded
initialisation would not reach their sampler.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time

import _common  # sets sys.path and offline env
import torch

from diffusionrl.config import load_config
from diffusionrl.rollout.sglang.weight_sync import LoraLayer, lora_layers
from diffusionrl.train import build_loop


def lora_delta(layers: list[LoraLayer], state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The LoRA's weight change ``scaling * B @ A`` of every layer (as the SGLang weight sync merges
    it), flattened and concatenated."""
    return torch.cat([(layer.scaling * state[layer.b_key].float() @ state[layer.a_key].float()).flatten()
                      for layer in layers])


def train_from(preset: str, seed: int, steps: int, overrides: list[str], init: dict | None):
    extra = [f"train.seed={seed}", f"train.steps={steps}", "eval.every=0", "train.checkpoint_every=0",
             "train.log_images_every=0"]
    cfg = load_config(preset, overrides=overrides + extra)
    with tempfile.TemporaryDirectory() as tmp:
        loop = build_loop(cfg, tmp, progress=False)
        worker = loop.backend.worker
        policy = getattr(worker, "policy", None)
        if policy is None:
            raise SystemExit("update_agreement: needs the in-process policy (train.world_size=1)")
        if hasattr(getattr(worker, "objective", None), "rollout_state"):
            raise SystemExit(f"update_agreement: {cfg.algorithm.name} samples with a policy copy of its own")
        start = policy.lora_state() if init is None else init
        policy.load_lora_state(start)
        loop.backend.push_weights(0)
        t0 = time.perf_counter()
        rewards = []
        for step in range(steps):
            loop.run_step(step)
            rewards.append(round(loop.history[-1]["rollout/reward/raw_mean"], 4))
        wall = time.perf_counter() - t0
        final = policy.lora_state()
        layers = lora_layers(policy.model)
        loop.close()
    samples = cfg.train.prompts_per_step * cfg.train.group_size
    return start, lora_delta(layers, final) - lora_delta(layers, start), samples, rewards, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-cpu-shapes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seeds", default="0,1", help="comma-separated training seeds (two or more)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(seeds) < 2:
        raise SystemExit("--seeds: two or more")
    init, deltas, runs = None, {}, []
    for seed in seeds:
        start, delta, samples, rewards, wall = train_from(args.preset, seed, args.steps, args.overrides, init)
        init = start if init is None else init
        deltas[seed] = delta
        runs.append({"seed": seed, "delta_norm": round(float(delta.norm()), 4), "train_reward": rewards,
                     "wall_s": round(wall, 1)})
    cosines = {f"{a},{b}": round(float(torch.nn.functional.cosine_similarity(deltas[a], deltas[b], dim=0)), 4)
               for a, b in itertools.combinations(seeds, 2)}
    _common.emit({"bench": "update_agreement", "preset": args.preset, "overrides": args.overrides,
                  "steps": args.steps, "samples_per_step": samples, "cosine": cosines,
                  "cosine_mean": round(sum(cosines.values()) / len(cosines), 4), "runs": runs})


if __name__ == "__main__":
    main()
