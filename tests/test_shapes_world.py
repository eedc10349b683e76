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
    """bench/data/shapes-4 (README: four fixed prompts): world rows as the generator writes them, one of
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
