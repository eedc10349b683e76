"""GenEval in miniature: does RL make ``builtin:tiny-sd3-shapes`` draw what it is told?

Trains the ``tiny-cpu-shapes`` preset (Flow-GRPO + the ``geneval_mini`` reward on ``builtin:shapes``)
for ``--steps`` steps or until ``--budget-s`` seconds of training are spent, then evaluates the base
model and the tuned LoRA on every held-out prompt, ``--eval-repeats`` seeds each (ODE sampling, the
same seeds for both), and prints one JSON line: base and tuned accuracy overall and per category
(GenEval's success rate), the gain, the training steps and wall time, the training reward and
accuracy per step (one progress line per step goes to stderr). With ``--compare flow_grpo,nft,...``
each objective runs on the same budget with its own preset's change set (``tiny-cpu-<name>``, as
bench/learning.py) laid under the shapes task, and the result is {"flow_grpo": {...}, "nft": {...}}.

    python bench/geneval_mini.py [--steps N] [--budget-s S] [--eval-repeats K] [--compare a,b,...]
                                 [--set key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import _common  # sets sys.path and offline env

from diffusionrl.config import PRESETS, Config
from diffusionrl.config_objectives import ALGORITHMS
from diffusionrl.configtree import apply_overrides
from diffusionrl.data import load_prompts
from diffusionrl.evaluation import evaluate_lora
from diffusionrl.presets import TINY_CPU_SHAPES, preset_changes
from diffusionrl.report import category_table
from diffusionrl.train import build_loop


def shapes_config(name: str | None, overrides: list[str]) -> Config:
    """``tiny-cpu-shapes``, with objective ``name``'s own preset changes laid under the shapes task."""
    own = f"tiny-cpu-{(name or '').replace('_', '-')}"
    changes = preset_changes(own) + (TINY_CPU_SHAPES,) if own in PRESETS else preset_changes("tiny-cpu-shapes")
    data = Config().to_dict()
    for change in changes:
        data = Config.merge_dicts(data, change, "bench")
    extra = ["train.checkpoint_every=0", "train.log_images_every=0"]
    if name in ALGORITHMS:
        extra.append(f"algorithm.name={name}")
    elif name and own not in PRESETS:
        raise SystemExit(f"--compare: {name!r} is neither an algorithm ({', '.join(ALGORITHMS)}) nor a preset")
    data["preset"] = "tiny-cpu-shapes"
    return Config.from_dict(apply_overrides(data, extra + overrides), where="bench")


def accuracy(table) -> dict:
    per = category_table(table).set_index("category")
    return {side: {c: round(float(per.loc[c, side]), 4) for c in per.index} for side in ("base", "tuned")}


def run(name: str | None, steps: int | None, budget_s: float | None, repeats: int, overrides: list[str]) -> dict:
    cfg = shapes_config(name, overrides + ([f"train.steps={steps}"] if steps else []))
    test = load_prompts(cfg.data).test
    with tempfile.TemporaryDirectory() as tmp:
        loop = build_loop(cfg, tmp, progress=False)
        loop.backend.push_weights(0)
        t0 = time.perf_counter()
        while loop.step < cfg.train.steps and not (budget_s is not None and time.perf_counter() - t0 >= budget_s):
            loop.run_step(loop.step)
            m = loop.history[-1]
            train_acc = m.get("rollout/reward/geneval_mini_accuracy", float("nan"))
            print(f"{name or 'flow_grpo'} step {loop.step}: reward {m['rollout/reward/raw_mean']:.3f} accuracy "
                  f"{train_acc:.3f} at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        wall = time.perf_counter() - t0
        lora_dir, _ = loop.backend.save_outputs(loop.step)
        loop.close()
        t1 = time.perf_counter()
        result = evaluate_lora(cfg, [r for r in test for _ in range(repeats)], lora_dir)
        eval_wall = time.perf_counter() - t1
    acc = accuracy(result.table)
    return {
        "objective": cfg.algorithm.name,
        "base_accuracy": acc["base"]["overall"],
        "tuned_accuracy": acc["tuned"]["overall"],
        "gain": round(acc["tuned"]["overall"] - acc["base"]["overall"], 4),
        "base": acc["base"],
        "tuned": acc["tuned"],
        "held_out_prompts": len(test),
        "images_per_prompt": repeats,
        "steps": len(loop.history),
        "train_wall_s": round(wall, 1),
        "eval_wall_s": round(eval_wall, 1),
        "train_accuracy": [round(m.get("rollout/reward/geneval_mini_accuracy", float("nan")), 3) for m in loop.history],
        "train_reward": [round(m["rollout/reward/raw_mean"], 4) for m in loop.history],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's train.steps")
    ap.add_argument("--budget-s", type=float, default=None, help="training wall-time budget per objective")
    ap.add_argument("--eval-repeats", type=int, default=4, help="evaluation seeds per held-out prompt")
    ap.add_argument("--compare", default=None, help="comma-separated objectives, e.g. flow_grpo,grpo_guard,dppo,"
                    "awm,dpo,nft")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    if args.compare:
        budget = args.budget_s if args.budget_s is not None else 600.0
        names = args.compare.split(",")
        _common.emit({a: run(a, args.steps, budget, args.eval_repeats, args.overrides) for a in names})
    else:
        _common.emit(run(None, args.steps, args.budget_s, args.eval_repeats, args.overrides))


if __name__ == "__main__":
    main()
