"""``geneval_mini``: a strict GenEval judge of the shapes world (``diffusionrl.data.shapes``).

A detector made of OpenCV image processing instead of GenEval's Mask2Former + CLIP. Pixels are
classified by colour in HSV: saturated pixels whose hue is near one of the world's four colours
belong to that colour; saturated pixels near none of them are *off-colour*. Each colour's connected
components above a minimum area are the objects (``cv2.connectedComponentsWithStats``); each
off-colour component is a shapeless object. An object's shape is the ideal shape that overlaps its
mask best (IoU with an upright square, a circle and an upright triangle fitted to its bounding box,
the shapes the world draws); when none overlaps by at least ``MIN_SHAPE_IOU``, or its box is far
from square, it is a *blob*: no shape at all.

Each image is then judged strictly against its prompt's spec (the row's ``spec`` field):
``success`` when the image holds **exactly** the asked objects -- every asked shape as often as
asked, in the asked colour where one is asked, no other object, no blob -- and the asked relation
(GenEval's ``relative_position``, ``data.shapes.relations``) holds between the matched objects.
The partial-credit ``score`` in [0, 1] is what the reward returns: asked objects and detections are
matched one to one (``scipy.optimize.linear_sum_assignment``; a match is worth 1 when shape and
colour are right, 1/2 when the shape is right and an asked colour is not), and

    score = matched / (asked + detected - matched)       (a Jaccard index over objects)

halved when an asked relation does not hold between the matched objects. Every extra object, blob
or off-colour smudge enlarges the denominator, so a sheet of blobs scores about 0 whatever the
prompt, an empty picture scores 0, and a fixed picture scores 1 only on the prompts it happens to
satisfy exactly. ``score == 1`` exactly when ``success``. The batch's success rate is logged as
``accuracy``; per image, ``RewardResult.per_sample`` carries ``success`` (the evaluation's
per-category table), ``objects`` (detections per image) and ``blobs`` (shapeless ones among them).

``geneval_mini_rules`` judges the same detections by GenEval's own rules (its ``evaluate_images.py``),
which ask less: for each asked object, at least ``count`` detections of its shape; the ``count`` most
confident of them (here: the largest) all in the asked colour, where one is asked; no more than
``count`` of that shape when a number is asked (a counting prompt); and the asked relation between
the most confident detections of the two objects. Other objects, blobs and off-colour smudges are not
looked at (GenEval's detector would not name them). Its ``score`` is the share of those checks that
pass (a check that needs an absent object fails), the per-clause partial credit the papers train on;
``success`` is all of them. A picture crowded with every shape in every colour therefore passes more
of these than of ``geneval_mini``'s: train on one, and judge with both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from diffusionrl.data.shapes import COLORS, relations

from .base import Reward, RewardResult, register_reward

_HUES = {"red": 0.0, "yellow": 27.0, "green": 65.0, "blue": 117.0}  # OpenCV hue (0-180) of COLORS
assert set(_HUES) == set(COLORS)
MIN_SATURATION = 90
MIN_VALUE = 60
MAX_HUE_DISTANCE = 14.0  # farther than this from every world colour: an off-colour pixel
MIN_AREA_FRACTION = 0.004  # components smaller than this share of the image are noise
MIN_SHAPE_IOU = 0.72  # a component overlapping no ideal shape this well is a blob
MAX_ASPECT = 1.45  # the world's shapes have near-square boxes (a triangle's is 1 : 0.9)
BLOB = "blob"
OFF_COLOUR = "other"


@dataclass
class Detection:
    shape: str  # circle, square, triangle or "blob"
    color: str  # one of COLORS, or "other"
    box: tuple[int, int, int, int]  # x0, y0, x1, y1
    area: int


def _templates(w: int, h: int) -> dict[str, np.ndarray]:
    """Ideal masks of the world's shapes filling a ``w x h`` box (as ``data.shapes._draw`` draws them)."""
    import cv2

    y, x = np.mgrid[0:h, 0:w]
    circle = (((x - (w - 1) / 2) / (w / 2)) ** 2 + ((y - (h - 1) / 2) / (h / 2)) ** 2 <= 1).astype(np.uint8)
    triangle = np.zeros((h, w), np.uint8)
    pts = np.array([[(w - 1) / 2, 0], [w - 1, h - 1], [0, h - 1]], np.float32)
    cv2.fillPoly(triangle, [np.round(pts).astype(np.int32)], 1)
    return {"square": np.ones((h, w), np.uint8), "circle": circle, "triangle": triangle}


