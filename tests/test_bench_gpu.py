"""``bench/gpu_scaleout.py --dry-run``: every branch of the GPU benchmark that runs without a GPU
(model build, LoRA wrap, rollout loop, train step, LoRA merge, buckets, push to a consumer process
both ways) runs on the CPU at a toy size, so the one GPU run does not fail on a typo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_scaleout_dry_run_exercises_every_cpu_branch():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_scaleout.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"].startswith("cpu (dry run")
    for key in ("rollout_images_per_s_local", "train_step_s", "ipc_push_s", "by_value_push_s"):
        assert out[key] > 0, key
    assert out["lora_params_m"] > 0 and out["pushed_mib"] > 0
    assert "rollout_images_per_s_sglang" in out and out["sglang_note"]
    # the planner's prediction for the GPU run's shape is recorded beside what a GPU would measure
    assert out["plan_train_alloc_gib"] > 0 and out["plan_train_unit_s"] > 0 and "train_peak_ratio" not in out
