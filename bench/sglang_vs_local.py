"""The SGLang engine (a real ``sglang serve`` on this machine) vs the local engine on one batch.

Same tiny model, LoRA policy, prompts, seeds, steps, CFG, size and SDE step set; each engine is
timed over ``--repeats`` rollouts of the batch (medians), the local engine before the server
starts. Also times one weight push (merged LoRA, by value, with checksum verification off) and
measures our trainer's recompute of the server's log-probs on its own trajectories with a non-zero LoRA (fp32).

The SGLang engine sends the samples of a group (one prompt, one SDE step set) in requests of at
most ``sampling.sglang_outputs_per_request`` outputs; it is timed at each of ``--per-request``
(default 1, 4, 16; the group size is 16, so 16 is one request per group), the same batch each time.

Prints {"local_images_per_s": ..., "sglang_images_per_s": ... (at the engine's default, the last
of --per-request), "sglang_images_per_s_by_outputs_per_request": {...}, "sglang_vs_local": ...,
"push_s": ..., "cross_engine_log_prob_mean_abs_diff": ...}. Needs the SGLang venv (`make sglang-env`).

    python bench/sglang_vs_local.py [--images 32] [--group-size 16] [--per-request 1,4,16] [--steps 10]
                                    [--resolution 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common  # sets sys.path and offline env
import numpy as np
import torch

from diffusionrl.algorithms.sde import sde_step_mask
from diffusionrl.config import load_config
from diffusionrl.models import load_adapter
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.rollout.sglang import SGLangRolloutEngine
from diffusionrl.training.flow_grpo import FlowGRPOObjective
from diffusionrl.training.policy import LoraPolicy


def recompute_diff(cfg, policy, traj) -> float:
    return FlowGRPOObjective(cfg, policy).recompute_log_prob_diff(traj)[0]


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--per-request", default="1,4,16", help="sampling.sglang_outputs_per_request values to time")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    cfg = load_config("tiny-cpu-sglang", overrides=[
        f"sampling.num_steps={args.steps}", f"sampling.resolution={args.resolution}",
        f"train.group_size={args.group_size}", f"train.prompts_per_step={args.images // args.group_size}",
        f"train.micro_batch_size={args.images}", "sampling.sglang_verify_weights=false",
        "sampling.sglang_start_timeout_s=1800",  # the start is not what is timed; a loaded machine is slow
    ])
    adapter = load_adapter(cfg.model)
    policy = LoraPolicy(adapter, cfg.model, seed=0)
    g = torch.Generator().manual_seed(1)  # a non-zero LoRA, as after some training
    policy.load_lora_state({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in policy.lora_state().items()})
    state = policy.lora_state()

    groups = args.images // args.group_size
    base = ["a red cat on the beach", "a blue car in the city", "a small house", "a golden cake on a table"]
    prompts = [base[i % len(base)] for i in range(groups) for _ in range(args.group_size)]
    group_ids = [i for i in range(groups) for _ in range(args.group_size)]
    seeds = list(range(args.images))
    sc = cfg.sampling
    mask = np.repeat(sde_step_mask(sc.step_strategy, sc.num_steps, list(range(groups)), num_sde_steps=sc.num_sde_steps,
                                   window_range=sc.window_range), args.group_size, axis=0)
    spec = SamplingSpec.from_config(cfg)

    local = LocalRolloutEngine(adapter, policy.engine_copy(), micro_batch_size=args.images)
    local.update_weights(state, 1)
    with torch.no_grad():  # timed before the server starts: an idle server still polls a core
        local_s = median_time(lambda: local.generate(prompts, group_ids, seeds, spec, mask), args.repeats)
    sglang = SGLangRolloutEngine.from_config(cfg, adapter, policy)
    per_request = [int(v) for v in args.per_request.split(",")]
    by_n, diffs = {}, []
    try:
        t = time.perf_counter()
        sglang.update_weights(state, 1)
        push_s = time.perf_counter() - t
        with torch.no_grad():
            for n in per_request:
                sglang.outputs_per_request = n
                sglang_s = median_time(lambda: sglang.generate(prompts, group_ids, seeds, spec, mask), args.repeats)
                by_n[str(n)] = round(args.images / sglang_s, 3)
                traj = sglang.generate(prompts, group_ids, seeds, spec, mask)
                diffs.append(recompute_diff(cfg, policy, traj))  # the bound holds however the batch was split
    finally:
        sglang.close()
    local_rate = args.images / local_s
    _common.emit({
        "local_images_per_s": round(local_rate, 3),
        "sglang_images_per_s": by_n[str(per_request[-1])],
        "sglang_images_per_s_by_outputs_per_request": by_n,
        "sglang_vs_local": round(by_n[str(per_request[-1])] / local_rate, 3),
        "push_s": round(push_s, 4),
        "cross_engine_log_prob_mean_abs_diff": max(diffs),
        "images": args.images,
        "group_size": args.group_size,
        "steps": args.steps,
        "resolution": args.resolution,
        "sde_pairs": int(mask.sum()),
        "lora_tensors_pushed": len(sglang.layers),
        "repeats": args.repeats,
    })


if __name__ == "__main__":
    main()
