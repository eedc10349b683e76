"""The shape-edit task judged by the strict ``shape_edit`` judge, per category: baselines, and a model's edits.

Loads ``builtin:shape-edits:N`` (``--rows`` training rows; the held-out rows in proportion to ``--test-fraction``,
as a run would), judges each baseline on the ``--split`` rows and prints one JSON line: per baseline, success
(exact), the partial-credit score, ``unchanged`` (the objects the edit leaves alone found in place), ``made``
(the edit itself made) and ``gated_score`` (the score where the edit is made and the rest unchanged, else 0:
``shape_edit_gated``) per category and overall (the mean of the categories, as GenEval's overall), and the
share of rows with a success among their samples. The baselines: the expected targets (must score 1.0
everywhere: the judge's calibration), the unedited inputs (a copy of the source image: must succeed nowhere) and
a blank picture.

``--model M`` (an editing model, e.g. ``builtin:tiny-flux-kontext-shapes``) adds its edits of the same rows,
sampled as the ``tiny-cpu-shape-edits`` preset's evaluation does (ODE, ``--steps``, ``--seeds`` seeds per
row from the evaluation seed, CFG-free; ``--guidance G``: true CFG at scale G on the empty instruction), and
``--lora DIR`` those of the model with a LoRA a run wrote (same seeds), with ``tuned_success_gain``: the gain in
overall success and its 90 % paired bootstrap interval over the samples, within each category (``gain_interval``).
``--lora`` given several times (runs of one recipe at other training seeds) judges each LoRA (``tuned_1``,
``tuned_2``, ... with ``tuned_<i>_success_gain``) and adds
``pooled_success_gain``: the LoRAs' mean gain, its interval from the same paired bootstrap on each sample's
success averaged over the LoRAs (so it speaks for these trained LoRAs on the held-out samples, not for a new
training seed), and how many LoRAs gained. ``--grid PATH`` writes a PNG of the first ``--grid-rows`` samples,
one column each, bands from top to bottom: input | expected target | model's edit | each tuned edit.

    python bench/shape_edits.py [--rows N] [--split test|train|all] [--seed S] [--test-fraction F]
        [--model M [--lora DIR ...] [--steps T] [--seeds K] [--guidance G] [--grid PATH]]
"""

from __future__ import annotations

import argparse
import json

import _common  # sets sys.path and offline env
import numpy as np
from PIL import Image

from diffusionrl.config import DataConfig, RewardConfig
from diffusionrl.data import load_prompts
from diffusionrl.data.images import row_images
from diffusionrl.data.shape_edits import CATEGORIES
from diffusionrl.data.shapes import draw_scene
from diffusionrl.report import paired_bootstrap
from diffusionrl.rewards import build_reward, prompt_validator


def baselines(rows: list[dict]) -> dict[str, np.ndarray]:
    """The pictures each baseline hands the judge, one per row."""
    targets = [json.loads(r["target"]) for r in rows]
    return {
        "target": np.stack([draw_scene(t["objects"], t["resolution"]) for t in targets]),
        "copy": np.stack(row_images(rows)),  # the rows' input images (data: URIs once loaded)
        "blank": np.full((len(rows), 64, 64, 3), 255, np.uint8),
    }


def judge(images: np.ndarray, rows: list[dict]):
    """The ``shape_edit`` judge's ``RewardResult`` of ``images``, one per row."""
    reward = build_reward("shape_edit", RewardConfig(weights={"shape_edit": 1.0}))
    return reward(images, [r["prompt"] for r in rows], [{k: v for k, v in r.items() if k != "prompt"} for r in rows])


def judged(images: np.ndarray, rows: list[dict], result=None) -> dict:
    """Success, score, ``unchanged``, ``made`` and ``gated_score`` (``shape_edit_gated``'s credit) per category
    and overall (``result``: the judge's, when already run)."""
    result = judge(images, rows) if result is None else result
    made, unchanged = result.per_sample["made"], result.per_sample["unchanged"]
    values = {"success": result.per_sample["success"], "score": result.scores, "unchanged": unchanged,
              "made": made, "gated_score": result.scores * made * unchanged}
    categories = np.array([r["category"] for r in rows])
    per = {c: {k: round(float(v[categories == c].mean()), 4) for k, v in values.items()}
           for c in CATEGORIES if np.any(categories == c)}
    overall = {k: round(float(np.mean([p[k] for p in per.values()])), 4) for k in values}
    # the rows (a row's samples share its dict) of which at least one sample succeeds
    found: dict[int, bool] = {}
    for row, ok in zip(rows, values["success"]):
        found[id(row)] = found.get(id(row), False) or bool(ok)
    return {"overall": overall, "per_category": per, "failures": result.failures,
            "rows_with_a_success": round(sum(found.values()) / len(found), 4)}


def gain_interval(base: np.ndarray, tuned: np.ndarray, rows: list[dict], resamples: int = 2000) -> dict:
    """The tuned model's success gain over the model's (overall: the mean of the categories, as ``judged``)
    and its 90 % paired bootstrap interval, resampling each category's samples (``report.category_table``'s rule)."""
    categories = np.array([r["category"] for r in rows])
    diff = {c: tuned[categories == c] - base[categories == c] for c in CATEGORIES if np.any(categories == c)}
    draws = np.mean([d.mean(axis=1) for d in paired_bootstrap(diff, resamples, 0).values()], axis=0)
    gain = float(np.mean([d.mean() for d in diff.values()]))
    return {"gain": round(gain, 4), "interval_90": [round(float(np.percentile(draws, q)), 4) for q in (5, 95)]}


