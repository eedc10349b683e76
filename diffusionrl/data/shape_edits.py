"""Image edits in the shapes world (``data.shapes``): a source scene, an instruction, the expected scene.

``builtin:shape-edits[:N]`` prompt rows (``data.source``), judged by the ``shape_edit`` reward
(``rewards/shape_edit.py``). Each row is ``{"prompt": instruction, "image": PNG bytes of the source
scene, "category": kind, "source": JSON scene, "target": JSON scene}``; a scene is ``{"resolution",
"objects": [{"shape", "color", "cx", "cy", "r"}]}`` (``shapes.layout``'s objects, pixels at
``resolution``), and the target's objects also carry ``edited`` (the instruction made or changed it)
and ``moved`` (its place is the edit's: judged by the target's ``relation`` ``{"a", "b", "rel"}``,
object a ``rel`` object b, not by its coordinates).

========= ============================================ =============================================
category  example                                      the target
========= ============================================ =============================================
recolor   ``make the circle blue``                     the circle blue, in place
replace   ``turn the red square into a triangle``      a red triangle where the square was
remove    ``remove the green triangle``                the other objects, in place
add       ``add a red square left of the triangle``    one more object, in that relation (4 at most)
move      ``move the circle above the square``         the circle elsewhere, in that relation
========= ============================================ =============================================

Every instruction is unambiguous in its source scene: an object is named by its shape ("the circle")
or by colour and shape ("the red circle"), and only when exactly one object of the scene fits that
name (an object no name fits is not edited), and every edit changes something (a recolour to
another colour, a move to a relation that did not hold, by at least ``MIN_MOVE`` of the image;
relations are GenEval's, ``shapes.relations``, checked with every box grown and shrunk by a pixel so
that a detector's rounding cannot flip them).
Untouched objects keep their place, size and colour, and every example has one (a source scene holds
2-4 objects, 1-3 for ``add``, whose anchor stays): "the rest is unchanged" is always part of the task.

``edit_splits`` holds out, per category, the ``test_fraction`` of all the world's instruction texts
with the smallest seeded hash (as ``shapes.world_splits`` does for prompts): a held-out row's
instruction (e.g. "make the circle blue") never appears in training, where its parts do ("make the
circle red", "make the square blue"). Rows are drawn per split from a seeded generator, one category
after another, so the same seed gives the same rows.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np

from diffusionrl.video import png_bytes

from .shapes import COLORS, RELATIONS, SHAPES, apart, draw_scene, layout, object_box, relations

CATEGORIES = ("recolor", "replace", "remove", "add", "move")
SOURCE = "builtin:shape-edits"
MAX_OBJECTS = 4
MIN_MOVE = 0.15  # a moved object's centre travels at least this share of the image
RESOLUTION = 64


def _refs() -> list[dict[str, Any]]:
    return [{"shape": s, "color": None} for s in SHAPES] + [{"shape": s, "color": c} for c in COLORS for s in SHAPES]


def _ref_text(ref: dict[str, Any]) -> str:
    return f"{ref['color'] + ' ' if ref['color'] else ''}{ref['shape']}"


def instruction_of(edit: dict[str, Any]) -> str:
    """The instruction text of a structured ``edit`` (``kind``, and ``ref``/``color``/``shape``/``rel``/``anchor``)."""
    kind = edit["kind"]
    if kind == "add":
        return f"add a {edit['color']} {edit['shape']} {edit['rel']} the {_ref_text(edit['anchor'])}"
    the = f"the {_ref_text(edit['ref'])}"
    if kind == "recolor":
        return f"make {the} {edit['color']}"
    if kind == "replace":
        return f"turn {the} into a {edit['shape']}"
    if kind == "remove":
        return f"remove {the}"
    return f"move {the} {edit['rel']} the {_ref_text(edit['anchor'])}"


def _distinct(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two references can name different objects of one scene."""
    return a["shape"] != b["shape"] or (a["color"] is not None and b["color"] is not None and a["color"] != b["color"])


def all_edits() -> dict[str, list[dict[str, Any]]]:
    """Every edit of the world per category, in a fixed order (finite: 48 + 30 + 15 + 720 + 744)."""
    refs = _refs()
    return {
        "recolor": [{"kind": "recolor", "ref": r, "color": c} for r in refs for c in COLORS if c != r["color"]],
        "replace": [{"kind": "replace", "ref": r, "shape": s} for r in refs for s in SHAPES if s != r["shape"]],
        "remove": [{"kind": "remove", "ref": r} for r in refs],
        "add": [{"kind": "add", "shape": s, "color": c, "rel": rel, "anchor": a}
                for c in COLORS for s in SHAPES for rel in RELATIONS for a in refs],
        "move": [{"kind": "move", "ref": r, "rel": rel, "anchor": a}
                 for r in refs for rel in RELATIONS for a in refs if _distinct(r, a)],
    }


