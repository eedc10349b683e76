"""What the orchestration costs: the same config through the Flyte workflow and through the bare
library (training loop + evaluation, the same computational work).

Each side runs in a fresh Python process of its own, so neither inherits the other's imports,
caches or warmed-up kernels; a side's clock starts after its top-level imports (the library side:
``diffusionrl``; the workflow side: ``workflows.grpo``, i.e. flytekit too; what either imports
lazily while running is counted) and stops when its last result is in. With ``--repeats N`` the
sides alternate (library, workflow, library, ...) and each side's fastest run counts, so that load
from other processes on a shared machine hits both alike.

What the workflow does on top of the library's work, all counted in ``workflow_s``: Flyte local
execution (type transforms, task-by-task I/O), the MLflow run tree in a SQLite store (preflight,
params, prompt datasets, per-step metrics and sample images, eval
table and grid, the ``mlflow.diffusers`` model with its validated input example, the registry
decision), the prompt fingerprint and digests, the model folder and its digest, Parquet
trajectories of every step (written off the training thread, verified at checkpoints) and the
HTML report. The store's schema is created before the clock starts, as every run but a store's
first finds it (``--fresh-store`` counts it: ~3 s of alembic migrations on this machine).

Prints {"workflow_s", "library_s", "overhead_ratio" (workflow_s / library_s - 1; of the medians:
"overhead_ratio_median"), the same for
CPU seconds (the process and its waited-for children: less sensitive to other load than wall
time), "tasks_s" (the workflow's per-task wall seconds of its fastest run), "steps", "runs"}.

    python bench/pipeline_overhead.py [--preset NAME] [--steps N] [--repeats N] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # sets sys.path and offline env

HERE = Path(__file__).resolve()


def cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_library(preset: str, overrides: list[str], tmp: str) -> dict:
    from diffusionrl.config import load_config
    from diffusionrl.data import load_prompts
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.train import train

    cfg = load_config(preset, overrides=overrides)
    t0, c0 = time.perf_counter(), cpu_s()
    prompts = load_prompts(cfg.data)
    result = train(cfg, f"{tmp}/lib", resume=None, progress=False, prompts=prompts)
    evaluate_lora(cfg, prompts.test, result.model_dir)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "steps": cfg.train.steps}


def run_workflow(preset: str, overrides: list[str], tmp: str, fresh_store: bool = False) -> dict:
    os.environ.setdefault("FLYTE_LOCAL_CACHE_ENABLED", "false")
    os.environ["MLFLOW_TRACKING_URI"] = uri = f"sqlite:///{tmp}/mlflow.db"
    os.environ["DIFFUSIONRL_CACHE"] = f"{tmp}/cache"
    from diffusionrl.config import get_preset
    from workflows.grpo import grpo  # imports flytekit

    if not fresh_store:  # the store as every run but a store's first finds it: its schema exists
        subprocess.run([sys.executable, "-c", f"from diffusionrl.tracking.store import preflight; preflight({uri!r})"],
                       check=True, env={**os.environ, "PYTHONPATH": str(_common.ROOT)})

    tasks: dict[str, float] = {}
    _time_tasks(tasks)
    t0, c0 = time.perf_counter(), cpu_s()
    grpo(config=get_preset(preset), overrides=overrides, checkpoint_dir=f"{tmp}/wf")
    return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "tasks_s": tasks}


def _time_tasks(out: dict[str, float]) -> None:
    """Record each task's wall time (its ``dispatch_execute``: inputs in, body, outputs out)."""
    from flytekit.core.base_task import PythonTask

    original = PythonTask.dispatch_execute

    def timed(self, ctx, input_literal_map):
        t = time.perf_counter()
        try:
            return original(self, ctx, input_literal_map)
        finally:
            name = self.name.rsplit(".", 1)[-1]
            out[name] = round(out.get(name, 0.0) + time.perf_counter() - t, 2)

    PythonTask.dispatch_execute = timed


def child(side: str, preset: str, overrides: list[str], fresh_store: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = (run_library(preset, overrides, tmp) if side == "library"
                  else run_workflow(preset, overrides, tmp, fresh_store))
    print("RESULT " + json.dumps(result), flush=True)


def spawn(side: str, preset: str, overrides: list[str], fresh_store: bool) -> dict:
    cmd = [sys.executable, str(HERE), "--child", side, "--preset", preset]
    cmd += [a for o in overrides for a in ("--set", o)]
    cmd += ["--fresh-store"] if fresh_store else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the {side} side failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-cpu-shapes", help="both sides' config (default: the demo's)")
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's train.steps")
    ap.add_argument("--repeats", type=int, default=1, help="runs per side, alternating; the fastest counts")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--fresh-store", action="store_true",
                    help="count creating the MLflow store's schema (a store's first run only; ~3 s of alembic)")
    ap.add_argument("--child", choices=("library", "workflow"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
    if args.child:
        return child(args.child, args.preset, overrides, args.fresh_store)

    runs = {"library": [], "workflow": []}
    for _ in range(args.repeats):
        for side in ("library", "workflow"):
            runs[side].append(spawn(side, args.preset, overrides, args.fresh_store))
    lib = min(runs["library"], key=lambda r: r["wall_s"])
    wf = min(runs["workflow"], key=lambda r: r["wall_s"])
    lib_cpu = min(r["cpu_s"] for r in runs["library"])
    wf_cpu = min(r["cpu_s"] for r in runs["workflow"])
    _common.emit({
        "workflow_s": round(wf["wall_s"], 2),
        "library_s": round(lib["wall_s"], 2),
        "overhead_ratio": round(wf["wall_s"] / lib["wall_s"] - 1.0, 4),
        # the medians too: the fastest run is the figure, the median says how typical it is
        "overhead_ratio_median": round(statistics.median(r["wall_s"] for r in runs["workflow"])
                                       / statistics.median(r["wall_s"] for r in runs["library"]) - 1.0, 4),
        "workflow_cpu_s": round(wf_cpu, 2),
        "library_cpu_s": round(lib_cpu, 2),
        "cpu_overhead_ratio": round(wf_cpu / lib_cpu - 1.0, 4),
        "tasks_s": wf["tasks_s"],
        "preset": args.preset,
        "steps": lib["steps"],
        "mlflow_store": "fresh (schema created on the clock)" if args.fresh_store else "existing (schema made before)",
        "runs": {side: [round(r["wall_s"], 2) for r in rs] for side, rs in runs.items()},
    })


if __name__ == "__main__":
    main()
