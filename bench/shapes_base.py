"""The base model of GenEval in miniature, judged strictly: ``builtin:tiny-sd3-shapes`` on its world.

Samples every held-out prompt of the ``tiny-cpu-shapes`` split (or ``--split train``) ``--seeds``
times with the evaluation's ODE sampling (``eval.num_steps``, ``eval.guidance_scale``; ``--set`` to
change them), judges each image with ``geneval_mini`` (``--judge geneval_mini_rules``: GenEval's own rules on
the same detector) and prints one JSON line: strict success per
category and overall (over samples, and GenEval's mean over categories), the share of prompts with at
least one success among their seeds (what sharpening each prompt onto its best seed could reach),
objects and shapeless blobs per image, the diversity (``heldout.diversity``), and the seconds it took;
``--per-prompt`` adds each prompt's number of successes among its seeds.
``--grid PATH`` writes a PNG: five prompts a row, each prompt's samples side by side under its text.
``--lora DIR`` judges the base with a LoRA a run wrote instead (``runs/x/lora``, or one of its
checkpoints: ``runs/x/checkpoints/step-000100``): on ``--split train``, how well a run learned the
prompts it trained on, next to the held-out split's figure.

The samples are the evaluation's (seeds from ``eval.seed``); ``--seed S`` draws others. Many seeds of
the training prompts (``--split train --seeds 32 --seed 100000``) give each category's success of one
sample against its share of prompts with a success among all of them: how far sharpening could go.
``--parquet PATH`` writes up to ``--cap`` successful samples of each prompt as ``prompt`` and ``image``
(PNG bytes) columns, the input of ``algorithm.name=sft`` (``algorithm.sft_source=PATH``): rejection-
sampling fine-tuning on the model's own strict successes (draw them with a ``--seed`` away from
``eval.seed``'s, so no evaluated sample is trained on).

    python bench/shapes_base.py [--seeds 4] [--split test] [--grid docs/images/shapes-base.png]
                                [--set eval.guidance_scale=3] [--lora runs/x/lora] [--judge geneval_mini_rules]
                                [--seed 100000 --parquet runs/successes.parquet --cap 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _common  # sets sys.path and offline env
import numpy as np

from diffusionrl.config import load_config
from diffusionrl.data import load_prompts
from diffusionrl.data.shapes import CATEGORIES
from diffusionrl.evaluation import eval_samples, eval_spec, prompts_with_a_success
from diffusionrl.heldout import diversity
from diffusionrl.models import load_adapter
from diffusionrl.rewards import build_reward
from diffusionrl.rollout.local import LocalRolloutEngine


def labelled_grid(images: np.ndarray, prompts: list[str], per_prompt: int, cols: int = 5, scale: int = 2) -> np.ndarray:
    """``cols`` prompts a row, each its ``per_prompt`` images side by side with its text above."""
    from PIL import Image, ImageDraw

    n, h, w, _ = images.shape
    cells = n // per_prompt
    band, gap = 14, 10
    cell_w = per_prompt * (w * scale + 2) + gap
    cell_h = h * scale + band + gap
    canvas = Image.new("RGB", (min(cols, cells) * cell_w, -(-cells // cols) * cell_h), "white")
    draw = ImageDraw.Draw(canvas)
    for c in range(cells):
        x, y = (c % cols) * cell_w, (c // cols) * cell_h
        draw.text((x + 1, y + 1), prompts[c * per_prompt], fill=(0, 0, 0))
        for j in range(per_prompt):
            tile = Image.fromarray(images[c * per_prompt + j]).resize((w * scale, h * scale), Image.NEAREST)
            canvas.paste(tile, (x + j * (w * scale + 2), y + band))
            draw.rectangle([x + j * (w * scale + 2) - 1, y + band - 1, x + j * (w * scale + 2) + w * scale,
                            y + band + h * scale], outline=(200, 200, 200))
    return np.asarray(canvas)


def with_lora(adapter, lora: str | None):
    """The adapter's transformer, with ``lora`` (a run's ``lora/`` folder or one of its checkpoints,
    ``checkpoints/step-NNNNNN``) applied when given."""
    if lora and (Path(lora) / "lora.safetensors").is_file():  # a run's checkpoint (step-NNNNNN/)
        from safetensors.torch import load_file

        from diffusionrl.training.policy import LoraPolicy

        run_cfg = load_config(file=Path(lora).parent.parent / "config.json")
        policy = LoraPolicy(adapter, run_cfg.model, seed=run_cfg.train.seed)
        policy.load_lora_state(load_file(str(Path(lora) / "lora.safetensors")))
        return policy.model
    if lora:
        from peft import PeftModel

        return PeftModel.from_pretrained(adapter.transformer, lora).eval()
    return adapter.transformer


def write_successes(path: str, prompts: list[str], groups: list[int], images: np.ndarray, success: np.ndarray,
                    cap: int) -> dict:
    """Up to ``cap`` successful samples of each prompt as a ``prompt``, ``image`` (PNG bytes) parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from diffusionrl.data.shape_edits import png_bytes

    kept: dict[int, int] = {}
    texts, pngs = [], []
    for prompt, group, image, ok in zip(prompts, groups, images, success):
        if ok and kept.get(group, 0) < cap:
            kept[group] = kept.get(group, 0) + 1
            texts.append(prompt)
            pngs.append(png_bytes(image))
    pq.write_table(pa.table({"prompt": texts, "image": pngs}), path)
    return {"parquet": path, "kept": len(texts), "prompts_kept": len(kept)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=4, help="samples per prompt")
    ap.add_argument("--split", choices=("test", "train"), default="test")
    ap.add_argument("--grid", default=None, help="write a PNG grid of the samples here")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--lora", default=None, help="a LoRA folder a run on builtin:tiny-sd3-shapes wrote, or one of "
                    "its checkpoints (runs/x/checkpoints/step-NNNNNN)")
    ap.add_argument("--seed", type=int, default=None, help="the first sample's seed (default: eval.seed's samples)")
    ap.add_argument("--parquet", default=None, help="write the successes here (prompt, PNG image bytes)")
    ap.add_argument("--cap", type=int, default=8, help="at most this many successes of a prompt in --parquet")
    ap.add_argument("--per-prompt", action="store_true", help="also print each prompt's successes among its seeds")
    ap.add_argument("--judge", choices=("geneval_mini", "geneval_mini_rules"), default="geneval_mini",
                    help="the exact-scene judge, or GenEval's own rules on the same detector")
    args = ap.parse_args()
    cfg = load_config("tiny-cpu-shapes", overrides=args.overrides)
    rows = getattr(load_prompts(cfg.data), args.split)
    adapter = load_adapter(cfg.model, cfg.train.mixed_precision)
    transformer = with_lora(adapter, args.lora)
    k = args.seeds
    seed = cfg.eval.seed if args.seed is None else args.seed  # by default the evaluation's samples
    prompts, groups, seeds, metadata = eval_samples(rows, k, seed)
    t0 = time.perf_counter()
    traj = LocalRolloutEngine(adapter, transformer, 32).generate(
        prompts, groups, seeds, eval_spec(cfg), None, metadata)
    result = build_reward(args.judge, cfg.reward)(traj.images, prompts, metadata)
    success = result.per_sample["success"]
    cats = np.array([m["category"] for m in metadata])
    present = [c for c in CATEGORIES if (cats == c).any()]
    per = {c: round(float(success[cats == c].mean()), 4) for c in present}
    groups_a = np.asarray(groups)
    out = {"judge": args.judge, "split": args.split, "lora": args.lora, "prompts": len(rows),
           "samples_per_prompt": k, "seed": seed,
           "success": per, "overall": round(float(success.mean()), 4),
           "categories_mean": round(float(np.mean(list(per.values()))), 4),
           "prompts_with_a_success": round(prompts_with_a_success(success, groups), 4),
           "prompts_with_a_success_by_category": {
               c: round(prompts_with_a_success(success[cats == c], groups_a[cats == c]), 4) for c in present},
           "objects_per_image": round(result.info["objects_per_image"], 3),
           "blobs_per_image": round(result.info["blobs_per_image"], 3),
           "diversity": round(diversity(traj.images, prompts), 4),
           "eval_num_steps": cfg.eval.num_steps, "eval_guidance_scale": cfg.eval.guidance_scale,
           "scheduler_shift": float(adapter.pipe.scheduler.config.shift),
           "wall_s": round(time.perf_counter() - t0, 1)}
    if args.per_prompt:
        out["per_prompt"] = {prompts[g * k]: int(success[g * k: (g + 1) * k].sum()) for g in range(len(rows))}
    if args.grid:
        from PIL import Image

        Image.fromarray(labelled_grid(traj.images, prompts, k)).save(args.grid, optimize=True)
        out["grid"] = args.grid
    if args.parquet:
        out.update(write_successes(args.parquet, prompts, groups, traj.images, success, args.cap))
    _common.emit(out)


if __name__ == "__main__":
    main()