def edit_splits(test_fraction: float, seed: int) -> tuple[set[str], set[str]]:
    """Train and held-out instruction texts: per category, the ``test_fraction`` with the smallest
    seeded hash (at least one) is held out."""
    train: set[str] = set()
    test: set[str] = set()
    for edits in all_edits().values():
        texts = sorted({instruction_of(e) for e in edits},
                       key=lambda t: hashlib.sha256(f"{seed}:{t}".encode()).digest())
        cut = max(1, round(test_fraction * len(texts)))
        test.update(texts[:cut])
        train.update(texts[cut:])
    return train, test


def resolve(ref: dict[str, Any], objects: list[dict[str, Any]]) -> int | None:
    """The index of the one object ``ref`` names in ``objects``, or None when it names none or several."""
    hits = [i for i, o in enumerate(objects)
            if o["shape"] == ref["shape"] and (ref["color"] is None or o["color"] == ref["color"])]
    return hits[0] if len(hits) == 1 else None


def _boxes(o: dict[str, Any]) -> list[tuple[float, ...]]:
    x0, y0, x1, y1 = object_box(o)
    return [(x0 - d, y0 - d, x1 + d, y1 + d) for d in (-1, 0, 1)]


def holds(a: dict[str, Any], b: dict[str, Any], rel: str) -> bool:
    """``a`` is ``rel`` ``b`` and in no other relation, whatever a pixel of rounding does to the boxes."""
    return all(relations(p, q) == {rel} for p in _boxes(a) for q in _boxes(b))


def _fails(a: dict[str, Any], b: dict[str, Any], rel: str) -> bool:
    return all(rel not in relations(p, q) for p in _boxes(a) for q in _boxes(b))


def _round(o: dict[str, Any]) -> dict[str, Any]:
    return {**o, "cx": round(float(o["cx"]), 2), "cy": round(float(o["cy"]), 2), "r": round(float(o["r"]), 2)}


def _place(obj: dict[str, Any], others: list[dict[str, Any]], anchor: dict[str, Any], rel: str,
           rng: np.random.Generator, resolution: int, away_from: dict[str, Any] | None = None) -> dict | None:
    """``obj`` at a random spot apart from ``others`` where it is ``rel`` ``anchor`` (and, for a move,
    at least ``MIN_MOVE`` from where it was); None when 200 tries find none."""
    r = obj["r"]
    for _ in range(200):
        cx, cy = rng.uniform(r + 1, resolution - r - 1, size=2)
        cand = _round({**obj, "cx": cx, "cy": cy})
        if away_from is not None and math.hypot(cx - away_from["cx"], cy - away_from["cy"]) < MIN_MOVE * resolution:
            continue
        if all(apart(cand, q, resolution) for q in others) and holds(cand, anchor, rel):
            return cand
    return None


def apply_edit(edit: dict[str, Any], objects: list[dict[str, Any]], rng: np.random.Generator,
               resolution: int) -> dict[str, Any] | None:
    """The target scene of ``edit`` on the source ``objects``, or None when the edit does not apply
    (an unnamed object, nothing to change, no room)."""
    objs = [{**o, "edited": False, "moved": False} for o in objects]
    kind, relation = edit["kind"], None
    i = resolve(edit["ref"], objs) if "ref" in edit else None
    j = resolve(edit["anchor"], objs) if "anchor" in edit else None
    if ("ref" in edit and i is None) or ("anchor" in edit and (j is None or j == i)):
        return None
    if kind == "recolor":
        if objs[i]["color"] == edit["color"]:
            return None
        objs[i].update(color=edit["color"], edited=True)
    elif kind == "replace":
        objs[i].update(shape=edit["shape"], edited=True)
    elif kind == "remove":
        if len(objs) < 2:
            return None
        del objs[i]
    elif kind == "add":
        if len(objs) >= MAX_OBJECTS:
            return None
        new = {"shape": edit["shape"], "color": edit["color"], "r": float(rng.uniform(0.11, 0.15) * resolution),
               "edited": True, "moved": True}
        placed = _place(new, objs, objs[j], edit["rel"], rng, resolution)
        if placed is None:
            return None
        objs.append(placed)
        relation = {"a": len(objs) - 1, "b": j, "rel": edit["rel"]}
    else:  # move
        if not _fails(objs[i], objs[j], edit["rel"]):
            return None
        others = [o for k, o in enumerate(objs) if k != i]
        placed = _place(objs[i], others, objs[j], edit["rel"], rng, resolution, away_from=objs[i])
        if placed is None:
            return None
        objs[i] = {**placed, "edited": True, "moved": True}
        relation = {"a": i, "b": j, "rel": edit["rel"]}
    return {"resolution": resolution, "objects": objs, "relation": relation}


def _scene(category: str, rng: np.random.Generator, resolution: int) -> list[dict[str, Any]]:
    low, high = (1, MAX_OBJECTS - 1) if category == "add" else (2, MAX_OBJECTS)  # something always stays as it was
    n = int(rng.integers(low, high + 1))
    objects = [{"shape": str(rng.choice(SHAPES)), "color": str(rng.choice(list(COLORS))), "count": 1} for _ in range(n)]
    return [_round(o) for o in layout({"objects": objects, "relation": None}, rng, resolution)]


