"""``geneval_mini``: GenEval's object checks on the shapes world (``diffusionrl.data_shapes``).

A detector made of OpenCV image processing instead of GenEval's Mask2Former + CLIP: pixels are
classified by colour in HSV (saturated pixels, hue nearest to one of the world's colours; the white
background has no saturation), each colour's connected components above a minimum area are the
objects (``cv2.connectedComponentsWithStats``), and an object's shape is read from its outer contour
(``cv2.findContours``): the contour's area over its bounding box's (a square fills it, a circle about
pi/4, a triangle about half) together with the vertex count of ``cv2.approxPolyDP``.

Each image is then judged against its prompt's spec (the row's ``spec`` field) as GenEval does:
every asked object is present as often as asked (exactly, for the counting category), with the
asked colour, and the asked relation holds between some pair of them (``data_shapes.relations``,
GenEval's ``relative_position``). ``judge`` gives the per-image ``success`` in {0, 1} and a
partial-credit ``score`` in [0, 1] (the mean over the spec's clauses, each in [0, 1]; 1 exactly
when ``success``), which is the reward. The batch's success rate is logged as ``accuracy`` and the
per-image successes are returned in ``RewardResult.per_sample["success"]`` (the evaluation's
per-category table).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from diffusionrl.data_shapes import COLORS, relations

from .base import Reward, RewardResult, register_reward

_HUES = {"red": 0.0, "yellow": 27.0, "green": 65.0, "blue": 117.0}  # OpenCV hue (0-180) of COLORS
assert set(_HUES) == set(COLORS)
MIN_SATURATION = 90
MIN_VALUE = 60
MIN_AREA_FRACTION = 0.004  # components smaller than this share of the image are noise


@dataclass
class Detection:
    shape: str
    color: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1
    area: int


def _shape_of(mask: np.ndarray) -> str:
    import cv2

    contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    contour = max(contours, key=cv2.contourArea)
    area = float(mask.sum())
    x, y, w, h = cv2.boundingRect(contour)
    extent = area / float(w * h)
    vertices = len(cv2.approxPolyDP(contour, 0.06 * cv2.arcLength(contour, True), True))
    if extent < 0.66 or vertices == 3:
        return "triangle"
    if extent > 0.86 and vertices == 4:
        return "square"
    if extent > 0.9:
        return "square"
    return "circle"


def detect(image: np.ndarray) -> list[Detection]:
    """The coloured objects of a uint8 ``[H, W, 3]`` RGB image."""
    import cv2

    image = np.ascontiguousarray(image, dtype=np.uint8)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] image, got {image.shape}")
    hsv = cv2.cvtColor(image, cv2.COLOR_RGB2HSV)
    hue, sat, val = hsv[..., 0].astype(np.float32), hsv[..., 1], hsv[..., 2]
    names = list(_HUES)
    distance = np.stack([np.minimum(np.abs(hue - h), 180 - np.abs(hue - h)) for h in _HUES.values()])
    label = distance.argmin(0)
    foreground = (sat >= MIN_SATURATION) & (val >= MIN_VALUE)
    min_area = MIN_AREA_FRACTION * image.shape[0] * image.shape[1]
    found = []
    for k, name in enumerate(names):
        mask = (foreground & (label == k)).astype(np.uint8)
        mask = cv2.morphologyEx(mask, cv2.MORPH_OPEN, np.ones((2, 2), np.uint8))
        count, components, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
        for c in range(1, count):
            x, y, w, h, area = (int(v) for v in stats[c])
            if area < min_area:
                continue
            shape = _shape_of((components == c).astype(np.uint8))
            found.append(Detection(shape, name, (x, y, x + w, y + h), area))
    return found


def parse_spec(meta: dict) -> dict:
    spec = meta.get("spec")
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, dict) or "objects" not in spec:
        raise ValueError("no shapes-world 'spec' in the prompt's metadata")
    return spec


def judge(image: np.ndarray, spec: dict, detections: list[Detection] | None = None) -> tuple[bool, float]:
    """``(success, score)`` of ``image`` against ``spec`` (see the module docstring)."""
    found = detect(image) if detections is None else detections
    exact = spec["category"] == "counting"
    clauses: list[float] = []
    matches: list[list[Detection]] = []  # per asked object: the detections that may be it
    for o in spec["objects"]:
        same_shape = [d for d in found if d.shape == o["shape"]]
        n = len(same_shape)
        clauses.append(min(n, o["count"]) / o["count"])
        if exact:
            clauses.append(1.0 if n == o["count"] else max(0.0, 1 - abs(n - o["count"]) / o["count"]) * 0.5)
        if o["color"]:
            right = [d for d in same_shape if d.color == o["color"]]
            clauses.append(min(len(right), o["count"]) / o["count"])
            same_shape = right
        matches.append(same_shape)
    rel = spec.get("relation")
    if rel:
        ok = any(rel["rel"] in relations(a.box, b.box) for a in matches[rel["a"]] for b in matches[rel["b"]]
                 if a is not b)
        clauses.append(1.0 if ok else 0.0)
    score = float(np.mean(clauses))
    return score >= 1.0 - 1e-9, score


@register_reward("geneval_mini")
class GenEvalMini(Reward):
    """Partial-credit score of each image against its prompt's shapes-world spec (success: all of it)."""

    name = "geneval_mini"

    def __init__(self, reward_cfg=None):
        pass

    @classmethod
    def validate_prompts(cls, prompts: Sequence[str], metadata: Sequence[dict] | None = None,
                         source: str = "prompts", locations: Sequence[str] | None = None) -> None:
        for i, meta in enumerate(metadata or [{}] * len(prompts)):
            try:
                parse_spec(meta or {})
            except (ValueError, TypeError) as exc:
                where = locations[i] if locations else f"{source} row {i + 1}"
                raise ValueError(f"{where}: the geneval_mini reward needs shapes-world prompts "
                                 f"(data.source=builtin:shapes): {exc} ({prompts[i][:60]!r})") from exc

    def __call__(self, images, prompts, metadata) -> RewardResult:
        scores = np.zeros(len(prompts), np.float32)
        success = np.zeros(len(prompts), np.float32)
        failures = 0
        for i, (image, meta) in enumerate(zip(images, metadata)):
            try:
                ok, scores[i] = judge(image, parse_spec(meta))
                success[i] = float(ok)
            except Exception:  # a sample that cannot be judged scores 0 and is counted
                failures += 1
        accuracy = float(success.mean()) if len(success) else 0.0
        return RewardResult(scores, failures, {"accuracy": accuracy}, per_sample={"success": success})