def tuned_names(loras: list[str]) -> list[str]:
    """The result key of each ``--lora``: ``tuned`` for one, ``tuned_1``, ``tuned_2``, ... for several."""
    return ["tuned"] if len(loras) == 1 else [f"tuned_{i + 1}" for i in range(len(loras))]


def pooled_gain(base: np.ndarray, tuned: list[np.ndarray], rows: list[dict]) -> dict:
    """Several LoRAs' mean success gain over the model's and its 90 % interval (``gain_interval`` on each sample's
    success averaged over the LoRAs), with each LoRA's gain and how many are above 0."""
    gains = [gain_interval(base, t, rows)["gain"] for t in tuned]
    return {**gain_interval(base, np.mean(tuned, axis=0), rows), "gains": gains,
            "loras_gaining": f"{sum(g > 0 for g in gains)} of {len(gains)}"}


def model_edits(args, rows: list[dict]) -> tuple[dict[str, np.ndarray], list[dict]]:
    """The model's (and with ``--lora`` each tuned model's) edits of ``rows``, ``--seeds`` samples each,
    and the rows of the samples (row-major, as the evaluation orders them)."""
    import copy

    from diffusionrl.config import load_config
    from diffusionrl.evaluation import eval_samples, eval_spec
    from diffusionrl.models import load_adapter
    from diffusionrl.rollout.local import LocalRolloutEngine

    cfg = load_config("tiny-cpu-shape-edits", overrides=[f"model.name={args.model}", f"eval.num_steps={args.steps}",
                                                        f"eval.guidance_scale={args.guidance}"])
    prompts, groups, seeds, metadata = eval_samples(rows, args.seeds, cfg.eval.seed)
    adapter = load_adapter(cfg.model, cfg.train.mixed_precision)
    transformers = {"model": adapter.transformer}
    if args.lora:
        from peft import PeftModel

        for name, lora in zip(tuned_names(args.lora), args.lora):
            transformers[name] = PeftModel.from_pretrained(copy.deepcopy(adapter.transformer), lora).eval()
    spec = eval_spec(cfg)
    images = {name: LocalRolloutEngine(adapter, t, 16).generate(prompts, groups, seeds, spec, None, metadata).images
              for name, t in transformers.items()}
    return images, [rows[g] for g in groups]


def write_grid(path: str, bands: list[np.ndarray], n: int) -> None:
    from diffusionrl.video import side_by_side, stacked

    Image.fromarray(stacked([side_by_side(b[:n]) for b in bands])).save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="training rows (builtin:shape-edits:N)")
    parser.add_argument("--split", choices=("test", "train", "all"), default="test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--model", default=None, help="an image-editing model to judge too")
    parser.add_argument("--lora", action="append", default=[],
                        help="a LoRA folder a run wrote for --model: its edits too (repeat for several runs)")
    parser.add_argument("--steps", type=int, default=20, help="ODE steps of the model's edits")
    parser.add_argument("--seeds", type=int, default=1, help="samples per row")
    parser.add_argument("--guidance", type=float, default=1.0,
                        help="CFG scale of every model's edits (1: CFG-free; > 1 needs a model trained with "
                             "instruction dropout, pretrain_edit --cfg-dropout)")
    parser.add_argument("--grid", default=None, help="PNG: input | target | model | tuned, one column per sample")
    parser.add_argument("--grid-rows", type=int, default=15, help="samples in the grid")
    args = parser.parse_args()
    if args.lora and not args.model:
        raise SystemExit("--lora needs --model (the model the LoRA was trained on)")
    cfg = DataConfig(source=f"builtin:shape-edits:{args.rows}", test_fraction=args.test_fraction, seed=args.seed)
    prompts = load_prompts(cfg, validate=prompt_validator(RewardConfig(weights={"shape_edit": 1.0})))
    rows = {"test": prompts.test, "train": prompts.train, "all": prompts.train + prompts.test}[args.split]
    results = {name: judged(images, rows) for name, images in baselines(rows).items()}
    if args.model:
        edits, sample_rows = model_edits(args, rows)
        verdicts = {name: judge(images, sample_rows) for name, images in edits.items()}
        results.update({name: judged(edits[name], sample_rows, v) for name, v in verdicts.items()})
        base = verdicts["model"].per_sample["success"]
        names = tuned_names(args.lora) if args.lora else []
        for name in names:
            results[f"{name}_success_gain"] = gain_interval(base, verdicts[name].per_sample["success"], sample_rows)
        if len(names) > 1:
            results["pooled_success_gain"] = pooled_gain(base, [verdicts[n].per_sample["success"] for n in names],
                                                         sample_rows)
        if args.grid:
            expected = baselines(sample_rows)
            write_grid(args.grid, [expected["copy"], expected["target"], *edits.values()], args.grid_rows)
    lora = args.lora[0] if len(args.lora) == 1 else args.lora or None
    _common.emit({"source": cfg.source, "split": args.split, "rows": len(rows), "model": args.model,
                  "lora": lora, "steps": args.steps if args.model else None, "seeds": args.seeds,
                  "guidance": args.guidance if args.model else None,
                  "rows_per_category": {c: sum(r["category"] == c for r in rows) for c in CATEGORIES}, **results})


if __name__ == "__main__":
    main()
