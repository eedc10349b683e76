"""The geneval_mini reward: OpenCV detection of the shapes world, judged as GenEval judges."""

import json

import numpy as np
import pytest

from diffusionrl.config import RewardConfig
from diffusionrl.data_shapes import COLORS, draw_scene, layout, render, shape_prompts
from diffusionrl.rewards import MixtureReward, build_reward, prompt_validator
from diffusionrl.rewards.geneval_mini import detect, judge


def _spec(prompt):
    return json.loads(next(r["spec"] for r in shape_prompts() if r["prompt"] == prompt))


def test_clean_renders_score_at_least_098_in_every_category():
    rng = np.random.default_rng(7)
    rows = shape_prompts() * 2
    images = np.stack([render(json.loads(r["spec"]), rng, 64) for r in rows])
    reward = build_reward("geneval_mini", RewardConfig(weights={"geneval_mini": 1.0}))
    result = reward(images, [r["prompt"] for r in rows], [{"spec": r["spec"]} for r in rows])
    success = result.per_sample["success"]
    assert success.mean() >= 0.98 and result.info["accuracy"] == pytest.approx(success.mean())
    for category in {r["category"] for r in rows}:
        assert success[[r["category"] == category for r in rows]].mean() >= 0.98, category
    assert np.all(result.scores[success == 1] == 1.0) and result.failures == 0


def test_detection_reads_shapes_colours_and_boxes():
    objects = [{"shape": "circle", "color": "red", "cx": 14, "cy": 14, "r": 8},
               {"shape": "square", "color": "blue", "cx": 46, "cy": 16, "r": 8},
               {"shape": "triangle", "color": "yellow", "cx": 30, "cy": 46, "r": 9}]
    found = sorted((d.shape, d.color) for d in detect(draw_scene(objects, 64)))
    assert found == [("circle", "red"), ("square", "blue"), ("triangle", "yellow")]
    assert detect(np.full((64, 64, 3), 255, np.uint8)) == []


def _recolour(objects, color):
    return [{**o, "color": color} for o in objects]


def test_a_wrong_colour_a_wrong_count_or_a_wrong_place_fails():
    rng = np.random.default_rng(3)
    spec = _spec("a blue circle")
    objects = layout(spec, rng, 64)
    assert judge(draw_scene(objects, 64), spec) == (True, 1.0)
    ok, score = judge(draw_scene(_recolour(objects, "red"), 64), spec)
    assert not ok and score == 0.5  # the circle is there, its colour is not

    spec = _spec("three squares")
    objects = layout(spec, rng, 64)
    assert judge(draw_scene(objects, 64), spec)[0]
    ok, score = judge(draw_scene(objects[:2], 64), spec)
    assert not ok and 0 < score < 1
    four = layout(_spec("four squares"), rng, 64)
    assert not judge(draw_scene(four, 64), spec)[0]  # counting is exact

    spec = _spec("a circle left of a square")
    objects = layout(spec, rng, 64)
    assert judge(draw_scene(objects, 64), spec)[0]
    mirrored = [{**o, "cx": 64 - o["cx"]} for o in objects]
    ok, score = judge(draw_scene(mirrored, 64), spec)
    assert not ok and score == pytest.approx(2 / 3)

    spec = _spec("a red square and a green triangle")
    swapped = [{**o, "color": "green" if o["shape"] == "square" else "red"} for o in layout(spec, rng, 64)]
    assert not judge(draw_scene(swapped, 64), spec)[0]  # colour attribution, not just colours
    assert judge(np.full((64, 64, 3), 255, np.uint8), spec) == (False, 0.0)


def test_prompts_without_a_spec_are_a_data_error_and_bad_images_score_zero():
    check = prompt_validator(RewardConfig(weights={"geneval_mini": 1.0}))
    check([{"prompt": r["prompt"], "spec": r["spec"]} for r in shape_prompts()[:3]], "world")
    with pytest.raises(ValueError, match=r"prompts.jsonl:4: the geneval_mini reward needs shapes-world prompts"):
        check([{"prompt": "a cat"}], "prompts.jsonl", locations=["prompts.jsonl:4"])
    scorer = MixtureReward({"geneval_mini": 1.0}, RewardConfig())
    total, parts = scorer(np.zeros((2, 8, 8, 1), np.uint8), ["a circle", "a circle"], [{"spec": "{}"}, {}])
    assert total.tolist() == [0.0, 0.0] and parts["geneval_mini"].failures == 2
    assert set(COLORS) == {"red", "green", "blue", "yellow"}


def test_report_shows_the_per_category_table_and_prompts_side_by_side():
    import pandas as pd

    from diffusionrl.report import build_report, category_table

    table = pd.DataFrame({"prompt": ["a circle", "three squares", "two circles"],
                          "category": ["single", "counting", "counting"],
                          "base_geneval_mini_success": [1.0, 0.0, 0.0], "tuned_geneval_mini_success": [1.0, 1.0, 0.0]})
    per = category_table(table).set_index("category")
    assert per.loc["counting", "base"] == 0.0 and per.loc["counting", "tuned"] == 0.5
    assert per.loc["overall", "prompts"] == 3 and per.loc["overall", "gain"] == pytest.approx(1 / 3)
    assert category_table(table.drop(columns="category")) is None
    grid = np.zeros((2 * 16, 3 * 16, 3), np.uint8)
    page = build_report(config={}, metrics=pd.DataFrame(), eval_table=table, eval_summary=None, grid=grid)
    assert "Accuracy per category" in page and "three squares" in page
    assert page.count("<img") == 6 and page.count("&#10003;") == 3  # base + tuned per prompt, 3 successes
