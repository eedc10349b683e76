"""The shape-edit task: its generator (unambiguous instructions, held-out combinations) and its judge."""

import io
import json
from functools import cache

import numpy as np
import pytest
from PIL import Image

from diffusionrl.config import DataConfig, RewardConfig
from diffusionrl.data import PromptDataError, load_prompts, rows_digest
from diffusionrl.data.shape_edits import (
    CATEGORIES,
    MIN_MOVE,
    all_edits,
    edits_of,
    generate_edit_prompts,
    instruction_of,
    loosen,
    resolve,
)
from diffusionrl.data.shapes import COLORS, SHAPES, apart, draw_scene, object_box, relations
from diffusionrl.rewards import build_reward, prompt_validator
from diffusionrl.rewards.shape_edit import judge_edit, judge_edit_made
from tests.test_geneval_mini import _blob_sheet

SOURCE = "builtin:shape-edits:60"


@cache
def _rows() -> tuple[dict, ...]:
    train, test = generate_edit_prompts(SOURCE, 256, 0, 0.2)
    return tuple(train + test)


def _scene(row, key="target"):
    return json.loads(row[key])


def _target_image(row) -> np.ndarray:
    target = _scene(row)
    return draw_scene(target["objects"], target["resolution"])


def _source_image(row) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(row["image"])).convert("RGB"))


def _score(images, rows, name="shape_edit"):
    reward = build_reward(name, RewardConfig(weights={name: 1.0}))
    return reward(np.stack(images), [r["prompt"] for r in rows], [{k: v for k, v in r.items() if k != "prompt"}
                                                                   for r in rows])


def test_the_target_scores_one_and_the_unedited_input_less_for_every_example():
    rows = list(_rows())
    assert sorted({r["category"] for r in rows}) == sorted(CATEGORIES) and len(rows) == 75
    target = _score([_target_image(r) for r in rows], rows)
    assert target.failures == 0 and np.all(target.scores == 1.0) and target.info["accuracy"] == 1.0
    assert np.all(target.per_sample["unchanged"] == 1.0) and np.all(target.per_sample["blobs"] == 0)
    copy = _score([_source_image(r) for r in rows], rows)
    assert copy.failures == 0 and np.all(copy.per_sample["success"] == 0.0) and np.all(copy.scores < 1.0)
    assert np.all(copy.per_sample["unchanged"] == 1.0)  # the copy leaves the rest alone; only the edit is missing
    for category in CATEGORIES:
        mine = np.array([r["category"] == category for r in rows])
        assert copy.scores[mine].max() <= 0.8, category  # at most n / (n + 1) with n <= 4 objects left in place


def test_the_judge_reads_the_target_at_any_resolution():
    for row in _rows()[:10]:
        target = _scene(row)
        big = [{**o, "cx": 2 * o["cx"], "cy": 2 * o["cy"], "r": 2 * o["r"]} for o in target["objects"]]
        assert judge_edit(draw_scene(big, 128), target)[:2] == (True, 1.0)


def test_every_instruction_names_its_objects_unambiguously_and_changes_what_it_says():
    edits = {instruction_of(e): e for es in all_edits().values() for e in es}
    assert len(edits) == sum(len(es) for es in all_edits().values())  # one text per edit
    for row in _rows():
        edit, source, target = edits[row["prompt"]], _scene(row, "source")["objects"], _scene(row)
        after = target["objects"]
        assert edit["kind"] == row["category"] and np.array_equal(_source_image(row), draw_scene(source, 64))
        i = resolve(edit["ref"], source) if "ref" in edit else None
        j = resolve(edit["anchor"], source) if "anchor" in edit else None
        assert ("ref" not in edit or i is not None) and ("anchor" not in edit or j not in (None, i)), row["prompt"]
        keep = [k for k in range(len(source)) if k != i]
        plain = [{key: o[key] for key in ("shape", "color", "cx", "cy", "r")} for o in after]
        if edit["kind"] == "remove":
            assert plain == [source[k] for k in keep] and len(after) >= 1
        elif edit["kind"] == "add":
            assert plain[:-1] == source and len(after) <= 4 and target["relation"]["a"] == len(source)
        else:
            assert [plain[k] for k in keep] == [source[k] for k in keep] and len(after) == len(source)
            changed = {key for key in plain[i] if plain[i][key] != source[i][key]}
            assert changed == {"recolor": {"color"}, "replace": {"shape"}, "move": {"cx", "cy"}}[edit["kind"]]
        if edit["kind"] in ("add", "move"):
            a = after[target["relation"]["a"]]
            assert a["moved"] and target["relation"] == {"a": target["relation"]["a"], "b": j, "rel": edit["rel"]}
            assert all(apart(a, o, 64) for o in after if o is not a)
        if edit["kind"] == "move":
            assert np.hypot(a["cx"] - source[i]["cx"], a["cy"] - source[i]["cy"]) >= MIN_MOVE * 64
        if edit["kind"] == "recolor":
            assert plain[i]["color"] == edit["color"] != source[i]["color"]


