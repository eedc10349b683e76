"""``shape_edit``: a strict judge of image edits in the shapes world (``diffusionrl.data.shape_edits``).

The edited image is read by ``geneval_mini``'s OpenCV detector (``detect``: objects with shape,
colour and box; shapeless and off-colour components are blobs) and compared with the row's expected
``target`` scene. Target objects and detections are matched one to one
(``scipy.optimize.linear_sum_assignment``); a pair is worth 0 when the shapes differ, else
1, halved when the colour is wrong and halved again when an object the edit does not move is out of
place (its box centre more than ``PLACE_TOLERANCE`` of the image from the expected one, or its width
or height off by more than a factor ``SIZE_TOLERANCE``). An object the edit places (added or moved)
is judged by the target's relation instead (GenEval's ``relative_position`` to the object it is
placed against, as matched): its worth is halved when the relation does not hold. Then

    score = matched / (expected + detected - matched)       (a Jaccard index over objects)

so every missing, extra, wrong or displaced object and every blob or smudge costs credit, an empty
picture scores 0, and ``success`` (``score == 1``) means exactly the target: the edit made and the
rest of the scene unchanged. The unedited source image scores below 1 for every edit (the recoloured,
replaced, removed, added or moved object is wrong, missing, extra or in the wrong relation). Boxes
are compared in the target's coordinates scaled to the image, so an edit at another resolution is
judged the same. ``RewardResult.per_sample`` carries ``success``, ``unchanged`` (1 when every object
the edit leaves alone is found right and in place), ``made`` (1 when the edit itself is made: the edited
object found at full worth, or for a removal no object of the removed one's shape and colour found),
``objects`` and ``blobs``; ``info`` the batch's ``accuracy``.

``shape_edit_gated`` scores the same partial credit only where the edit is made and every object it
leaves alone is found right and in place (``made`` and ``unchanged``), else 0; what credit is left to
earn there is for extra objects and smudges. Two ways to raise ``shape_edit`` without doing the task
are closed: an unedited copy of the input keeps the credit of every object it leaves alone (0.63 on
average, above most wrong edits), so a policy gains by editing less; and where only the edit is required
(``made * score``), recolouring every object as well as the named one still earns about half. Under the
gate a copy and an over-edit score 0. (Subtracting the copy's score would change nothing: it is one
number per row, and group-normalised advantages do not see a per-row shift.) This is VIEScore's
semantic consistency, min(instruction followed, nothing over-edited), with both judged as done or not.
"""

from __future__ import annotations

import json

import numpy as np

from diffusionrl.data.shapes import object_box, relations

from .base import register_reward
from .geneval_mini import Detection, SceneJudge, detect

PLACE_TOLERANCE = 0.08  # of the image side: how far an unmoved object's box centre may drift
SIZE_TOLERANCE = 1.35  # how much an unmoved object's box width or height may grow or shrink


def parse_scene(meta: dict, key: str) -> dict:
    """The ``source`` or ``target`` scene of a row's metadata (JSON text or a dict)."""
    scene = meta.get(key)
    if isinstance(scene, str):
        scene = json.loads(scene)
    if not isinstance(scene, dict) or not isinstance(scene.get("objects"), list) or not scene.get("resolution"):
        raise ValueError(f"no shape-edit {key!r} scene in the row's metadata")
    return scene


def _in_place(expected: tuple[float, ...], found: tuple[int, ...], side: int) -> bool:
    e, f = np.asarray(expected, float).reshape(2, 2), np.asarray(found, float).reshape(2, 2)
    drift = np.abs(e.mean(0) - f.mean(0)).max()
    ratio = np.diff(f, axis=0)[0] / np.maximum(np.diff(e, axis=0)[0], 1.0)
    return bool(drift <= PLACE_TOLERANCE * side and np.all(ratio <= SIZE_TOLERANCE)
                and np.all(ratio >= 1 / SIZE_TOLERANCE))


