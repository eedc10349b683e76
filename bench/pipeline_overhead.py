"""What the orchestration costs: the same config through the Flyte workflow and through the bare
library (training loop + evaluation, the same computational work).

Each side runs in a fresh Python process of its own, so neither inherits the other's imports,
caches or warmed-up kernels; a side's clock starts after its top-level imports (both sides: the
library modules the library side calls, ``diffusionrl.train``, ``.evaluation``, ``.data``,
``.config``, and so torch; the workflow side also ``workflows.grpo``, i.e. flytekit; what either
imports lazily while running, diffusers and MLflow among it, is counted) and stops when its last
result is in.

With ``--repeats N`` the sides alternate, library first and last (library, workflow, library, ...,
workflow, library: N workflow runs, N + 1 library runs). This machine's speed drifts by up to 25 %
over minutes (other tenants of the host; the same library run took 124 s and 151 s within half an
hour), so a fastest-of-N figure says more about which side met a fast minute than about the
orchestration: each workflow run is compared with the mean of the two library runs around it (a
linear drift cancels), and the median of those ratios is the figure.

What the workflow does on top of the library's work, all counted in ``workflow_s``: Flyte local
execution (type transforms, task-by-task I/O), the MLflow run tree in a SQLite store (preflight,
params, prompt datasets, per-step metrics and sample images, eval table and grid, the
``mlflow.diffusers`` model with its validated input example, the registry decision), the prompt
fingerprint and digests, the model folder and its digest, Parquet trajectories of every step
(written off the training thread, verified at checkpoints) and the HTML report. The store's schema
is created before the clock starts, as every run but a store's first finds it (``--fresh-store``
counts it: ~3 s of alembic migrations on this machine).

Prints {"overhead_ratio" (the median of "bracketed_overhead_ratios": each workflow run's wall time
over the mean of its two neighbouring library runs, minus 1), "cpu_overhead_ratio" (the same for CPU
seconds: the process and its waited-for children), "overhead_ratio_fastest" (fastest workflow run
over fastest library run) and "overhead_ratio_of_medians", "workflow_s" / "library_s" (median wall
seconds), "step_s" / "outside_steps_s" (medians of the wall seconds inside the training steps,
``perf/step_time`` summed, and around them), "tasks_s" (the fastest workflow run's per-task wall
seconds), "steps", "runs"}.

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
    return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "steps": cfg.train.steps,
            "step_s": sum(m["perf/step_time"] for m in result.metrics)}


def run_workflow(preset: str, overrides: list[str], tmp: str, fresh_store: bool = False) -> dict:
    os.environ.setdefault("FLYTE_LOCAL_CACHE_ENABLED", "false")
    os.environ["MLFLOW_TRACKING_URI"] = uri = f"sqlite:///{tmp}/mlflow.db"
    os.environ["DIFFUSIONRL_CACHE"] = f"{tmp}/cache"
    # the library modules the library side imports before its clock (and so torch), then flytekit's side
    import diffusionrl.evaluation  # noqa: F401
    import diffusionrl.train  # noqa: F401
    from diffusionrl.config import get_preset
    from workflows.grpo import grpo  # imports flytekit

    if not fresh_store:  # the store as every run but a store's first finds it: its schema exists
        subprocess.run([sys.executable, "-c", f"from diffusionrl.tracking.store import preflight; preflight({uri!r})"],
                       check=True, env={**os.environ, "PYTHONPATH": str(_common.ROOT)})

    tasks: dict[str, float] = {}
    _time_tasks(tasks)
    t0, c0 = time.perf_counter(), cpu_s()
    out = grpo(config=get_preset(preset), overrides=overrides, checkpoint_dir=f"{tmp}/wf")
    return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "tasks_s": tasks,
            "step_s": float(out.metrics["perf/step_time"].sum())}


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
    ap.add_argument("--repeats", type=int, default=1, help="workflow runs, each between two library runs")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--fresh-store", action="store_true",
                    help="count creating the MLflow store's schema (a store's first run only; ~3 s of alembic)")
    ap.add_argument("--child", choices=("library", "workflow"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
    if args.child:
        return child(args.child, args.preset, overrides, args.fresh_store)

    runs = {"library": [], "workflow": []}
    for _ in range(args.repeats):  # library, workflow, library, ..., workflow, library
        for side in ("library", "workflow"):
            runs[side].append(spawn(side, args.preset, overrides, args.fresh_store))
    runs["library"].append(spawn("library", args.preset, overrides, args.fresh_store))
    lib, wf = runs["library"], runs["workflow"]

    def bracketed(key: str) -> list[float]:
        """Each workflow run over the mean of the library runs just before and just after it."""
        return [w[key] / ((lib[i][key] + lib[i + 1][key]) / 2) - 1.0 for i, w in enumerate(wf)]

    def median(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    fast_lib, fast_wf = (min(rs, key=lambda r: r["wall_s"]) for rs in (lib, wf))
    wall_ratios = bracketed("wall_s")
    _common.emit({
        "overhead_ratio": round(statistics.median(wall_ratios), 4),
        "bracketed_overhead_ratios": [round(r, 4) for r in wall_ratios],
        "cpu_overhead_ratio": round(statistics.median(bracketed("cpu_s")), 4),
        "overhead_ratio_fastest": round(fast_wf["wall_s"] / fast_lib["wall_s"] - 1.0, 4),
        "overhead_ratio_of_medians": round(median(wf, "wall_s") / median(lib, "wall_s") - 1.0, 4),
        "workflow_s": round(median(wf, "wall_s"), 2),
        "library_s": round(median(lib, "wall_s"), 2),
        # where the time goes (medians): the training steps themselves, and everything around them
        "step_s": {"library": round(median(lib, "step_s"), 2), "workflow": round(median(wf, "step_s"), 2)},
        "outside_steps_s": {"library": round(statistics.median(r["wall_s"] - r["step_s"] for r in lib), 2),
                            "workflow": round(statistics.median(r["wall_s"] - r["step_s"] for r in wf), 2)},
        "tasks_s": fast_wf["tasks_s"],
        "preset": args.preset,
        "steps": lib[0]["steps"],
        "mlflow_store": "fresh (schema created on the clock)" if args.fresh_store else "existing (schema made before)",
        "runs": {side: [round(r["wall_s"], 2) for r in rs] for side, rs in runs.items()},
    })


if __name__ == "__main__":
    main()