def shape_fit(mask: np.ndarray) -> tuple[str, float]:
    """(best ideal shape, its IoU with ``mask``): the mask cropped to its box against each template."""
    ys, xs = np.nonzero(mask)
    crop = mask[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1].astype(bool)
    h, w = crop.shape
    best, best_iou = BLOB, 0.0
    for name, template in _templates(w, h).items():
        t = template.astype(bool)
        iou = float((crop & t).sum()) / float((crop | t).sum())
        if iou > best_iou:
            best, best_iou = name, iou
    return best, best_iou


def _shape_of(mask: np.ndarray) -> str:
    ys, xs = np.nonzero(mask)
    h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    if max(h, w) > MAX_ASPECT * min(h, w):
        return BLOB
    shape, iou = shape_fit(mask)
    return shape if iou >= MIN_SHAPE_IOU else BLOB


def detect(image: np.ndarray) -> list[Detection]:
    """The coloured objects of a uint8 ``[H, W, 3]`` RGB image (off-colour ones are blobs)."""
    import cv2

    image = np.ascontiguousarray(image, dtype=np.uint8)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] image, got {image.shape}")
    hsv = cv2.cvtColor(image, cv2.COLOR_RGB2HSV)
    hue, sat, val = hsv[..., 0].astype(np.float32), hsv[..., 1], hsv[..., 2]
    distance = np.stack([np.minimum(np.abs(hue - h), 180 - np.abs(hue - h)) for h in _HUES.values()])
    label = np.where(distance.min(0) <= MAX_HUE_DISTANCE, distance.argmin(0), len(_HUES))
    foreground = (sat >= MIN_SATURATION) & (val >= MIN_VALUE)
    min_area = MIN_AREA_FRACTION * image.shape[0] * image.shape[1]
    found = []
    for k, name in enumerate([*_HUES, OFF_COLOUR]):
        mask = (foreground & (label == k)).astype(np.uint8)
        mask = cv2.morphologyEx(mask, cv2.MORPH_OPEN, np.ones((2, 2), np.uint8))
        count, components, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
        for c in range(1, count):
            x, y, w, h, area = (int(v) for v in stats[c])
            if area < min_area:
                continue
            shape = BLOB if name == OFF_COLOUR else _shape_of((components == c).astype(np.uint8))
            found.append(Detection(shape, name, (x, y, x + w, y + h), area))
    return found


def parse_spec(meta: dict) -> dict:
    spec = meta.get("spec")
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, dict) or "objects" not in spec:
        raise ValueError("no shapes-world 'spec' in the prompt's metadata")
    return spec


def _worth(asked: dict, found: Detection) -> float:
    if found.shape != asked["shape"]:
        return 0.0
    return 1.0 if asked["color"] in (None, found.color) else 0.5


def match(spec: dict, found: list[Detection]) -> tuple[float, list[tuple[int, Detection]]]:
    """The best one-to-one matching of the asked objects (each ``count`` times) to ``found``:
    (its worth, the matched pairs ``(asked object index, detection)`` of worth > 0)."""
    from scipy.optimize import linear_sum_assignment

    asked = [i for i, o in enumerate(spec["objects"]) for _ in range(o["count"])]
    if not asked or not found:
        return 0.0, []
    worth = np.array([[_worth(spec["objects"][i], d) for d in found] for i in asked])
    rows, cols = linear_sum_assignment(worth, maximize=True)
    pairs = [(asked[r], found[c]) for r, c in zip(rows, cols) if worth[r, c] > 0]
    return float(worth[rows, cols].sum()), pairs


def judge(image: np.ndarray, spec: dict, detections: list[Detection] | None = None) -> tuple[bool, float]:
    """``(success, score)`` of ``image`` against ``spec`` (see the module docstring)."""
    found = detect(image) if detections is None else detections
    n_asked = sum(o["count"] for o in spec["objects"])
    matched, pairs = match(spec, found)
    score = matched / (n_asked + len(found) - matched) if n_asked + len(found) else 0.0
    rel = spec.get("relation")
    if rel:
        a = [d for i, d in pairs if i == rel["a"]]
        b = [d for i, d in pairs if i == rel["b"]]
        if not any(rel["rel"] in relations(p.box, q.box) for p in a for q in b):
            score *= 0.5
    return score >= 1.0 - 1e-9, float(score)