def _worth(obj: dict, box: tuple[float, ...], found: Detection, side: int) -> float:
    if found.shape != obj["shape"]:
        return 0.0
    worth = 1.0 if found.color == obj["color"] else 0.5
    if not obj.get("moved") and not _in_place(box, found.box, side):
        worth *= 0.5
    return worth


def judge_edit(image: np.ndarray, target: dict, detections: list[Detection] | None = None) -> tuple[bool, float, bool]:
    """``(success, score, unchanged)`` of the edited ``image`` against the ``target`` scene (see the
    module docstring)."""
    return judge_edit_made(image, target, detections)[:3]


def judge_edit_made(image: np.ndarray, target: dict, detections: list[Detection] | None = None,
                    source: dict | None = None) -> tuple[bool, float, bool, bool]:
    """``judge_edit``'s values and ``made``: whether the edit itself is made (the target's edited object
    matched at full worth; for a removal, which leaves no edited object, no object found with the shape and
    colour of the ``source`` object the target lacks, wherever it is; without ``source`` a removal is made
    when the picture is a success)."""
    from scipy.optimize import linear_sum_assignment

    found = detect(image) if detections is None else detections
    expected = target["objects"]
    scale = image.shape[1] / target["resolution"], image.shape[0] / target["resolution"]
    boxes = [(x0 * scale[0], y0 * scale[1], x1 * scale[0], y1 * scale[1])
             for x0, y0, x1, y1 in (object_box(o) for o in expected)]
    side = max(image.shape[0], image.shape[1])
    got = np.zeros(len(expected))
    match: dict[int, Detection] = {}
    if expected and found:
        worth = np.array([[_worth(o, b, d, side) for d in found] for o, b in zip(expected, boxes)])
        rows, cols = linear_sum_assignment(worth, maximize=True)
        for r, c in zip(rows, cols):
            if worth[r, c] > 0:
                got[r], match[int(r)] = worth[r, c], found[c]
    rel = target.get("relation")
    if rel and rel["a"] in match:
        anchor = match.get(rel["b"])
        if anchor is None or rel["rel"] not in relations(match[rel["a"]].box, anchor.box):
            got[rel["a"]] *= 0.5
    matched = float(got.sum())
    total = len(expected) + len(found) - matched
    score = matched / total if total > 0 else 0.0
    unchanged = all(got[k] == 1.0 for k, o in enumerate(expected) if not o.get("edited"))
    success = score >= 1.0 - 1e-9
    edited = [k for k, o in enumerate(expected) if o.get("edited")]
    if edited:
        made = all(got[k] == 1.0 for k in edited)
    elif source is not None:
        kept = {(o["shape"], o["color"], o["cx"], o["cy"]) for o in expected}
        gone = [o for o in source["objects"] if (o["shape"], o["color"], o["cx"], o["cy"]) not in kept]
        # the instruction named it uniquely, so no object the target keeps has its shape and colour
        made = not any(d.shape == o["shape"] and d.color == o["color"] for o in gone for d in found)
    else:
        made = success
    return success, float(score), unchanged, made


@register_reward("shape_edit")
class ShapeEdit(SceneJudge):
    """Strict partial-credit score of each edited image against its row's expected target scene."""

    name = "shape_edit"
    rows = "shape-edit rows with source and target scenes (data.source=builtin:shape-edits)"
    extra = ("unchanged", "made")

    @classmethod
    def parse(cls, meta: dict) -> tuple[dict, dict]:
        return parse_scene(meta, "source"), parse_scene(meta, "target")

    def judge_one(self, image, scenes, found):
        ok, score, unchanged, made = judge_edit_made(image, scenes[1], found, scenes[0])
        return ok, self.credit(score, made, unchanged), {"unchanged": unchanged, "made": made}

    @staticmethod
    def credit(score: float, made: bool, unchanged: bool) -> float:
        return score


@register_reward("shape_edit_gated")
class ShapeEditGated(ShapeEdit):
    """``shape_edit``'s partial credit where the edit is made and the rest kept, else 0 (a copy, an over-edit)."""

    name = "shape_edit_gated"

    @staticmethod
    def credit(score: float, made: bool, unchanged: bool) -> float:
        return score if made and unchanged else 0.0
