"""The shapes benchmarks' own logic: ``bench/colour_drift.py`` (colour shares, blob rates and mean advantages by
colour, read from a run's stored rollouts, on a run folder whose pictures are drawn in code, their colours and
advantages known) and ``bench/geneval_mini.py --keep`` (where a kept run writes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusionrl.data.shapes import all_specs, draw_scene
from diffusionrl.video import png_bytes

ROOT = Path(__file__).resolve().parents[1]
BENCH = str(ROOT / "bench")


def _obj(shape, color, cx, cy):
    return {"shape": shape, "color": color, "cx": cx, "cy": cy, "r": 8}


def _write_step(folder: Path, step: int, rows: list[tuple[dict, list[dict], float]]) -> None:
    pq.write_table(pa.table({
        "step": [step] * len(rows),
        "advantage": [adv for _, _, adv in rows],
        "metadata_json": [json.dumps({"spec": json.dumps(spec)}) for spec, _, _ in rows],
        "image_png": [png_bytes(draw_scene(objects, 64)) for _, objects, _ in rows],
    }), folder / f"step-{step:06d}.parquet")


def test_colour_drift_reads_shares_blobs_and_advantages_from_the_stored_rollouts(tmp_path):
    specs = all_specs()
    colourless = next(s for s in specs if s["category"] == "single" and s["objects"][0]["shape"] == "circle")
    coloured = next(s for s in specs if s["category"] == "colors" and s["objects"][0]["color"] == "red")
    folder = tmp_path / "run" / "trajectories"
    folder.mkdir(parents=True)
    # first step: one red and one blue circle per prompt kind; the blue one favoured on the colourless prompt
    _write_step(folder, 1, [(colourless, [_obj("circle", "blue", 20, 20)], 1.0),
                            (colourless, [_obj("circle", "red", 40, 40)], -1.0),
                            (coloured, [_obj("circle", "red", 20, 20)], 0.5),
                            (coloured, [_obj("circle", "blue", 40, 40)], -0.5)])
    # last step: blue everywhere, two objects in one picture
    _write_step(folder, 2, [(colourless, [_obj("circle", "blue", 20, 20), _obj("square", "blue", 45, 45)], 0.2),
                            (coloured, [_obj("circle", "blue", 30, 30)], -0.2)])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "colour_drift.py"), str(tmp_path / "run"),
                           "--window", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    first, last = out["first"], out["last"]
    assert out["stored_steps"] == 2 and first["steps"] == [1, 1] and last["steps"] == [2, 2]
    assert first["samples"] == 4 and last["samples"] == 2
    assert first["share"] == {"blue": 0.5, "red": 0.5} and last["share"] == {"blue": 1.0}
    assert first["blobs"] == {"blue": 0.0, "red": 0.0}  # drawn shapes are crisp
    assert first["advantage"] == {"colourless": {"blue": 1.0, "red": -1.0}, "coloured": {"blue": -0.5, "red": 0.5}}
    assert last["advantage"] == {"colourless": {"blue": 0.2}, "coloured": {"blue": -0.2}}


def test_colour_drift_refuses_a_folder_without_rollouts_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "colour_drift.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"{tmp_path}/trajectories: no step-*.parquet; give a run folder " \
                                                   "that stored its rollouts"


def test_geneval_mini_keeps_each_run_in_its_own_folder_and_never_over_an_earlier_one(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import geneval_mini

    with geneval_mini.run_folder(None, "nft seed 0") as folder:  # no --keep: a temporary folder
        assert Path(folder).is_dir()
    assert not Path(folder).exists()
    with geneval_mini.run_folder(str(tmp_path), "flow_grpo seed 1") as folder:
        assert folder == str(tmp_path / "flow_grpo-seed1")
        (Path(folder) / "metrics.jsonl").write_text("{}\n")
    assert (tmp_path / "flow_grpo-seed1" / "metrics.jsonl").is_file()  # kept
    with pytest.raises(SystemExit, match="flow_grpo-seed1 is not empty; give another --keep folder"):
        geneval_mini.run_folder(str(tmp_path), "flow_grpo seed 1")