def scene_json(scene: dict[str, Any]) -> str:
    return json.dumps(scene, sort_keys=True)


def make_example(category: str, texts: set[str], rng: np.random.Generator, resolution: int = RESOLUTION) -> dict:
    """One row of ``category`` whose instruction is one of ``texts``: a random source scene and a
    random edit that applies to it."""
    edits = [e for e in all_edits()[category] if instruction_of(e) in texts]
    for _ in range(200):
        objects = _scene(category, rng, resolution)
        candidates = [e for e in edits if ("ref" not in e or resolve(e["ref"], objects) is not None)
                      and ("anchor" not in e or resolve(e["anchor"], objects) is not None)]
        for k in rng.permutation(len(candidates)):
            edit = candidates[int(k)]
            target = apply_edit(edit, objects, rng, resolution)
            if target is not None:
                return {"prompt": instruction_of(edit), "image": png_bytes(draw_scene(objects, resolution)),
                        "category": category, "source": scene_json({"resolution": resolution, "objects": objects}),
                        "target": scene_json(target)}
    raise RuntimeError(f"no {category} example found among {len(edits)} instructions")


def edits_of(texts: set[str]) -> list[dict[str, Any]]:
    """The world's edits whose instruction is one of ``texts``, every category in one list."""
    return [e for edits in all_edits().values() for e in edits if instruction_of(e) in texts]


def _strip(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in o.items() if k not in ("edited", "moved")} for o in objects]


def loosen(row: dict, edits: list[dict[str, Any]], rng: np.random.Generator) -> dict:
    """``row`` with one more edit made in its target that its instruction does not name, when one of
    ``edits`` applies to objects the named edit leaves alone and keeps the instruction true (else ``row``
    as it is): a loose instruction, true of the change but not all of it, as a web caption names one
    object of several.

    For pretraining (``pretrain_edit --loose``), which only draws the target: the loosened target's objects
    carry no ``edited``/``moved`` flags and no ``relation``, and its ``extra`` names the unnamed edit."""
    target = json.loads(row["target"])
    objects = target["objects"]
    named = {k for k, o in enumerate(objects) if o["edited"] or o["moved"]}
    if target["relation"]:
        named |= {target["relation"]["a"], target["relation"]["b"]}
    kept = {(o["shape"], o["color"], o["cx"], o["cy"]) for o in objects}
    removed = [(o["shape"], o["color"]) for o in json.loads(row["source"])["objects"]
               if row["category"] == "remove" and (o["shape"], o["color"], o["cx"], o["cy"]) not in kept]
    plain = _strip(objects)
    for k in rng.permutation(len(edits)):
        edit = edits[int(k)]
        if "ref" in edit and resolve(edit["ref"], plain) in named:  # None (unnamed) is refused by apply_edit
            continue
        extra = apply_edit(edit, plain, rng, target["resolution"])
        if extra is None or any((o["shape"], o["color"]) in removed for o in extra["objects"]):
            continue  # a removed object may not come back
        scene = {"resolution": target["resolution"], "objects": _strip(extra["objects"]), "relation": None,
                 "extra": instruction_of(edit)}
        return {**row, "target": scene_json(scene)}
    return row


def edit_rows(num: int, texts: set[str], seed: int, split: int, resolution: int = RESOLUTION) -> list[dict]:
    """``num`` rows, the categories in turn, row i drawn from ``default_rng([seed, split, i])``."""
    return [make_example(CATEGORIES[i % len(CATEGORIES)], texts, np.random.default_rng([seed, split, i]), resolution)
            for i in range(num)]


def edit_count(source: str, default: int) -> int:
    """N of ``builtin:shape-edits:N`` (``default``, ``data.num_prompts``, without one)."""
    from .readers import PromptDataError

    count = source[len(SOURCE):].removeprefix(":")
    if source != SOURCE and (not source.startswith(SOURCE + ":") or not count.isdigit() or int(count) < 1):
        raise PromptDataError(f"data.source={source!r}: write {SOURCE}:N with N >= 1 training rows, or {SOURCE}")
    return int(count) if count else default


def generate_edit_prompts(source: str, num_prompts: int, seed: int, test_fraction: float) -> tuple[list, list]:
    """``data.source=builtin:shape-edits[:N]``: N training rows (``num_prompts`` without N) and the
    held-out rows in the same proportion as ``test_fraction`` (at least one per category)."""
    num = edit_count(source, num_prompts)
    per_category = max(1, math.ceil(num * test_fraction / max(1e-9, 1 - test_fraction) / len(CATEGORIES)))
    train_texts, test_texts = edit_splits(test_fraction, seed)
    return (edit_rows(num, train_texts, seed, 0),
            edit_rows(per_category * len(CATEGORIES), test_texts, seed, 1))