def test_held_out_instructions_never_appear_in_training_and_rows_are_reproducible():
    check = prompt_validator(RewardConfig(weights={"shape_edit": 1.0}))
    prompts = load_prompts(DataConfig(source=SOURCE, test_fraction=0.2, seed=0), validate=check)
    assert len(prompts.train) == 60 and len(prompts.test) == 15
    assert not {r["prompt"] for r in prompts.train} & {r["prompt"] for r in prompts.test}
    assert {r["category"] for r in prompts.test} == set(CATEGORIES)
    # the generator's row, its PNG made a data: URI with its digest on loading (data/images.py)
    assert set(prompts.train[0]) == {"prompt", "image", "category", "source", "target", "image_sha256"}
    assert prompts.train[0]["image"].startswith("data:image/png;base64,")
    again = load_prompts(DataConfig(source=SOURCE, test_fraction=0.2, seed=0))
    assert again.train == prompts.train and again.test == prompts.test and again.digest == prompts.digest
    other = load_prompts(DataConfig(source=SOURCE, test_fraction=0.2, seed=1))
    assert other.train != prompts.train and other.digest != prompts.digest
    changed = [{**r, "image": r["image"][:-4] + "AAAA"} if i == 0 else r for i, r in enumerate(prompts.train)]
    assert rows_digest(changed, prompts.test) != prompts.digest  # the source image counts in the digest
    assert len(load_prompts(DataConfig(source="builtin:shape-edits", num_prompts=10, test_fraction=0.2)).train) == 10
    for bad in ("builtin:shape-edits:0", "builtin:shape-edits:x", "builtin:shape-editsx"):
        with pytest.raises(PromptDataError, match="shape-edits"):
            load_prompts(DataConfig(source=bad))


def test_rows_without_source_and_target_scenes_are_a_data_error_naming_the_row():
    check = prompt_validator(RewardConfig(weights={"shape_edit": 1.0}))
    row = dict(_rows()[0])
    check([row], "edits")
    for broken in ({"prompt": "make the circle blue"}, {**row, "target": "{}"}, {k: v for k, v in row.items()
                                                                                 if k != "source"}):
        with pytest.raises(ValueError, match=r"edits.jsonl:3: the shape_edit reward needs shape-edit rows"):
            check([row, broken], "edits.jsonl", locations=["edits.jsonl:2", "edits.jsonl:3"])


