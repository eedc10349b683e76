"""GenEval in miniature: does RL make ``builtin:tiny-sd3-shapes`` draw what it is told?

Trains the ``tiny-cpu-shapes`` preset (the demo: the strict ``geneval_mini`` judge on
``builtin:shapes``) for ``--steps`` steps or until ``--budget-s`` seconds of training are spent (held-
out probes included, as in any run), then evaluates the base model and the tuned LoRA on every held-out
prompt, ``--eval-repeats`` seeds each (ODE sampling, the same seeds for both), and prints one JSON
line: base and tuned strict success overall (GenEval's rule: the mean of the category accuracies), over
all samples, and per category, each gain with its 90 % paired-bootstrap interval over the evaluation's
samples (``report.category_table``: the held-out split holds one ``single`` and one ``two`` prompt, so
the seeds alone move GenEval's overall a long way), objects and shapeless blobs per image, the
diversity (mean distance between images of different prompts, ``heldout.diversity``), the
reward-hacking alarms of the run, the training steps and wall time, the training reward per step and
the held-out probes (one progress line per step goes to
stderr). With ``--compare flow_grpo,nft,...`` each objective runs on the same budget with its own
preset's change set (``tiny-cpu-<name>``, as bench/learning.py) laid under the shapes task; with
``--seeds 0,1,2`` each runs once per training seed (``train.seed``), and each objective's entry holds
every seed's result and the mean and spread of the gain.

The first reward of ``reward.weights`` is the judge of the headline figures; every other one with a strict
success (``--set 'reward.weights={geneval_mini_rules: 1.0, geneval_mini: 0.0}'``: train on GenEval's own
rules, judge by both) is reported on the same samples under ``other_judges``.

``--keep DIR`` keeps each run's folder (``DIR/<objective>-seed<S>``: its LoRA, metrics and stored rollouts).

    python bench/geneval_mini.py [--steps N] [--budget-s S] [--clock wall|cpu] [--eval-repeats K] [--compare a,b,...]
                                 [--seeds 0,1,...] [--keep DIR] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common  # sets sys.path and offline env

from diffusionrl.config import ALGORITHMS, PRESETS, Config, apply_overrides
from diffusionrl.config.presets import TINY_CPU_SHAPES, preset_changes
from diffusionrl.data import load_prompts
from diffusionrl.evaluation import evaluate_lora
from diffusionrl.heldout import hacking_alarms
from diffusionrl.report import category_table, success_rewards
from diffusionrl.train import build_loop
from diffusionrl.trajectory import TrajectoryWriter


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


def accuracy(table, judge: str) -> dict:
    """Base and tuned accuracy by ``judge`` per category (``overall``: GenEval's mean of categories, ``all
    samples``), and the 90 % paired-bootstrap interval of each gain (``category_table``)."""
    per = category_table(table, reward=judge).set_index("category")
    sides = [side for side in ("base", "base_cfg", "tuned") if side in per]  # base_cfg: eval.base_guidance_scale
    out = {side: {c: round(float(per.loc[c, side]), 4) for c in per.index} for side in sides}
    out["gain_interval"] = {c: [round(float(per.loc[c, "gain_lo"]), 4), round(float(per.loc[c, "gain_hi"]), 4)]
                            for c in per.index}
    return out


def run_folder(keep: str | None, label: str):
    """Where a run writes: a temporary folder, or ``keep/<objective>-seed<S>`` (kept: its LoRA, metrics and
    stored rollouts, for ``shapes_base.py --lora`` and ``colour_drift.py``)."""
    if not keep:
        return tempfile.TemporaryDirectory()
    path = Path(keep) / label.replace(" seed ", "-seed")
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"--keep {keep}: {path} is not empty; give another --keep folder")
    path.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(path))


def run(name: str | None, steps: int | None, budget_s: float | None, repeats: int, overrides: list[str],
        seed: int | None = None, clock: str = "wall", keep: str | None = None) -> dict:
    extra = [f"eval.seeds_per_prompt={repeats}"] + ([f"train.steps={steps}"] if steps else [])
    extra += [f"train.seed={seed}"] if seed is not None else []
    cfg = shapes_config(name, overrides + extra)
    judge = next(iter(cfg.reward.weights))  # the headline judge; other strict judges go to other_judges
    test = load_prompts(cfg.data).test
    label = f"{name or cfg.algorithm.name} seed {cfg.train.seed}"
    with run_folder(keep, label) as folder:
        # a kept run stores its rollouts (pictures, prompts, advantages) as the workflow does
        writers = [TrajectoryWriter(Path(folder) / "trajectories", label, latents=False)] if keep else []
        loop = build_loop(cfg, folder, progress=False, callbacks=writers)
        loop.backend.push_weights(0)
        t0, c0 = time.perf_counter(), time.process_time()
        spent = (lambda: time.process_time() - c0) if clock == "cpu" else (lambda: time.perf_counter() - t0)
        while loop.step < cfg.train.steps and not (budget_s is not None and spent() >= budget_s):
            loop.run_step(loop.step)
            m = loop.history[-1]
            probe = (f", held-out {m['heldout/reward_mean']:.3f} success {m.get(f'heldout/{judge}_success', 0):.3f}"
                     f" diversity {m['heldout/diversity']:.3f}" if "heldout/reward_mean" in m else "")
            print(f"{label} step {loop.step}: reward {m['rollout/reward/raw_mean']:.3f} success "
                  f"{m.get(f'rollout/reward/{judge}_accuracy', float('nan')):.3f}{probe} at "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for writer in writers:
            writer.close()
        lora_dir, _ = loop.backend.save_outputs(loop.step)
        loop.close()
        t1 = time.perf_counter()
        result = evaluate_lora(cfg, test, lora_dir)
        eval_wall = time.perf_counter() - t1
    acc = accuracy(result.table, judge)
    table, summary = result.table, result.summary
    per_image = {side: {"objects": round(float(table[f"{side}_{judge}_objects"].mean()), 3),
                        "blobs": round(float(table[f"{side}_{judge}_blobs"].mean()), 3)}
                 for side in ("base", "tuned")}
    probes = [{"version": int(m["heldout/policy_version"]), "reward": round(m["heldout/reward_mean"], 4),
               "success": round(m.get(f"heldout/{judge}_success", float("nan")), 4),
               "diversity": round(m["heldout/diversity"], 4)} for m in loop.history if "heldout/reward_mean" in m]
    return {
        "objective": cfg.algorithm.name,
        "judge": judge,
        "seed": cfg.train.seed,
        "base_accuracy": acc["base"]["overall"],
        "tuned_accuracy": acc["tuned"]["overall"],
        "gain": round(acc["tuned"]["overall"] - acc["base"]["overall"], 4),
        "gain_interval": acc["gain_interval"]["overall"],
        "gain_all_samples": round(acc["tuned"]["all samples"] - acc["base"]["all samples"], 4),
        "gain_all_samples_interval": acc["gain_interval"]["all samples"],
        "base": acc["base"],
        **({"base_cfg": acc["base_cfg"], "base_guidance_scale": cfg.eval.base_guidance_scale} if "base_cfg" in acc
           else {}),
        "tuned": acc["tuned"],
        "prompts_with_a_success": {side: round(summary[f"eval/{p}{judge}_success/prompts_with_a_success"], 4)
                                   for side, p in (("base", "base_"), ("tuned", ""))},
        # the same samples by every other judge of reward.weights with a strict success (e.g. a 0-weight one)
        "other_judges": {n: {**accuracy(table, n), "prompts_with_a_success": {
            side: round(summary[f"eval/{p}{n}_success/prompts_with_a_success"], 4)
            for side, p in (("base", "base_"), ("tuned", ""))}} for n in success_rewards(table.columns) if n != judge},
        # the share of prompt groups whose samples all scored the same (no learning signal), per step
        "zero_std_share": [round(m.get("rollout/zero_std/count", 0) / cfg.train.prompts_per_step, 3)
                           for m in loop.history],
        "objects_per_image": {s: v["objects"] for s, v in per_image.items()},
        "blobs_per_image": {s: v["blobs"] for s, v in per_image.items()},
        "diversity": {"base": round(summary["eval/base_diversity"], 4), "tuned": round(summary["eval/diversity"], 4)},
        "alarms": [{"step": a.step, "reason": a.reason} for a in hacking_alarms(loop.history)],
        "held_out_prompts": len(test),
        "images_per_prompt": repeats,
        "steps": len(loop.history),
        "train_wall_s": round(wall, 1),
        "train_cpu_s": round(cpu, 1),
        "budget_clock": clock,
        "eval_wall_s": round(eval_wall, 1),
        "train_accuracy": [round(m.get(f"rollout/reward/{judge}_accuracy", float("nan")), 3) for m in loop.history],
        "train_reward": [round(m["rollout/reward/raw_mean"], 4) for m in loop.history],
        "probes": probes,
    }


def over_seeds(name: str | None, seeds: list[int], **kw) -> dict:
    """One objective on every training seed: each run's result and the gain's mean, spread and minimum."""
    runs = [run(name, seed=s, **kw) for s in seeds]
    gains = [r["gain"] for r in runs]
    return {"gain_mean": round(statistics.mean(gains), 4),
            "gain_std": round(statistics.stdev(gains), 4) if len(gains) > 1 else 0.0,
            "gain_min": min(gains),
            "gain_all_samples_mean": round(statistics.mean(r["gain_all_samples"] for r in runs), 4),
            "tuned_mean": round(statistics.mean(r["tuned_accuracy"] for r in runs), 4),
            "diversity_ratio_min": min(round(r["diversity"]["tuned"] / r["diversity"]["base"], 3) for r in runs),
            "alarms": sum(len(r["alarms"]) for r in runs), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's train.steps")
    ap.add_argument("--budget-s", type=float, default=None, help="training time budget per run")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="what --budget-s counts: wall-clock seconds, or this process's CPU seconds (on a machine "
                    "shared with other jobs; with OMP_NUM_THREADS=1 it equals wall-clock on an idle core)")
    ap.add_argument("--eval-repeats", type=int, default=4, help="evaluation seeds per held-out prompt")
    ap.add_argument("--compare", default=None, help="comma-separated objectives, e.g. flow_grpo,grpo_guard,dppo,"
                    "awm,dpo,nft")
    ap.add_argument("--seeds", default=None, help="comma-separated training seeds (default: the preset's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--keep", default=None, help="keep each run's folder under this one (default: a temporary one)")
    args = ap.parse_args()
    kw = {"steps": args.steps, "repeats": args.eval_repeats, "overrides": args.overrides, "clock": args.clock,
          "keep": args.keep}
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    if args.compare:
        kw["budget_s"] = args.budget_s if args.budget_s is not None else 600.0
        names = args.compare.split(",")
        if seeds:
            _common.emit({a: over_seeds(a, seeds, **kw) for a in names})
        else:
            _common.emit({a: run(a, **kw) for a in names})
    elif seeds:
        _common.emit(over_seeds(None, seeds, budget_s=args.budget_s, **kw))
    else:
        _common.emit(run(None, budget_s=args.budget_s, **kw))


if __name__ == "__main__":
    main()
