"""The demo's task end to end at test size: tiny-cpu-shapes trains one DiffusionNFT step on the shapes
world and its evaluation scores base and tuned images per GenEval category."""

import pytest

from diffusionrl.config import load_config
from diffusionrl.data import load_prompts
from diffusionrl.data.shapes import CATEGORIES
from diffusionrl.evaluation import evaluate_lora
from diffusionrl.train import train

SMALL = ["train.steps=1", "train.prompts_per_step=2", "train.group_size=4", "train.micro_batch_size=4",
         "sampling.num_steps=4", "sampling.window_range=[0, 3]", "eval.num_steps=4", "train.checkpoint_every=0",
         "train.log_images_every=0"]


def test_one_step_on_the_shapes_world_and_a_per_category_evaluation(tmp_path):
    cfg = load_config("tiny-cpu-shapes", overrides=SMALL)
    result = train(cfg, tmp_path / "run", resume=None, progress=False)
    (metrics,) = result.metrics
    assert 0 <= metrics["rollout/reward/geneval_mini_accuracy"] <= 1
    assert metrics["rollout/reward/geneval_mini_failures"] == 0
    test = load_prompts(cfg.data).test
    rows = [next(r for r in test if r["category"] == c) for c in CATEGORIES]
    ev = evaluate_lora(cfg, rows, result.model_dir)
    k = cfg.eval.seeds_per_prompt  # the preset's 8 samples per prompt, side by side, seeds 1234 + 8 i + j
    assert ev.table["category"].tolist() == [c for c in CATEGORIES for _ in range(k)]
    assert ev.table["seed"].tolist() == [cfg.eval.seed + i for i in range(k * len(CATEGORIES))]
    assert ev.grid.shape[1] == k * len(CATEGORIES) * 64 and "eval/diversity" in ev.summary
    assert set(ev.table["base_geneval_mini_success"]) <= {0.0, 1.0}
    # GenEval's overall: the mean of the category accuracies
    per = [ev.summary[f"eval/geneval_mini_success/{c}"] for c in CATEGORIES]
    assert ev.summary["eval/geneval_mini_success/category_mean"] == pytest.approx(sum(per) / len(per))
    assert (ev.table["tuned_geneval_mini"] >= ev.table["tuned_geneval_mini_success"]).all()  # partial credit
    for side in ("base", "tuned"):  # a prompt counts when any of its k seeds succeeds
        solved = ev.table.groupby("prompt")[f"{side}_geneval_mini_success"].max().mean()
        key = f"eval/{'base_' if side == 'base' else ''}geneval_mini_success/prompts_with_a_success"
        assert ev.summary[key] == pytest.approx(solved)
    for side in ("", "base_"):
        per_category = [ev.summary[f"eval/{side}geneval_mini_success/{c}"] for c in CATEGORIES]
        assert sum(per_category) / len(CATEGORIES) == pytest.approx(ev.summary[f"eval/{side}geneval_mini_success"])


def test_the_base_with_guidance_is_sampled_on_the_same_seeds(tmp_path):
    """eval.base_guidance_scale samples the base a second time at that CFG scale, same seeds: its
    columns are what an evaluation at that scale gives the base, and the bar is reported beside both."""
    common = SMALL + ["eval.guidance_scale=1", "eval.seeds_per_prompt=2", "eval.base_guidance_scale=0"]
    cfg = load_config("tiny-cpu-shapes", overrides=common)
    result = train(cfg, tmp_path / "run", resume=None, progress=False)
    test = load_prompts(cfg.data).test
    rows = [next(r for r in test if r["category"] == c) for c in ("single", "two")]
    def evaluate(*extra):
        return evaluate_lora(load_config("tiny-cpu-shapes", overrides=common + list(extra)), rows, result.model_dir)

    both, at_cfg = evaluate("eval.base_guidance_scale=4.5"), evaluate("eval.guidance_scale=4.5")
    assert both.table["base_cfg_geneval_mini"].tolist() == at_cfg.table["base_geneval_mini"].tolist()
    assert both.summary["eval/base_cfg_geneval_mini_success"] == at_cfg.summary["eval/base_geneval_mini_success"]
    assert both.summary["eval/base_cfg_guidance_scale"] == 4.5
    assert both.table["base_geneval_mini"].tolist() != both.table["base_cfg_geneval_mini"].tolist()
    plain = evaluate_lora(cfg, rows, result.model_dir)  # 0: not sampled
    assert "base_cfg_geneval_mini" not in plain.table and "eval/base_cfg_guidance_scale" not in plain.summary
