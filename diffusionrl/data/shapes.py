"""A synthetic compositional world: prompts about simple scenes and the scenes drawn in code (PIL).

GenEval in miniature (``builtin:shapes`` prompts, the ``geneval_mini`` reward, ``builtin:tiny-sd3-shapes``):
1 to 4 objects, each a circle, square or triangle in red, green, blue or yellow, on a plain white
background. Every prompt comes from a structured *spec* of one of GenEval's six categories:

========== ======================================= ===========================================
category   example                                 what must hold
========== ======================================= ===========================================
single     ``a triangle``                          at least one triangle
two        ``a circle and a square``               at least one of each
counting   ``three squares``                       exactly three squares
colors     ``a blue circle``                       a circle, and it is blue
position   ``a circle left of a triangle``         a circle and a triangle, the relation holds
color_attr ``a red square and a green triangle``   a red square and a green triangle
========== ======================================= ===========================================

A spec is ``{"category", "objects": [{"shape", "color" (or None), "count"}], "relation": None |
{"a": i, "b": j, "rel": "left of" | "right of" | "above" | "below"}}``; prompt rows carry it as JSON
text in their ``spec`` field (and the category in ``category``), which the reward reads.
``relation`` is GenEval's ``relative_position`` (box centres, offsets shrunk by 0.1 of the boxes'
sizes, a relation holds when its direction has more than half of the normalised offset).

``shape_prompts`` lists every prompt of the world (the set is finite: 126 prompts); ``world_splits``
splits them per category by a seeded hash of the text (so train and held-out share no prompt and
every category is held out); ``render(spec, rng, resolution)`` draws a scene the spec describes,
with non-overlapping objects.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import numpy as np

SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
BACKGROUND = (255, 255, 255)
RELATIONS = ("left of", "right of", "above", "below")
CATEGORIES = ("single", "two", "counting", "colors", "position", "color_attr")
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}
POSITION_THRESHOLD = 0.1  # GenEval's
# The split builtin:tiny-sd3-shapes was pretrained on (its held-out prompts never drawn): the
# tiny-cpu-shapes preset's data.test_fraction and data.seed.
DEFAULT_TEST_FRACTION = 0.2
DEFAULT_SPLIT_SEED = 0


def _obj(shape: str, color: str | None = None, count: int = 1) -> dict[str, Any]:
    return {"shape": shape, "color": color, "count": count}


def all_specs() -> list[dict[str, Any]]:
    """Every spec of the world, in a fixed order."""
    specs: list[dict[str, Any]] = []

    def add(category, objects, relation=None):
        specs.append({"category": category, "objects": objects, "relation": relation})

    for s in SHAPES:
        add("single", [_obj(s)])
    for a, b in itertools.permutations(SHAPES, 2):
        add("two", [_obj(a), _obj(b)])
    for s in SHAPES:
        for n in (2, 3, 4):
            add("counting", [_obj(s, count=n)])
    for c in COLORS:
        for s in SHAPES:
            add("colors", [_obj(s, c)])
    for a, b in itertools.permutations(SHAPES, 2):
        for rel in RELATIONS:
            add("position", [_obj(a), _obj(b)], {"a": 0, "b": 1, "rel": rel})
    for a, b in itertools.permutations(SHAPES, 2):
        for ca, cb in itertools.permutations(COLORS, 2):
            add("color_attr", [_obj(a, ca), _obj(b, cb)])
    return specs


def _noun(o: dict[str, Any]) -> str:
    if o["count"] > 1:
        return f"{NUMBERS[o['count']]} {PLURAL[o['shape']]}"
    return f"a {o['color'] + ' ' if o['color'] else ''}{o['shape']}"


def prompt_of(spec: dict[str, Any]) -> str:
    """The prompt text of ``spec`` (GenEval's templates without "a photo of")."""
    nouns = [_noun(o) for o in spec["objects"]]
    if spec["relation"]:
        return f"{nouns[0]} {spec['relation']['rel']} {nouns[1]}"
    return " and ".join(nouns)


def shape_prompts() -> list[dict[str, Any]]:
    """Every prompt row of the world: ``{"prompt", "category", "spec" (JSON text)}``."""
    return [{"prompt": prompt_of(s), "category": s["category"], "spec": json.dumps(s, sort_keys=True)}
            for s in all_specs()]


def world_splits(test_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows: per category, the ``test_fraction`` of prompts with the smallest
    seeded hash (at least one) is held out. The splits share no prompt."""
    train: list[dict] = []
    test: list[dict] = []
    rows = shape_prompts()
    for category in CATEGORIES:
        group = sorted((r for r in rows if r["category"] == category),
                       key=lambda r: hashlib.sha256(f"{seed}:{r['prompt']}".encode()).digest())
        cut = max(1, round(test_fraction * len(group)))
        test += group[:cut]
        train += group[cut:]
    return train, test


def generate_shape_prompts(num_prompts: int, seed: int, test_fraction: float) -> tuple[list[dict], list[dict]]:
    """``data.source=builtin:shapes``: the world's split; ``num_prompts`` caps the training rows
    (the held-out rows stay whole so that every category is evaluated)."""
    train, test = world_splits(test_fraction, seed)
    return train[: max(1, num_prompts)], test


# -- drawing -----------------------------------------------------------------------------------------


def relations(box_a: tuple[float, ...], box_b: tuple[float, ...]) -> set[str]:
    """GenEval's relative position of box A to box B (boxes ``(x0, y0, x1, y1)``, y down)."""
    a, b = np.asarray(box_a, float).reshape(2, 2), np.asarray(box_b, float).reshape(2, 2)
    offset = a.mean(0) - b.mean(0)
    dims = np.abs(np.diff(a, axis=0))[0] + np.abs(np.diff(b, axis=0))[0]
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def _box(cx: float, cy: float, r: float) -> tuple[float, float, float, float]:
    return (cx - r, cy - r, cx + r, cy + r)


def object_box(o: dict[str, Any]) -> tuple[float, float, float, float]:
    """The box ``(x0, y0, x1, y1)`` of object ``o`` as ``draw_scene`` draws it (what a detector finds)."""
    cx, cy, r = o["cx"], o["cy"], o["r"]
    if o["shape"] == "square":
        return _box(cx, cy, r * 0.85)
    if o["shape"] == "triangle":
        return (cx - r, cy - r, cx + r, cy + r * 0.8)
    return _box(cx, cy, r)


def _draw(draw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse(_box(cx, cy, r), fill=fill)
    elif shape == "square":
        h = r * 0.85
        draw.rectangle(_box(cx, cy, h), fill=fill)
    else:  # an upright triangle filling the box
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)


def apart(p: dict[str, Any], q: dict[str, Any], resolution: int) -> bool:
    """Whether objects ``p`` and ``q`` are as far apart as ``layout`` places them (a gap of 6 %)."""
    return bool(np.hypot(p["cx"] - q["cx"], p["cy"] - q["cy"]) > p["r"] + q["r"] + 0.06 * resolution)


def layout(spec: dict[str, Any], rng: np.random.Generator, resolution: int) -> list[dict[str, Any]]:
    """Objects ``{"shape", "color", "cx", "cy", "r"}`` for ``spec``: the asked shapes, colours and
    counts (a colour the spec leaves open is drawn at random), apart from each other and from the
    border, the spec's relation holding between its first objects."""
    items = []
    for index, o in enumerate(spec["objects"]):
        for _ in range(o["count"]):
            color = o["color"] or str(rng.choice(list(COLORS)))
            items.append({"shape": o["shape"], "color": color, "index": index})
    rel = spec["relation"]
    for _attempt in range(1000):
        placed = []
        for it in items:
            r = rng.uniform(0.11, 0.15) * resolution
            cx, cy = rng.uniform(r + 1, resolution - r - 1, size=2)
            placed.append({**it, "cx": float(cx), "cy": float(cy), "r": float(r)})
        if not all(apart(p, q, resolution) for p, q in itertools.combinations(placed, 2)):
            continue
        if rel:
            a = next(p for p in placed if p["index"] == rel["a"])
            b = next(p for p in placed if p["index"] == rel["b"])
            if relations(_box(a["cx"], a["cy"], a["r"]), _box(b["cx"], b["cy"], b["r"])) != {rel["rel"]}:
                continue
        return [{k: p[k] for k in ("shape", "color", "cx", "cy", "r")} for p in placed]
    raise RuntimeError(f"no layout found for {prompt_of(spec)!r} at {resolution} px")


def draw_scene(objects: list[dict[str, Any]], resolution: int) -> np.ndarray:
    """uint8 ``[resolution, resolution, 3]``: the objects on the white background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (resolution, resolution), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for o in objects:
        _draw(draw, o["shape"], o["cx"], o["cy"], o["r"], COLORS[o["color"]])
    return np.asarray(image, dtype=np.uint8)


def render(spec: dict[str, Any], rng: np.random.Generator, resolution: int = 64) -> np.ndarray:
    """A scene ``spec`` describes (uint8 ``[resolution, resolution, 3]``)."""
    return draw_scene(layout(spec, rng, resolution), resolution)


def scene_pairs(rows: list[dict[str, Any]], num: int, resolution: int, seed: int = 0) -> list[dict[str, Any]]:
    """``num`` (prompt, image) pairs: rows drawn in turn (a seeded permutation per pass), each drawn
    afresh; ``{"prompt", "image", "spec"}``."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < num:
        for i in rng.permutation(len(rows))[: num - len(out)]:
            row = rows[int(i)]
            out.append({"prompt": row["prompt"], "spec": row["spec"],
                        "image": render(json.loads(row["spec"]), rng, resolution)})
    return out


# -- the world as the web shows it: scenes of every kind, loosely captioned ---------------------------
# What a text-to-image base model is pretrained on (``python -m diffusionrl.models.pretrain``, its
# default ``--world web``): scenes of any of the world's specs, held-out ones included, often with
# extra objects, each captioned by a prompt of the world that is *true* of it but often partial. A
# caption never states a false thing: a noun phrase ``a [colour] shape`` holds when the scene has at
# least one such object, ``N shapes`` when it has exactly N of that shape, a relation when some pair of
# the named objects stands in it (GenEval's rule, on the boxes the judge sees). Loose captions make
# p(scene | caption) broad ("a red circle" comes with other objects), so sampling without guidance
# draws extra objects that the strict judge refuses, and classifier-free guidance (the empty caption is
# a share of the data) pushes toward scenes whose likeliest caption is the prompt: what is asked.

WEB_DISTRACTORS = (0.4, 0.35, 0.25)  # P(0, 1, 2 extra objects) beside a spec's own (at most 4 in all)
WEB_OWN_CAPTION = 0.5  # share of scenes captioned by their own spec's prompt (when still true of them)


def _matches(o: dict[str, Any], drawn: dict[str, Any]) -> bool:
    return drawn["shape"] == o["shape"] and o["color"] in (None, drawn["color"])


def caption_holds(spec: dict[str, Any], objects: list[dict[str, Any]]) -> bool:
    """Whether ``spec``'s prompt is a true (possibly partial) caption of the drawn ``objects``."""
    for o in spec["objects"]:
        found = sum(_matches(o, d) for d in objects)
        if (o["count"] > 1 and found != o["count"]) or found < 1:
            return False
    rel = spec.get("relation")
    if not rel:
        return True
    a = [object_box(d) for d in objects if _matches(spec["objects"][rel["a"]], d)]
    b = [object_box(d) for d in objects if _matches(spec["objects"][rel["b"]], d)]
    return any(rel["rel"] in relations(p, q) for p in a for q in b)


def web_scene(spec: dict[str, Any], rng: np.random.Generator, resolution: int = 64,
              distractors: tuple[float, ...] = WEB_DISTRACTORS) -> list[dict[str, Any]]:
    """The objects of a scene of ``spec`` with 0-2 extra objects of any shape and colour (their number
    drawn from ``distractors``, at most 4 objects in all), laid out as ``layout`` does."""
    asked = sum(o["count"] for o in spec["objects"])
    extra = min(int(rng.choice(len(distractors), p=distractors)), 4 - asked)
    objects = [*spec["objects"], *(_obj(str(rng.choice(SHAPES)), str(rng.choice(list(COLORS))))
                                   for _ in range(extra))]
    while True:  # a relation among four objects may find no layout: then one extra object fewer
        try:
            return layout({**spec, "objects": objects}, rng, resolution)
        except RuntimeError:
            if len(objects) == len(spec["objects"]):
                raise
            objects = objects[:-1]


def true_captions(objects: list[dict[str, Any]], specs: list[dict[str, Any]]) -> list[int]:
    """Indices of the ``specs`` whose prompt is a true caption of ``objects``."""
    return [i for i, s in enumerate(specs) if caption_holds(s, objects)]


def web_scenes(num: int, resolution: int, seed: int = 0, distractors: tuple[float, ...] = WEB_DISTRACTORS
               ) -> list[dict[str, Any]]:
    """``num`` scenes of the whole world: ``{"image", "objects", "own" (index of the spec drawn, into
    ``all_specs()``), "captions" (indices of every true caption)}``; each spec drawn uniformly."""
    rng = np.random.default_rng(seed)
    specs = all_specs()
    out = []
    for _ in range(num):
        own = int(rng.integers(len(specs)))
        objects = web_scene(specs[own], rng, resolution, distractors)
        out.append({"image": draw_scene(objects, resolution), "objects": objects, "own": own,
                    "captions": true_captions(objects, specs)})
    return out


def web_caption(scene: dict[str, Any], rng: np.random.Generator, own_share: float = WEB_OWN_CAPTION) -> int:
    """A caption of ``scene`` (an index into ``all_specs()``): its own spec's with probability
    ``own_share`` when that is still true of it, else any of its true captions, uniformly."""
    captions = scene["captions"]
    if scene["own"] in captions and rng.random() < own_share:
        return scene["own"]
    return int(captions[int(rng.integers(len(captions)))])