def test_a_blank_picture_or_a_sheet_of_blobs_scores_about_zero():
    rows = list(_rows())
    blank = _score([np.full((64, 64, 3), 255, np.uint8)] * len(rows), rows)
    assert np.all(blank.scores == 0.0) and blank.failures == 0
    for seed in range(3):
        sheet = _score([_blob_sheet(seed)] * len(rows), rows)
        assert sheet.scores.max() <= 0.1 and sheet.scores.mean() <= 0.05 and sheet.info["accuracy"] == 0.0
    catalogue = [{"shape": shape, "color": color, "cx": 9 + (k % 4) * 15.5, "cy": 9 + (k // 4) * 22, "r": 6}
                 for k, (color, shape) in enumerate((c, s) for c in COLORS for s in SHAPES)]
    every = _score([draw_scene(catalogue, 64)] * len(rows), rows)  # every shape in every colour at once
    assert every.per_sample["objects"][0] == 12 and every.scores.max() <= 0.25 and every.scores.mean() <= 0.15


def test_the_right_edit_with_a_smudge_or_a_displaced_bystander_loses_credit():
    displaced = 0
    for row in _rows():
        target = _scene(row)
        n = len(target["objects"])
        image = _target_image(row)
        smudged = image.copy()
        free = next((y, x) for y in range(2, 56, 2) for x in range(2, 50, 2)
                    if np.all(image[y - 2:y + 8, x - 2:x + 14] == 255))
        smudged[free[0]:free[0] + 6, free[1]:free[1] + 12] = COLORS["green"]  # a bar: a shapeless object
        ok, score, _ = judge_edit(smudged, target)
        assert not ok and score == pytest.approx(n / (n + 1))
        still = [k for k, o in enumerate(target["objects"]) if not o["edited"]]
        if not still:
            continue
        k = still[0]
        for dx, dy in ((14, 0), (-14, 0), (0, 14), (0, -14)):  # drag one untouched object somewhere free
            o = target["objects"][k]
            moved = {**o, "cx": o["cx"] + dx, "cy": o["cy"] + dy}
            rest = [o for m, o in enumerate(target["objects"]) if m != k]
            if all(apart(moved, o, 64) for o in rest) and moved["r"] < moved["cx"] < 64 - moved["r"] \
                    and moved["r"] < moved["cy"] < 64 - moved["r"]:
                break
        else:
            continue
        objects = [moved if m == k else o for m, o in enumerate(target["objects"])]
        rel = target["relation"]
        if rel and rel["rel"] not in relations(*(object_box(objects[rel[s]]) for s in "ab")):
            continue  # dragging the anchor broke the relation too: another test's business
        ok, score, unchanged = judge_edit(draw_scene(objects, 64), target)
        assert not ok and not unchanged and score == pytest.approx((n - 0.5) / (n + 0.5)), row["prompt"]
        displaced += 1
    assert displaced >= 50  # most examples have an untouched object with room to drag it (68 of these 75)


def test_a_wrong_edit_fails():
    rows = {r["category"]: r for r in _rows()}
    recolor = _scene(rows["recolor"])
    edited = next(o for o in recolor["objects"] if o["edited"])
    wrong = [{**o, "color": next(c for c in COLORS if c != o["color"])} if o is edited else o
             for o in recolor["objects"]]
    assert not judge_edit(draw_scene(wrong, 64), recolor)[0]
    move = _scene(rows["move"])
    a, b = (move["objects"][move["relation"][s]] for s in "ab")
    mirrored = [{**o, "cx": 2 * b["cx"] - o["cx"], "cy": 2 * b["cy"] - o["cy"]} if o is a else o
                for o in move["objects"]]
    ok, score, unchanged = judge_edit(draw_scene(mirrored, 64), move)  # moved, to the opposite side
    assert not ok and score < 1 and unchanged
    source = _scene(rows["move"], "source")["objects"]
    kept = move["objects"] + [source[move["relation"]["a"]]]  # moved by copying: the original still there
    n = len(move["objects"])
    assert judge_edit(draw_scene(kept, 64), move)[:2] == (False, pytest.approx(n / (n + 1)))


def test_a_right_edit_drawn_a_little_off_still_succeeds():
    shifted = 0
    for row in _rows():
        objects = _scene(row)["objects"]
        if all(3 + o["r"] < o[k] < 61 - o["r"] for o in objects for k in ("cx", "cy")):
            nudged = [{**o, "cx": o["cx"] + 2, "cy": o["cy"] - 2} for o in objects]  # relations survive a shift
            assert judge_edit(draw_scene(nudged, 64), _scene(row))[:2] == (True, 1.0), row["prompt"]
            shifted += 1
    assert shifted >= 30


def test_one_fixed_picture_succeeds_only_where_it_is_the_target():
    rows = list(_rows())
    for picture_row in rows[:5]:
        picture = _target_image(picture_row)
        result = _score([picture] * len(rows), rows)
        same = [r["target"] == picture_row["target"] for r in rows]
        assert result.per_sample["success"].tolist() == [float(s) for s in same]
        assert result.scores.mean() < 0.2


def _gated(images, rows):
    return _score(images, rows, "shape_edit_gated")


def test_the_gated_credit_pays_neither_a_copy_nor_an_over_edit_and_grades_a_made_edit_with_a_smudge():
    rows = list(_rows())
    copies = [_source_image(r) for r in rows]
    assert _score(copies, rows).scores.mean() > 0.5  # shape_edit pays the copy for what it leaves alone ...
    copy = _gated(copies, rows)  # ... shape_edit_gated pays it nothing, in every category
    assert copy.failures == 0 and np.all(copy.scores == 0.0) and np.all(copy.per_sample["made"] == 0.0)
    target = _gated([_target_image(r) for r in rows], rows)
    assert np.all(target.scores == 1.0) and np.all(target.per_sample["made"] == 1.0)
    assert np.all(_gated([np.full((64, 64, 3), 255, np.uint8)] * len(rows), rows).scores == 0.0)
    check = prompt_validator(RewardConfig(weights={"shape_edit_gated": 1.0}))
    check(rows[:3], "edits")
    with pytest.raises(ValueError, match=r"edits row 2: the shape_edit_gated reward needs shape-edit rows"):
        check([rows[0], {k: v for k, v in rows[1].items() if k != "source"}], "edits")
    # an over-edit: the named object recoloured, and every other object too
    recolors = [r for r in rows if r["category"] == "recolor"]
    over, changed = [], []
    for row in recolors:
        objects = _scene(row)["objects"]
        new = next(o["color"] for o in objects if o["edited"])
        over.append(draw_scene([{**o, "color": new} for o in objects], 64))
        changed.append(any(o["color"] != new for o in objects))  # a bystander of another colour was recoloured
    plain, gated = _score(over, recolors), _gated(over, recolors)
    changed = np.array(changed)
    assert changed.sum() >= 8 and np.all(gated.per_sample["made"] == 1.0)
    assert np.all(plain.scores[changed] >= 0.4) and np.all(gated.scores[changed] == 0.0)
    # the edit made and the rest in place, with a smudge beside: the partial credit n / (n + 1)
    smudged, checked = [], []
    for row in rows:
        image = _target_image(row).copy()
        free = next(((y, x) for y in range(2, 56, 2) for x in range(2, 50, 2)
                     if np.all(image[y - 2:y + 8, x - 2:x + 14] == 255)), None)
        if free is not None:
            image[free[0]:free[0] + 6, free[1]:free[1] + 12] = COLORS["green"]
            smudged.append(image)
            checked.append(row)
    n = np.array([len(_scene(r)["objects"]) for r in checked])
    np.testing.assert_allclose(_gated(smudged, checked).scores, n / (n + 1), rtol=1e-6)


def test_a_removal_is_made_only_when_the_named_object_is_gone():
    removals = [r for r in _rows() if r["category"] == "remove"]
    for row in removals:
        source, target = _scene(row, "source")["objects"], _scene(row)["objects"]
        plain = [{k: o[k] for k in ("shape", "color", "cx", "cy", "r")} for o in target]
        gone = next(o for o in source if o not in plain)
        wrong = [o for o in source if o != plain[0]]  # another object removed instead
        assert judge_edit_made(draw_scene(wrong, 64), _scene(row), source=_scene(row, "source"))[3] is False
        elsewhere = {**gone, "cx": 64 - gone["cx"], "cy": 64 - gone["cy"]}  # "removed" by moving it away
        if all(apart(elsewhere, o, 64) for o in plain):
            kept = draw_scene(plain + [elsewhere], 64)
            assert judge_edit_made(kept, _scene(row), source=_scene(row, "source"))[3] is False, row["prompt"]
        assert judge_edit_made(draw_scene(plain, 64), _scene(row), source=_scene(row, "source"))[3] is True
    assert len(removals) >= 10


def test_a_loose_instruction_names_an_edit_that_is_made_while_its_target_holds_one_more():
    """``loosen`` (pretraining's loose instructions): the target keeps the named edit made (the judge finds
    it, a named removal stays gone) and holds one more change, so that by the row's own instruction it is
    not the exact edit; the row's instruction, source and category are untouched."""
    rows = list(_rows())
    edits = edits_of({r["prompt"] for r in rows})
    loose = [loosen(r, edits, np.random.default_rng([0, i])) for i, r in enumerate(rows)]
    changed = [i for i, (r, o) in enumerate(zip(rows, loose)) if o is not r]
    assert len(changed) >= 0.8 * len(rows) and {rows[i]["category"] for i in changed} == set(CATEGORIES)
    assert all({**loose[i], "target": rows[i]["target"]} == rows[i] for i in changed)
    assert all(_scene(loose[i])["extra"] in {instruction_of(e) for e in edits} for i in changed)
    picked = [loose[i] for i in changed]
    result = _score([_target_image(o) for o in picked], [rows[i] for i in changed], name="shape_edit_gated")
    assert np.all(result.per_sample["made"] == 1.0) and np.all(result.per_sample["success"] == 0.0)
    added = np.array([_scene(o)["extra"].startswith("add ") for o in picked])
    assert 0 < added.sum() < len(picked)
    # a changed bystander fails the gate; an added object is an extra detection, n / (n + 1) as a smudge
    assert np.all(result.per_sample["unchanged"][~added] < 1.0) and np.all(result.scores[~added] == 0.0)
    assert np.all(result.scores[added] < 1.0) and np.all(result.per_sample["unchanged"][added] == 1.0)
