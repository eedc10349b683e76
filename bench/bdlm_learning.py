"""Does RL on exact traces teach a block-diffusion LM? (one JSON line on stdout; a table on stderr)

Warm start (masked-diffusion / uniform-corruption SFT) then RL with the preset's objective, or with
each objective of ``--compare``; greedy exact match and reward on the held-out split after each:

    {"acc_warm_start": ..., "acc_grpo": ..., "wall_s": ...}
    {"acc_warm_start": ..., "acc_teacher": ..., "acc_grpo": ..., "acc_dapo": ..., "acc_dr_grpo": ...,
     "acc_opd": ..., ...}                                                         (--compare)

``--budget-s S`` gives every objective the same RL wall time: steps run until ``S`` seconds of
training are spent (or ``grpo.steps``, ``--steps``, whichever comes first); ``--eval-at`` adds
held-out evaluations of the live policy on the way (a learning curve; their time is not counted
in the budget, and greedy decoding draws no random numbers, so they do not change the run).
``--seeds 0,1`` repeats every objective with each RL seed (``grpo.seed``: prompts and samples;
same warm start) and reports the mean and the spread of the gain.

``opd`` distils from a teacher trained here: the same warm start, ``--teacher-steps`` long.
``dapo`` uses clip-higher ``grpo.clip_range_high=0.28``. Every objective starts from the same warm
start. With ``--out DIR`` the warm start and the teacher are kept there and reused by a later run
with the same model, task and warm-start settings.

Run alone with ``OMP_NUM_THREADS=1 .venv/bin/python bench/bdlm_learning.py [--preset tiny-diffusiongemma]
[--compare grpo,dapo,dr_grpo,opd] [--budget-s 300] [--seeds 0,1] [--set key=value ...]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch

from diffusionrl.bdlm import evaluate, evaluate_adapter, load_bdlm_config, make_splits, warm_start
from diffusionrl.bdlm.backend import build_grpo_loop
from diffusionrl.bdlm.config import OBJECTIVE_NAMES
from diffusionrl.run import Callback

EXTRA = {"dapo": ["grpo.clip_range_high=0.28"]}
UNBOUNDED_STEPS = 1_000_000  # with --budget-s and no --steps: the budget alone ends the run


class BudgetSpent(Exception):
    pass


class Budget(Callback):
    """Ends a run once its training wall time (evaluations excluded) reaches ``budget_s`` (0: never)
    and evaluates the live policy once each mark of ``eval_at`` (seconds) is passed."""

    def __init__(self, cfg, budget_s: float, eval_at: list[float]):
        self.cfg, self.budget_s = cfg, budget_s
        self.pending = sorted(t for t in eval_at if not budget_s or t < budget_s)
        self.examples = make_splits(cfg.task).test
        self.t0, self.paused = time.perf_counter(), 0.0
        self.curve: list[dict[str, float]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    def on_step(self, loop, step, batch, metrics) -> None:
        spent = self.elapsed()
        done = bool(self.budget_s) and spent >= self.budget_s  # the final evaluation follows
        if self.pending and spent >= self.pending[0] and not done:
            while self.pending and spent >= self.pending[0]:
                self.pending.pop(0)
            t = time.perf_counter()
            ev = evaluate_adapter(self.cfg, loop.backend.live, self.examples)
            self.paused += time.perf_counter() - t
            self.curve.append({"step": step, "train_s": round(spent, 1), "acc": round(ev["eval/exact_match"], 4)})
            print(f"  step {step} at {spent:.0f} s: held-out exact match {ev['eval/exact_match']:.3f}",
                  file=sys.stderr, flush=True)
        if done:
            raise BudgetSpent


def run_objective(cfg, out: Path, init_dir: Path, budget_s: float, eval_at: list[float]):
    """Train fresh in ``out``; returns (model folder, metrics per step, steps, training seconds, curve)."""
    budget = Budget(cfg, budget_s, eval_at)
    loop = build_grpo_loop(cfg, out, init_dir, callbacks=[budget], progress=False)
    try:
        loop.run(resume=None)
    except BudgetSpent:
        pass
    finally:
        loop.close()
    spent = budget.elapsed()
    model_dir, _ = loop.backend.save_outputs(loop.step)
    return model_dir, loop.history, loop.step, spent, budget.curve


def cached_warm_start(cfg, out: Path) -> Path:
    """``warm_start`` into ``out``, reused when ``out`` holds one of the same model, task and warm start."""
    key = hashlib.sha256(json.dumps({k: cfg.to_dict()[k] for k in ("model", "task", "warm_start")},
                                    sort_keys=True).encode()).hexdigest()
    stamp = out / "bench_key.txt"
    if stamp.is_file() and stamp.read_text() == key and (out / "model").is_dir():
        return out / "model"
    model_dir = warm_start(cfg, out, progress=False)
    stamp.write_text(key)
    return model_dir


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f}" + (f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny-bdlm")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--compare", default="", help="comma-separated objectives, e.g. grpo,dapo,dr_grpo,opd")
    ap.add_argument("--budget-s", type=float, default=0.0, help="RL wall-time budget per objective and seed")
    ap.add_argument("--steps", type=int, default=0, help="cap on RL steps (default: the preset's, or none "
                    "with --budget-s)")
    ap.add_argument("--eval-at", default="", help="comma-separated training seconds of extra held-out evaluations")
    ap.add_argument("--seeds", default="", help="comma-separated RL seeds (grpo.seed); default: the preset's")
    ap.add_argument("--teacher-steps", type=int, default=2000, help="opd: warm-start steps of the teacher")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--verbose", action="store_true", help="per-step reward on stderr")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = [n for n in args.compare.split(",") if n] or [load_bdlm_config(args.preset, args.overrides).grpo.objective]
    unknown = sorted(set(names) - set(OBJECTIVE_NAMES))
    if unknown:
        ap.error(f"--compare: unknown objectives {unknown}; choose from {list(OBJECTIVE_NAMES)}")
    steps = args.steps or (UNBOUNDED_STEPS if args.budget_s else 0)
    base = args.overrides + ["grpo.save_traces=false"] + ([f"grpo.steps={steps}"] if steps else [])
    seeds = [int(s) for s in args.seeds.split(",") if s] or [None]
    eval_at = [float(t) for t in args.eval_at.split(",") if t]
    cfg = load_bdlm_config(args.preset, base)
    t0 = time.perf_counter()
    out_row: dict[str, float] = {"budget_s": args.budget_s}
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        init_dir = cached_warm_start(cfg, out / "warm")
        out_row["warm_start_s"] = round(time.perf_counter() - t0, 1)
        before = evaluate(cfg, init_dir)
        acc0 = round(before["eval/exact_match"], 4)
        out_row.update(acc_warm_start=acc0, reward_warm_start=round(before["eval/reward_mean"], 4))
        table.append((f"warm start ({cfg.warm_start.steps} SFT steps)", f"{acc0:.3f}", "",
                      f"{before['eval/reward_mean']:.3f}", "", f"{out_row['warm_start_s']:.0f}"))
        teacher_dir = None
        if "opd" in names:
            t = time.perf_counter()
            tcfg = load_bdlm_config(args.preset, base + [f"warm_start.steps={args.teacher_steps}"])
            teacher_dir = cached_warm_start(tcfg, out / "teacher")
            ev = evaluate(cfg, teacher_dir)
            out_row.update(acc_teacher=round(ev["eval/exact_match"], 4),
                           reward_teacher=round(ev["eval/reward_mean"], 4))
            table.append((f"teacher for opd ({args.teacher_steps} SFT steps)", f"{ev['eval/exact_match']:.3f}", "",
                          f"{ev['eval/reward_mean']:.3f}", "", f"{time.perf_counter() - t:.0f}"))
        for name in names:
            accs, rewards, step_counts, secs = [], [], [], []
            for seed in seeds:
                extra = [f"grpo.objective={name}"] + EXTRA.get(name, []) + ([f"grpo.seed={seed}"] if seed is not None
                                                                            else [])
                if name == "opd":
                    extra.append(f"grpo.teacher={teacher_dir}")
                rcfg = load_bdlm_config(args.preset, base + extra)
                tag = name if seed is None else f"{name}-seed{seed}"
                print(f"{tag}: training", file=sys.stderr, flush=True)
                model_dir, history, n, spent, curve = run_objective(rcfg, out / tag, init_dir, args.budget_s, eval_at)
                ev = evaluate(rcfg, model_dir)
                accs.append(ev["eval/exact_match"])
                rewards.append(ev["eval/reward_mean"])
                step_counts.append(n)
                secs.append(spent)
                row = {"objective": name, "seed": rcfg.grpo.seed, "steps": n, "train_s": round(spent, 1),
                       "acc": round(ev["eval/exact_match"], 4), "reward": round(ev["eval/reward_mean"], 4),
                       "curve": curve}
                print("result " + json.dumps(row), file=sys.stderr, flush=True)
                out_row[f"acc_{tag}"] = row["acc"]
                out_row[f"steps_{tag}"], out_row[f"train_s_{tag}"] = n, row["train_s"]
                if args.verbose:
                    for m in history:
                        print(f"{tag} step {m['step']:.0f} reward {m['rollout/reward/raw_mean']:.3f} "
                              f"exact {m['rollout/reward/exact_mean']:.3f} entropy {m.get('train/entropy', 0):.3f} "
                              f"t {m['perf/step_time']:.2f}s", file=sys.stderr)
            gains = [a - acc0 for a in accs]
            out_row.update({f"acc_{name}": round(statistics.mean(accs), 4),
                            f"gain_{name}": round(statistics.mean(gains), 4),
                            f"reward_{name}": round(statistics.mean(rewards), 4)})
            table.append((name, spread(accs), ("+" if statistics.mean(gains) >= 0 else "") + spread(gains),
                          spread(rewards), "/".join(map(str, step_counts)), "/".join(f"{s:.0f}" for s in secs)))
    out_row["wall_s"] = round(time.perf_counter() - t0, 1)
    label = f"{args.preset}" + (f", {args.budget_s:.0f} s RL budget" if args.budget_s else "")
    n_seeds = f"{len(seeds)} seeds: mean (min-max)" if len(seeds) > 1 else "1 seed"
    print(f"| {label} ({n_seeds}) | held-out exact match | gain | reward | RL steps | wall s |\n"
          "| --- | --- | --- | --- | --- | --- |", file=sys.stderr)
    for cells in table:
        print("| " + " | ".join(cells) + " |", file=sys.stderr)
    _common.emit(out_row)


if __name__ == "__main__":
    main()
