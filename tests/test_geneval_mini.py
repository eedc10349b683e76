"""The geneval_mini reward: OpenCV detection of the shapes world, judged as GenEval judges."""

import json

import numpy as np
import pytest

from diffusionrl.config import RewardConfig
from diffusionrl.data.shapes import COLORS, draw_scene, layout, render, shape_prompts
from diffusionrl.rewards import MixtureReward, build_reward, prompt_validator
from diffusionrl.rewards.geneval_mini import detect, judge


def _spec(prompt):
    return json.loads(next(r["spec"] for r in shape_prompts() if r["prompt"] == prompt))


def test_clean_renders_succeed_on_every_prompt_of_every_category():
    rng = np.random.default_rng(7)
    rows = shape_prompts() * 3
    images = np.stack([render(json.loads(r["spec"]), rng, 64) for r in rows])
    reward = build_reward("geneval_mini", RewardConfig(weights={"geneval_mini": 1.0}))
    result = reward(images, [r["prompt"] for r in rows], [{"spec": r["spec"]} for r in rows])
    assert result.per_sample["success"].tolist() == [1.0] * len(rows) and result.failures == 0
    assert np.all(result.scores == 1.0) and result.info["accuracy"] == 1.0
    assert result.info["blobs_per_image"] == 0.0
    assert result.per_sample["objects"].tolist() == [sum(o["count"] for o in json.loads(r["spec"])["objects"])
                                                     for r in rows]


def _blob_sheet(seed: int, n: int = 10) -> np.ndarray:
    """What the collapsed demo drew: a sheet of small multicoloured blobs, some of them roundish."""
    import cv2

    rng = np.random.default_rng(seed)
    image = np.full((64, 64, 3), 255, np.uint8)
    colours = list(COLORS.values()) + [(200, 40, 200), (240, 120, 20)]
    for k in range(n):
        cx, cy = rng.integers(6, 58, size=2)
        axes = (int(rng.integers(2, 6)), int(rng.integers(2, 6)))
        cv2.ellipse(image, (int(cx), int(cy)), axes, float(rng.uniform(0, 180)), 0, 360,
                    tuple(int(c) for c in colours[k % len(colours)]), -1)
        cv2.line(image, (int(cx), int(cy)), (int(cx + rng.integers(-8, 8)), int(cy + rng.integers(-8, 8))),
                 tuple(int(c) for c in colours[(k + 1) % len(colours)]), 2)
    return image


def test_a_sheet_of_blobs_scores_about_zero_for_every_prompt():
    rows = shape_prompts()
    for seed in range(5):
        sheet = _blob_sheet(seed)
        scores = [judge(sheet, json.loads(r["spec"]))[1] for r in rows]
        assert max(scores) <= 0.2 and np.mean(scores) <= 0.08, (seed, max(scores), np.mean(scores))
        assert len(detect(sheet)) >= 6


def test_one_fixed_picture_succeeds_only_on_the_prompts_it_satisfies():
    picture = draw_scene([{"shape": "circle", "color": "red", "cx": 20, "cy": 30, "r": 8},
                          {"shape": "square", "color": "blue", "cx": 46, "cy": 30, "r": 8}], 64)
    results = {r["prompt"]: judge(picture, json.loads(r["spec"])) for r in shape_prompts()}
    assert sorted(p for p, (ok, _) in results.items() if ok) == [
        "a blue square and a red circle", "a circle and a square", "a circle left of a square",
        "a red circle and a blue square", "a square and a circle", "a square right of a circle"]
    assert np.mean([score for _, score in results.values()]) < 0.4


def test_a_right_object_with_a_smudge_or_a_shapeless_object_loses_credit():
    spec = _spec("a blue circle")
    objects = [{"shape": "circle", "color": "blue", "cx": 20, "cy": 20, "r": 8}]
    clean = draw_scene(objects, 64)
    assert judge(clean, spec) == (True, 1.0)
    smudged = clean.copy()
    smudged[44:50, 40:52] = COLORS["green"]  # a small bar: a shapeless object
    ok, score = judge(smudged, spec)
    assert not ok and score == pytest.approx(0.5)
    assert [d.shape for d in detect(smudged)].count("blob") == 1
    off = clean.copy()
    off[44:52, 40:48] = (200, 40, 200)  # an off-colour square: no world colour, so no object of the world
    assert judge(off, spec) == (False, pytest.approx(0.5))
    assert not judge(draw_scene(objects * 1 + [{**objects[0], "cx": 46, "cy": 46}], 64), spec)[0]  # one too many


