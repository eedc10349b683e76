"""The shapes world (diffusionrl/data/shapes.py): prompts, splits, and drawings that match their specs."""

import json
from collections import Counter

import numpy as np
import pytest

from diffusionrl.config import DataConfig
from diffusionrl.data import load_prompts
from diffusionrl.data.shapes import (
    CATEGORIES,
    COLORS,
    draw_scene,
    layout,
    prompt_of,
    relations,
    shape_prompts,
    world_splits,
)


def test_every_prompt_is_distinct_and_names_its_spec():
    rows = shape_prompts()
    assert len({r["prompt"] for r in rows}) == len(rows) == 126
    assert Counter(r["category"] for r in rows) == {"single": 3, "two": 6, "counting": 9, "colors": 12,
                                                     "position": 24, "color_attr": 72}
    for r in rows:
        assert prompt_of(json.loads(r["spec"])) == r["prompt"]
    assert {"a blue circle", "three triangles", "a circle left of a square",
            "a red square and a green triangle"} <= {r["prompt"] for r in rows}


@pytest.mark.parametrize("seed", [0, 1])
def test_splits_share_no_prompt_and_hold_out_every_category(seed):
    train, test = world_splits(0.2, seed)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len(train) + len(test) == 126
    assert {r["category"] for r in test} == {r["category"] for r in train} == set(CATEGORIES)
    assert world_splits(0.2, seed) == (train, test)  # seeded
    assert world_splits(0.2, seed + 2)[1] != test


def test_the_prompt_source_loads_the_split_with_specs():
    prompts = load_prompts(DataConfig(source="builtin:shapes", test_fraction=0.2, seed=0))
    assert (prompts.train, prompts.test) == world_splits(0.2, 0)
    assert all("spec" in r and "category" in r for r in prompts.train + prompts.test)


def test_the_four_prompt_bench_set_is_rows_of_the_world():
    """bench/data/shapes-4 (bench/README.md, "Four fixed prompts"): world rows as the generator writes them, one of
    each of four categories a split, no prompt in both, none of its test prompts trained on."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "bench" / "data" / "shapes-4"
    prompts = load_prompts(DataConfig(source=str(folder), test_fraction=0.2, seed=0))
    world = {r["prompt"]: r for r in shape_prompts()}
    for split in (prompts.train, prompts.test):
        assert len(split) == 4 and all(world[r["prompt"]] == r for r in split)
        assert sorted(r["category"] for r in split) == ["colors", "counting", "position", "two"]
    assert not {r["prompt"] for r in prompts.train} & {r["prompt"] for r in prompts.test}


def test_drawings_match_their_specs():
    rng = np.random.default_rng(0)
    for row in shape_prompts():
        spec = json.loads(row["spec"])
        objects = layout(spec, rng, 64)
        asked = Counter()
        for o in spec["objects"]:
            asked[o["shape"]] += o["count"]
            if o["color"]:
                assert sum(p["shape"] == o["shape"] and p["color"] == o["color"] for p in objects) >= o["count"]
        assert Counter(p["shape"] for p in objects) == asked
        if spec["relation"]:
            a, b = (next(p for p in objects if p["shape"] == spec["objects"][i]["shape"])
                    for i in (spec["relation"]["a"], spec["relation"]["b"]))
            boxes = [(p["cx"] - p["r"], p["cy"] - p["r"], p["cx"] + p["r"], p["cy"] + p["r"]) for p in (a, b)]
            assert relations(*boxes) == {spec["relation"]["rel"]}
        image = draw_scene(objects, 64)
        for p in objects:  # each object's centre has its colour, the corners the white background
            assert tuple(image[int(p["cy"]), int(p["cx"])]) == COLORS[p["color"]]
        assert tuple(image[0, 0]) == (255, 255, 255)


def test_relations_follow_geneval():
    left, right = (0, 20, 10, 30), (30, 20, 40, 30)
    assert relations(left, right) == {"left of"} and relations(right, left) == {"right of"}
    assert relations((20, 0, 30, 10), (20, 30, 30, 40)) == {"above"}
    assert relations(left, (2, 21, 12, 31)) == set()  # overlapping boxes: no relation


def test_web_captions_are_true_often_partial_and_cover_the_held_out_combinations():
    """The base's pretraining world (``web_scenes``): every caption a scene can get is true of it as the
    strict judge reads the image (each named object present, a count exact, a relation held), scenes
    carry extra objects, and every held-out combination is drawn."""
    from diffusionrl.data.shapes import all_specs, caption_holds, web_caption, web_scenes
    from diffusionrl.rewards.geneval_mini import detect, judge

    specs = all_specs()
    scenes = web_scenes(300, 64, seed=3)
    assert web_scenes(5, 64, seed=3)[4]["captions"] == scenes[4]["captions"]  # seeded
    rng = np.random.default_rng(0)
    exact = 0
    for s in scenes[:60]:
        found = detect(s["image"])
        assert len(found) == len(s["objects"])
        for c in s["captions"]:
            # a true caption: the judge finds every asked object (its partial score counts them) ...
            ok, score = judge(s["image"], {**specs[c], "relation": None}, found)
            asked = sum(o["count"] for o in specs[c]["objects"])
            assert score == pytest.approx(asked / len(found)), prompt_of(specs[c])
            rel = specs[c]["relation"]
            if rel:  # ... and some pair of the named objects it detects stands in the relation
                kinds = [specs[c]["objects"][rel[k]]["shape"] for k in ("a", "b")]
                assert any(rel["rel"] in relations(p.box, q.box) for p in found for q in found
                           if (p.shape, q.shape) == tuple(kinds)), prompt_of(specs[c])
            exact += ok and (judge(s["image"], specs[c], found)[0] or not rel)
        assert web_caption(s, rng) in s["captions"]
    assert exact  # ... and some are exact: nothing else in the picture
    assert np.mean([len(s["objects"]) > sum(o["count"] for o in specs[s["own"]]["objects"]) for s in scenes]) > 0.4
    _, test = world_splits(0.2, 0)
    drawn = {prompt_of(specs[c]) for s in web_scenes(3000, 64, seed=5)[::1] for c in s["captions"]}
    assert {r["prompt"] for r in test} <= drawn
    # what never holds is never a caption: a count is exact, a colour is the drawn one
    objects = [{"shape": "circle", "color": "red", "cx": 16, "cy": 32, "r": 8},
               {"shape": "circle", "color": "blue", "cx": 48, "cy": 32, "r": 8}]
    by_prompt = {prompt_of(s): s for s in specs}
    assert caption_holds(by_prompt["two circles"], objects) and not caption_holds(by_prompt["three circles"], objects)
    assert caption_holds(by_prompt["a red circle"], objects) and not caption_holds(by_prompt["a green circle"], objects)
    assert not caption_holds(by_prompt["a circle and a square"], objects)