def geneval_checks(spec: dict, found: list[Detection]) -> tuple[int, int]:
    """``(passed, checks)`` of GenEval's rules for ``spec`` on ``found`` (see the module docstring)."""
    named = sorted((d for d in found if d.shape != BLOB and d.color != OFF_COLOUR), key=lambda d: -d.area)
    passed = checks = 0
    top: list[list[Detection]] = []
    for o in spec["objects"]:
        same = [d for d in named if d.shape == o["shape"]]
        present = len(same) >= o["count"]
        top.append(same[: o["count"]] if present else [])
        passed, checks = passed + present, checks + 1
        if o["color"]:
            passed += present and all(d.color == o["color"] for d in top[-1])
            checks += 1
        if o["count"] > 1:
            passed += present and len(same) == o["count"]
            checks += 1
    rel = spec.get("relation")
    if rel:
        a, b = top[rel["a"]], top[rel["b"]]
        passed += bool(a and b and all(rel["rel"] in relations(p.box, q.box) for p in a for q in b))
        checks += 1
    return int(passed), checks


class SceneJudge(Reward):
    """A strict judge of shapes-world pictures, the frame that ``geneval_mini`` and ``shape_edit`` share:
    each image is read by ``detect`` and judged against its row's metadata (``parse``) by ``judge_one``
    -> ``(success, score, extra per-sample values)``; a sample that cannot be judged scores 0 and is
    counted. ``per_sample`` carries ``success``, ``objects``, ``blobs`` and the subclass's ``extra``
    columns; ``info`` the batch's ``accuracy``, ``objects_per_image``, ``blobs_per_image`` and
    ``<extra>_rate``. ``rows`` names the rows it needs, for the data error of ``validate_prompts``."""

    rows = ""
    extra: tuple[str, ...] = ()

    def __init__(self, reward_cfg=None):
        pass

    @classmethod
    def parse(cls, meta: dict):
        raise NotImplementedError

    def judge_one(self, image: np.ndarray, parsed, found: list[Detection]) -> tuple[bool, float, dict[str, float]]:
        raise NotImplementedError

    @classmethod
    def validate_prompts(cls, prompts: Sequence[str], metadata: Sequence[dict] | None = None,
                         source: str = "prompts", locations: Sequence[str] | None = None) -> None:
        bad = []  # every bad row in one error (the first 20), not one per run
        for i, meta in enumerate(metadata or [{}] * len(prompts)):
            try:
                cls.parse(meta or {})
            except (ValueError, TypeError) as exc:
                where = locations[i] if locations else f"{source} row {i + 1}"
                bad.append((where, f"{exc} ({prompts[i][:60]!r})"))
        if len(bad) == 1:
            raise ValueError(f"{bad[0][0]}: the {cls.name} reward needs {cls.rows}: {bad[0][1]}")
        if bad:
            more = f"; and {len(bad) - 20} more" if len(bad) > 20 else ""
            listed = "; ".join(f"{where}: {why}" for where, why in bad[:20])
            raise ValueError(f"{source}: {len(bad)} rows are not what the {cls.name} reward needs ({cls.rows}): "
                             f"{listed}{more}")

    def __call__(self, images, prompts, metadata) -> RewardResult:
        n = len(prompts)
        scores = np.zeros(n, np.float32)
        columns = {k: np.zeros(n, np.float32) for k in ("success", "objects", "blobs", *self.extra)}
        failures = 0
        for i, (image, meta) in enumerate(zip(images, metadata)):
            try:
                found = detect(image)
                ok, scores[i], more = self.judge_one(np.asarray(image), self.parse(meta), found)
                columns["success"][i], columns["objects"][i] = float(ok), len(found)
                columns["blobs"][i] = sum(d.shape == BLOB for d in found)
                for k in self.extra:
                    columns[k][i] = float(more[k])
            except Exception:  # a sample that cannot be judged scores 0 and is counted
                failures += 1
        mean = {k: float(v.mean()) if n else 0.0 for k, v in columns.items()}
        info = {"accuracy": mean["success"], "objects_per_image": mean["objects"], "blobs_per_image": mean["blobs"],
                **{f"{k}_rate": mean[k] for k in self.extra}}
        return RewardResult(scores, failures, info, per_sample=columns)


@register_reward("geneval_mini")
class GenEvalMini(SceneJudge):
    """Strict partial-credit score of each image against its prompt's shapes-world spec."""

    name = "geneval_mini"
    rows = "shapes-world prompts (data.source=builtin:shapes)"

    @classmethod
    def parse(cls, meta: dict) -> dict:
        return parse_spec(meta)

    def judge_one(self, image, spec, found):
        ok, score = judge(image, spec, found)
        return ok, score, {}


@register_reward("geneval_mini_rules")
class GenEvalMiniRules(GenEvalMini):
    """GenEval's own rules on the same detections: the share of its checks that pass (module docstring)."""

    name = "geneval_mini_rules"

    def judge_one(self, image, spec, found):
        passed, checks = geneval_checks(spec, found)
        return passed == checks, passed / checks, {}