def test_a_blank_or_pale_picture_scores_zero():
    for image in (np.full((64, 64, 3), 255, np.uint8), np.full((64, 64, 3), 235, np.uint8),
                  np.zeros((64, 64, 3), np.uint8)):
        for r in shape_prompts()[::10]:
            assert judge(image, json.loads(r["spec"])) == (False, 0.0)


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
    assert not ok and score == pytest.approx(1 / 3)  # the circle is there (half a match), its colour is not

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
    assert not ok and score == pytest.approx(0.5)  # the right objects, the relation broken

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
    # GenEval's overall: the mean of the categories (single 1 -> 1, counting 0 -> 0.5), not of the samples
    assert per.loc["overall", "base"] == 0.5 and per.loc["overall", "gain"] == pytest.approx(0.25)
    assert per.loc["all samples", "prompts"] == 3 and per.loc["all samples", "gain"] == pytest.approx(1 / 3)
    assert per.loc["counting", "prompts"] == 2 and per.loc["counting", "samples"] == 2
    # the seeds' spread: a category whose samples all agree has none, counting's two samples give 0 .. 1
    assert per.loc["single", "gain_lo"] == per.loc["single", "gain_hi"] == 0.0
    assert (per.loc["counting", "gain_lo"], per.loc["counting", "gain_hi"]) == (0.0, 1.0)
    assert per.loc["overall", "gain_lo"] <= 0.25 <= per.loc["overall", "gain_hi"]
    assert category_table(table.drop(columns="category")) is None
    # a second judge's columns: the table of the one named, by default the first
    second = table.assign(base_geneval_mini_rules_success=[1.0, 1.0, 0.0], tuned_geneval_mini_rules_success=1.0)
    assert category_table(second).set_index("category").loc["counting", "base"] == 0.0
    assert category_table(second, reward="geneval_mini_rules").set_index("category").loc["counting", "base"] == 0.5
    grid = np.zeros((2 * 16, 3 * 16, 3), np.uint8)
    page = build_report(config={}, metrics=pd.DataFrame(), eval_table=table, eval_summary=None, grid=grid)
    assert "Strict accuracy per category" in page and "three squares" in page
    assert page.count("<img") == 6 and page.count("&#10003;") == 3  # base + tuned per prompt, 3 successes
    summary = {"eval/base_geneval_mini_success": 0.15, "eval/geneval_mini_success": 0.23, "eval/seeds_per_prompt": 8,
               "eval/base_geneval_mini_success/prompts_with_a_success": 0.48,
               "eval/geneval_mini_success/prompts_with_a_success": 0.96}
    page = build_report(config={}, metrics=pd.DataFrame(), eval_table=table, eval_summary=summary, grid=grid)
    # one line per side: strict success over samples, then pass@seeds (figures of that line, not lines)
    assert '<th>base</th><td class="num">0.15</td><td class="num">0.48</td>' in page
    assert '<th>tuned</th><td class="num">0.23</td><td class="num">0.96</td>' in page
    assert "prompts with a success in 8 seeds" in page and page.count("strict success</th>") == 1
    # two judges: the table, the thumbnails' verdicts and their titles follow the trained one (the first of
    # reward.weights), the one at weight 0 stays in the headline
    config = {"reward": {"weights": {"geneval_mini_rules": 1.0, "geneval_mini": 0.0}}}
    page = build_report(config=config, metrics=pd.DataFrame(), eval_table=second, eval_summary=None, grid=grid)
    assert "Strict accuracy per category (geneval_mini_rules)" in page
    assert "geneval_mini_rules&#39;s strict verdict" in page
    assert page.count("&#10003;") == 2 + 3  # tuned succeeds on all three by the rules, base on two
    page = build_report(config={"reward": {"weights": {"geneval_mini": 1.0, "geneval_mini_rules": 0.0}}},
                        metrics=pd.DataFrame(), eval_table=second, eval_summary=None, grid=grid)
    assert "Strict accuracy per category (geneval_mini)" in page and page.count("&#10003;") == 3


def _rules(image, prompt):
    reward = build_reward("geneval_mini_rules", RewardConfig(weights={"geneval_mini_rules": 1.0}))
    result = reward(image[None], [prompt], [{"spec": json.dumps(_spec(prompt))}])
    return bool(result.per_sample["success"][0]), float(result.scores[0])


def test_geneval_rules_ignore_other_objects_and_blobs_and_give_per_check_credit():
    rng = np.random.default_rng(5)
    assert all(_rules(render(json.loads(r["spec"]), rng, 64), r["prompt"])[0] for r in shape_prompts())
    circle = {"shape": "circle", "color": "blue", "cx": 20, "cy": 20, "r": 8}
    crowded = draw_scene([circle, {"shape": "square", "color": "red", "cx": 46, "cy": 46, "r": 8}], 64).copy()
    crowded[4:8, 40:60] = COLORS["green"]  # a shapeless bar
    assert not judge(crowded, _spec("a blue circle"))[0]  # the exact-scene judge refuses what is not asked
    assert _rules(crowded, "a blue circle") == (True, 1.0)  # GenEval looks only at what is asked
    assert _rules(crowded, "a green circle") == (False, 0.5)  # present, wrong colour: one check of two
    assert _rules(crowded, "a triangle") == (False, 0.0)
    # the largest detection of a shape is the one whose colour counts
    small_green = {"shape": "circle", "color": "green", "cx": 48, "cy": 14, "r": 5}
    assert _rules(draw_scene([circle, small_green], 64), "a blue circle")[0]
    assert not _rules(draw_scene([circle, small_green], 64), "a green circle")[0]
    # counting: at least N, and no more than N, of that shape (other shapes free)
    spec = _spec("two circles")
    two = layout(spec, rng, 64)
    assert _rules(draw_scene(two + [{"shape": "square", "color": "red", "cx": 4, "cy": 4, "r": 3}], 64),
                  "two circles")[0]
    three = layout(_spec("three circles"), rng, 64)
    assert _rules(draw_scene(three, 64), "two circles") == (False, 0.5)
    assert _rules(draw_scene(three[:1], 64), "two circles") == (False, 0.0)
    # position: both present (2 checks) and the relation (1 check)
    spec = _spec("a circle left of a square")
    objects = layout(spec, rng, 64)
    mirrored = [{**o, "cx": 64 - o["cx"]} for o in objects]
    assert _rules(draw_scene(objects, 64), "a circle left of a square") == (True, 1.0)
    assert _rules(draw_scene(mirrored, 64), "a circle left of a square") == (False, pytest.approx(2 / 3))
    # colour attribution: the colours swapped pass the two presence checks only
    spec = _spec("a red square and a green triangle")
    swapped = [{**o, "color": "green" if o["shape"] == "square" else "red"} for o in layout(spec, rng, 64)]
    assert _rules(draw_scene(swapped, 64), "a red square and a green triangle") == (False, 0.5)
