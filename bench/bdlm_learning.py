"""Does RL on exact traces teach a block-diffusion LM? (one JSON line on stdout; a table on stderr)

Warm start (masked-diffusion / uniform-corruption SFT) then RL with the preset's objective, or with
each objective of ``--compare``; greedy exact match and reward on the held-out split after each:

    {"acc_warm_start": ..., "acc_grpo": ..., "wall_s": ...}
    {"acc_warm_start": ..., "acc_teacher": ..., "acc_grpo": ..., "acc_dapo": ..., "acc_dr_grpo": ...,
     "acc_opd": ..., ...}                                                         (--compare)

``opd`` distils from a teacher trained here: the same warm start, ``--teacher-steps`` long.
``dapo`` uses clip-higher ``grpo.clip_range_high=0.28``. Every objective starts from the same warm
start with the same seeds.

Run alone with ``OMP_NUM_THREADS=1 .venv/bin/python bench/bdlm_learning.py [--preset tiny-diffusiongemma]
[--compare grpo,dapo,dr_grpo,opd] [--set key=value ...]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch

from diffusionrl.bdlm import evaluate, load_bdlm_config, train_grpo, warm_start
from diffusionrl.bdlm.config import OBJECTIVE_NAMES

EXTRA = {"dapo": ["grpo.clip_range_high=0.28"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny-bdlm")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--compare", default="", help="comma-separated objectives, e.g. grpo,dapo,dr_grpo,opd")
    ap.add_argument("--teacher-steps", type=int, default=2000, help="opd: warm-start steps of the teacher")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--verbose", action="store_true", help="per-step reward on stderr")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = [n for n in args.compare.split(",") if n] or [load_bdlm_config(args.preset, args.overrides).grpo.objective]
    unknown = sorted(set(names) - set(OBJECTIVE_NAMES))
    if unknown:
        ap.error(f"--compare: unknown objectives {unknown}; choose from {list(OBJECTIVE_NAMES)}")
    cfg = load_bdlm_config(args.preset, args.overrides)
    t0 = time.perf_counter()
    out_row: dict[str, float] = {}
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        init_dir = warm_start(cfg, out / "warm", progress=False)
        out_row["warm_start_s"] = round(time.perf_counter() - t0, 1)
        before = evaluate(cfg, init_dir)
        out_row.update(acc_warm_start=round(before["eval/exact_match"], 4),
                       reward_warm_start=round(before["eval/reward_mean"], 4))
        table.append((f"warm start ({cfg.warm_start.steps} SFT steps)", before, out_row["warm_start_s"]))
        teacher_dir = None
        if "opd" in names:
            t = time.perf_counter()
            tcfg = load_bdlm_config(args.preset, args.overrides + [f"warm_start.steps={args.teacher_steps}"])
            teacher_dir = warm_start(tcfg, out / "teacher", progress=False)
            ev = evaluate(cfg, teacher_dir)
            out_row.update(acc_teacher=round(ev["eval/exact_match"], 4),
                           reward_teacher=round(ev["eval/reward_mean"], 4))
            table.append((f"teacher ({args.teacher_steps} SFT steps)", ev, time.perf_counter() - t))
        for name in names:
            t = time.perf_counter()
            extra = [f"grpo.objective={name}"] + EXTRA.get(name, [])
            if name == "opd":
                extra.append(f"grpo.teacher={teacher_dir}")
            rcfg = load_bdlm_config(args.preset, args.overrides + extra)
            result = train_grpo(rcfg, out / name, init_dir, resume=None, progress=False)
            ev = evaluate(rcfg, result.model_dir)
            out_row.update({f"acc_{name}": round(ev["eval/exact_match"], 4),
                            f"reward_{name}": round(ev["eval/reward_mean"], 4)})
            table.append((f"{name} ({rcfg.grpo.steps} steps)", ev, time.perf_counter() - t))
            if args.verbose:
                for m in result.metrics:
                    print(f"{name} step {m['step']:.0f} reward {m['rollout/reward/raw_mean']:.3f} "
                          f"exact {m['rollout/reward/exact_mean']:.3f} entropy {m.get('train/entropy', 0):.3f} "
                          f"t {m['perf/step_time']:.2f}s", file=sys.stderr)
    out_row["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"| {args.preset} | held-out exact match | reward | wall s |\n| --- | --- | --- | --- |", file=sys.stderr)
    for label, ev, secs in table:
        print(f"| {label} | {ev['eval/exact_match']:.3f} | {ev['eval/reward_mean']:.3f} | {secs:.0f} |",
              file=sys.stderr)
    _common.emit(out_row)


if __name__ == "__main__":
    main()
