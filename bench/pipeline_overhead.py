"""What the orchestration costs: the same config through the Flyte workflow and through the bare
library (training loop + evaluation, the same computational work), in one process.

Prints {"workflow_s": ..., "library_s": ..., "overhead_ratio": ...} where overhead_ratio =
workflow_s / library_s - 1 (Flyte local execution, local Ray start, Parquet trajectories, the
checkpoint fetch/serialisation, MLflow tracking + registration into a temporary SQLite store, and
the HTML report).

    python bench/pipeline_overhead.py [--steps N] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import _common  # sets sys.path and offline env

os.environ.setdefault("FLYTE_LOCAL_CACHE_ENABLED", "false")

from diffusionrl.config import load_config
from diffusionrl.data import load_prompts
from diffusionrl.evaluation import evaluate_lora
from diffusionrl.train import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="default: the demo's (tiny-cpu) train.steps")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
    cfg = load_config("tiny-cpu", overrides=overrides)

    from workflows.grpo import grpo  # imported here: it pulls in flytekit

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        prompts = load_prompts(cfg.data)
        result = train(cfg, f"{tmp}/lib", resume=None, progress=False, prompts=prompts)
        evaluate_lora(cfg, prompts.test, result.model_dir)
        library_s = time.perf_counter() - t0

        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        os.environ["DIFFUSIONRL_CACHE"] = f"{tmp}/cache"
        t0 = time.perf_counter()
        grpo(overrides=overrides, checkpoint_dir=f"{tmp}/wf")
        workflow_s = time.perf_counter() - t0
    _common.emit({
        "workflow_s": round(workflow_s, 2),
        "library_s": round(library_s, 2),
        "overhead_ratio": round(workflow_s / library_s - 1.0, 4),
        "steps": cfg.train.steps,
    })


if __name__ == "__main__":
    main()
