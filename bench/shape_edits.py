"""The shape-edit task's baselines: what the strict ``shape_edit`` judge gives the expected targets,
the unedited inputs (a copy of the source image), and a blank picture, per category.

Loads ``builtin:shape-edits:N`` (``--rows`` training rows; the held-out rows in proportion to
``--test-fraction``, as a run would), judges each baseline on the ``--split`` rows and prints one
JSON line: per baseline, success (exact), the partial-credit score and ``unchanged`` (the objects
the edit leaves alone found in place) per category and overall (the mean of the categories, as
GenEval's overall). The target must score 1.0 everywhere and the copy must succeed nowhere: this
bench is the judge's calibration. ``--model`` would add a model's edits of the same rows; no
image-editing model family exists on this branch yet (the rows' input image reaches no adapter), so
it stops saying so.

    python bench/shape_edits.py [--rows N] [--split test|train|all] [--seed S] [--test-fraction F] [--model M]
"""

from __future__ import annotations

import argparse
import io
import json

import _common  # sets sys.path and offline env
import numpy as np
from PIL import Image

from diffusionrl.config import DataConfig, RewardConfig
from diffusionrl.data import load_prompts
from diffusionrl.data.shape_edits import CATEGORIES
from diffusionrl.data.shapes import draw_scene
from diffusionrl.rewards import build_reward, prompt_validator


def baselines(rows: list[dict]) -> dict[str, np.ndarray]:
    """The pictures each baseline hands the judge, one per row."""
    targets = [json.loads(r["target"]) for r in rows]
    return {
        "target": np.stack([draw_scene(t["objects"], t["resolution"]) for t in targets]),
        "copy": np.stack([np.asarray(Image.open(io.BytesIO(r["image"])).convert("RGB")) for r in rows]),
        "blank": np.full((len(rows), 64, 64, 3), 255, np.uint8),
    }


def judged(images: np.ndarray, rows: list[dict]) -> dict:
    reward = build_reward("shape_edit", RewardConfig(weights={"shape_edit": 1.0}))
    result = reward(images, [r["prompt"] for r in rows], [{k: v for k, v in r.items() if k != "prompt"} for r in rows])
    values = {"success": result.per_sample["success"], "score": result.scores,
              "unchanged": result.per_sample["unchanged"]}
    categories = np.array([r["category"] for r in rows])
    per = {c: {k: round(float(v[categories == c].mean()), 4) for k, v in values.items()}
           for c in CATEGORIES if np.any(categories == c)}
    overall = {k: round(float(np.mean([p[k] for p in per.values()])), 4) for k in values}
    return {"overall": overall, "per_category": per, "failures": result.failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="training rows (builtin:shape-edits:N)")
    parser.add_argument("--split", choices=("test", "train", "all"), default="test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--model", default=None, help="an image-editing model to judge too (not available yet)")
    args = parser.parse_args()
    if args.model:
        raise SystemExit(f"--model {args.model}: no image-editing model family is on this branch yet (the rows' "
                         "source image reaches no adapter); the baselines run without --model")
    cfg = DataConfig(source=f"builtin:shape-edits:{args.rows}", test_fraction=args.test_fraction, seed=args.seed)
    prompts = load_prompts(cfg, validate=prompt_validator(RewardConfig(weights={"shape_edit": 1.0})))
    rows = {"test": prompts.test, "train": prompts.train, "all": prompts.train + prompts.test}[args.split]
    _common.emit({"source": cfg.source, "split": args.split, "rows": len(rows),
                  "rows_per_category": {c: sum(r["category"] == c for r in rows) for c in CATEGORIES},
                  **{name: judged(images, rows) for name, images in baselines(rows).items()}})


if __name__ == "__main__":
    main()
