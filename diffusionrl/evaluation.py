"""Evaluation: deterministic (ODE) sampling on held-out prompts, base model vs LoRA, same seeds
(``eval.seeds_per_prompt`` of them per prompt: seed + i k + j for sample j of prompt i); the
diversity of each side (``heldout.diversity``). With ``eval.base_guidance_scale`` the base is also sampled
at that CFG scale on the same seeds (``eval/base_cfg_*``): what a CFG-free tuned model should reach.

Prompt rows with a ``category`` (the shapes world's) give the table a category column, and a reward's
per-sample values (``RewardResult.per_sample``, e.g. geneval_mini's success) are averaged per category.
Rows that carry an input image (an editing dataset, ``data/images.py``) give the table the image's digest and
the grid a third band above the other two: input | base edit | tuned edit (``report._side_by_side`` reads it).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from diffusionrl.config import Config
from diffusionrl.data.images import row_images
from diffusionrl.heldout import diversity
from diffusionrl.models import load_adapter
from diffusionrl.rewards import MixtureReward
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.video import side_by_side, stacked


@dataclass
class EvalResult:
    table: pd.DataFrame  # one row per sample (prompt, seed): base_* and tuned_* rewards (and per-sample values), win
    # eval/<reward>_mean (tuned), eval/base_<reward>_mean, eval/win_rate, ...; a reward's per-sample
    # values (geneval_mini's success) as eval/[base_]<reward>_<key> over samples, .../<category> per category
    # and .../category_mean (GenEval's overall: each category counts once)
    summary: dict[str, float]
    grid: np.ndarray  # uint8 grid [H, W, 3] (video: [F, H, W, 3]): base row above tuned row, one column per
    # sample (prompt-major: a prompt's eval.seeds_per_prompt samples side by side); rows with input images:
    # the input images' row (each at the sample's size) above both
    base_images: np.ndarray
    tuned_images: np.ndarray
    input_images: np.ndarray | None = None  # [N, H, W, 3] uint8 at the samples' size: the edited inputs, if any


def fit(images: list[np.ndarray], height: int, width: int) -> np.ndarray:
    """RGB uint8 images resized to ``height x width`` (the grid's cells), ``[N, H, W, 3]``."""
    from PIL import Image

    return np.stack([im if im.shape[:2] == (height, width) else
                     np.asarray(Image.fromarray(im).resize((width, height), Image.Resampling.LANCZOS))
                     for im in images])


def eval_resolution(cfg: Config) -> int:
    """The evaluation image size: ``sampling.eval_resolution``, else the training ``sampling.resolution``."""
    return cfg.sampling.eval_resolution or cfg.sampling.resolution


def eval_spec(cfg: Config) -> SamplingSpec:
    return SamplingSpec.from_config(
        cfg, sde_type="ode", num_steps=cfg.eval.num_steps, guidance_scale=cfg.eval.guidance_scale,
        guidance_scale_2=cfg.eval.guidance_scale_2 or None, resolution=eval_resolution(cfg),
    )


def eval_samples(rows: list[dict], k: int, seed: int) -> tuple[list[str], list[int], list[int], list[dict]]:
    """The evaluation's samples of prompt rows, ``k`` per prompt, prompt-major (a prompt's samples side
    by side): prompts, group ids, seeds (``seed + i k + j`` for sample j of prompt i; k = 1: seed + i)
    and metadata (each row without its prompt)."""
    prompts = [r["prompt"] for r in rows for _ in range(k)]
    groups = [i for i in range(len(rows)) for _ in range(k)]
    seeds = [seed + i * k + j for i in range(len(rows)) for j in range(k)]
    metadata = [{key: v for key, v in r.items() if key != "prompt"} for r in rows for _ in range(k)]
    return prompts, groups, seeds, metadata


def prompts_with_a_success(success, groups) -> float:
    """The share of rows (``groups``: each sample's row, as ``eval_samples`` gives them) any of whose samples
    succeeds: pass@k over a row's k seeds."""
    return float(pd.Series(np.asarray(success, dtype=float)).groupby(np.asarray(groups)).max().gt(0).mean())


def evaluate_lora(
    cfg: Config, test_rows: list[dict], lora_dir: str | Path, model_path: str | None = None
) -> EvalResult:
    """Score the base model and the LoRA (or a full fine-tune's model folder) on the same prompts and seeds.

    ``model_path`` overrides where the base weights are loaded from (a fetched checkpoint
    folder); the identity stays ``cfg.model.name``.
    """
    from peft import PeftModel

    rows = test_rows if cfg.eval.num_prompts == 0 else test_rows[: cfg.eval.num_prompts]
    if not rows:
        raise ValueError("evaluation needs at least one held-out prompt")
    model_cfg = dataclasses.replace(cfg.model, name=model_path or cfg.model.name)
    adapter = load_adapter(model_cfg, cfg.train.mixed_precision)
    from diffusionrl.training.full import is_full_model, load_transformers

    if is_full_model(lora_dir):  # a full fine-tune's model folder (training.full.write_full_model)
        tuned_transformer = load_transformers(adapter.transformer, lora_dir)
    else:
        tuned_transformer = PeftModel.from_pretrained(copy.deepcopy(adapter.transformer), str(lora_dir)).eval()
    prompts, groups, seeds, metadata = eval_samples(rows, cfg.eval.seeds_per_prompt, cfg.eval.seed)
    micro = max(1, min(cfg.train.micro_batch_size, len(prompts)))
    while len(prompts) % micro:
        micro -= 1
    spec = eval_spec(cfg)
    base_engine = LocalRolloutEngine(adapter, adapter.transformer, micro)
    base = base_engine.generate(prompts, groups, seeds, spec, None, metadata)
    tuned = LocalRolloutEngine(adapter, tuned_transformer, micro).generate(
        prompts, groups, seeds, spec, None, metadata
    )
    guided = None
    if cfg.eval.base_guidance_scale and cfg.eval.base_guidance_scale != cfg.eval.guidance_scale:
        guided = base_engine.generate(prompts, groups, seeds,
                                      dataclasses.replace(spec, guidance_scale=cfg.eval.base_guidance_scale), None,
                                      metadata)
    scorer = MixtureReward(cfg.reward.weights, cfg.reward)
    try:
        base_total, base_parts = scorer(base.images, prompts, metadata)
        tuned_total, tuned_parts = scorer(tuned.images, prompts, metadata)
        guided_parts = scorer(guided.images, prompts, metadata)[1] if guided is not None else None
    finally:
        scorer.close()
    table = pd.DataFrame({"prompt": prompts, "seed": seeds, "base_reward": base_total, "tuned_reward": tuned_total})
    summary: dict[str, float] = {}
    if all("category" in m for m in metadata):
        table.insert(1, "category", [m["category"] for m in metadata])
    inputs = row_images(metadata)
    if inputs is not None:  # an editing dataset: which input each sample edited
        table.insert(1, "input_image_sha256", [m.get("image_sha256", "") for m in metadata])
        inputs = fit(inputs, *base.images.shape[1:3])
    for name in cfg.reward.weights:
        table[f"base_{name}"] = base_parts[name].scores
        table[f"tuned_{name}"] = tuned_parts[name].scores
        summary[f"eval/{name}_mean"] = float(np.mean(tuned_parts[name].scores))
        summary[f"eval/base_{name}_mean"] = float(np.mean(base_parts[name].scores))
        sides = [("base", base_parts), ("tuned", tuned_parts)]
        if guided_parts is not None:  # the base with CFG: the bar of a CFG-free tuned model
            sides.append(("base_cfg", guided_parts))
            table[f"base_cfg_{name}"] = guided_parts[name].scores
            summary[f"eval/base_cfg_{name}_mean"] = float(np.mean(guided_parts[name].scores))
        for key in tuned_parts[name].per_sample:  # e.g. geneval_mini's success: accuracy overall and per category
            for side, parts in sides:
                column = f"{side}_{name}_{key}"
                table[column] = np.asarray(parts[name].per_sample[key], dtype=float)
                prefix = f"eval/{'' if side == 'tuned' else side + '_'}{name}_{key}"
                summary[prefix] = float(table[column].mean())
                if key == "success":  # a row (prompt and input) any of whose seeds succeeds: pass@seeds_per_prompt
                    summary[f"{prefix}/prompts_with_a_success"] = prompts_with_a_success(table[column], groups)
                if "category" in table:
                    per_category = table.groupby("category")[column].mean()
                    for category, value in per_category.items():
                        summary[f"{prefix}/{category}"] = float(value)
                    summary[f"{prefix}/category_mean"] = float(per_category.mean())  # GenEval's overall
    table["win"] = (table["tuned_reward"] > table["base_reward"]).astype(float)
    table.loc[table["tuned_reward"] == table["base_reward"], "win"] = 0.5
    summary.update(
        {
            "eval/reward_mean": float(np.mean(tuned_total)),
            "eval/base_reward_mean": float(np.mean(base_total)),
            "eval/reward_gain": float(np.mean(tuned_total) - np.mean(base_total)),
            "eval/win_rate": float(table["win"].mean()),
            "eval/num_prompts": float(len(rows)),
            "eval/seeds_per_prompt": float(cfg.eval.seeds_per_prompt),
            "eval/diversity": diversity(tuned.images, prompts),
            "eval/base_diversity": diversity(base.images, prompts),
        }
    )
    if guided is not None:
        summary["eval/base_cfg_guidance_scale"] = float(cfg.eval.base_guidance_scale)
    bands = [side_by_side(base.images), side_by_side(tuned.images)]  # video: one grid per frame
    grid = stacked(bands if inputs is None else [side_by_side(inputs), *bands])
    return EvalResult(table, summary, grid, base.images, tuned.images, inputs)
