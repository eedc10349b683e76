"""OCR reward (docs/algorithms.md section 8): how closely the text read in the image matches the prompt's.

The target is the first double-quoted span of the prompt (or ``metadata["text"]`` when a dataset
gives it). All recognised text lines are joined; both sides are lowercased and stripped of spaces.
A target found inside the recognised text has distance 0, otherwise the Levenshtein distance,
capped at ``len(target)``. ``reward = 1 - distance / len(target)``, in [0, 1].

Two backends read text behind one interface, ``OcrBackend.read_text(images) -> lines per image``:
- ``rapidocr`` (default): PP-OCRv4 det/rec ONNX models shipped inside the ``rapidocr_onnxruntime``
  wheel, run by onnxruntime on CPU; nothing is downloaded.
- ``paddleocr``: PaddleOCR 2.x with inference models from ``reward.ocr_model_dir`` (``det/`` and
  ``rec/``), the backend flow_grpo used; optional extra ``pip install 'diffusionrl[ocr-paddle]'``.

An image that cannot be read (bad array, OCR exception) scores 0 and is counted in ``failures``.
A prompt without a quoted target is a data error and raises ``ValueError``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from rapidfuzz.distance import Levenshtein

from .base import Reward, RewardResult, register_reward, reward_threads

log = logging.getLogger(__name__)

# Straight quotes first; typographic quotes are accepted too because prompt writers paste them.
_QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')


# ----------------------------------------------------------------------------- targets and scoring


def normalize_text(text: str) -> str:
    """Lowercase and drop all whitespace (the OCR reward compares texts in this form)."""
    return "".join(text.split()).lower()


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted span of ``prompt`` or None."""
    match = _QUOTED.search(prompt)
    if match is None:
        return None
    return match.group(1) if match.group(1) is not None else match.group(2)


def ocr_target(prompt: str, meta: dict | None = None) -> str | None:
    """The text an image for ``prompt`` should show: ``meta["text"]`` if given, else the quoted span."""
    text = (meta or {}).get("text")
    if text is None or not str(text).strip():
        text = quoted_text(prompt)
    if text is None or not normalize_text(str(text)):
        return None
    return str(text)


def validate_ocr_prompts(prompts: Sequence[str], metadata: Sequence[dict] | None = None,
                         source: str = "prompts", locations: Sequence[str] | None = None) -> list[str]:
    """The OCR target of every row; ``ValueError`` naming the first bad row if any has none (and, with
    ``locations``, every bad row's, up to 20).

    ``source`` says where the rows come from (a file path, "reward batch") for the message;
    ``locations[i]`` (``path:line``), when given, names row i instead of its index.
    """
    metadata = list(metadata) if metadata is not None else [{}] * len(prompts)
    if len(metadata) != len(prompts):
        raise ValueError(f"{source}: {len(prompts)} prompts but {len(metadata)} metadata rows")
    targets: list[str] = []
    bad: list[int] = []
    for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
        target = ocr_target(prompt, meta)
        if target is None:
            bad.append(i)
        targets.append(target or "")
    if bad:
        first = bad[0]
        row = f"{locations[first]}:" if locations is not None else f"{source}: row {first}"
        listed = ""
        if locations is not None and len(bad) > 1:  # every bad row in one error (the first 20), not one per run
            more = f" and {len(bad) - 20} more" if len(bad) > 20 else ""
            listed = f": {', '.join(locations[i] for i in bad[:20])}{more}"
        raise ValueError(
            f"{row} has no text for the OCR reward: prompt {prompts[first]!r} has no non-empty "
            f'double-quoted span ({len(bad)} of {len(prompts)} rows of {source} are like this{listed}). Quote the '
            f'text to render, e.g. \'a shop sign that says "OPEN"\', or give the row a "text" field.'
        )
    return targets


def ocr_score(recognized: str, target: str) -> float:
    """``1 - min(distance, len(target)) / len(target)`` on normalised texts; 0 distance if contained."""
    target_n = normalize_text(target)
    if not target_n:
        raise ValueError(f"empty OCR target {target!r}")
    recognized_n = normalize_text(recognized)
    if target_n in recognized_n:
        return 1.0
    distance = min(Levenshtein.distance(recognized_n, target_n), len(target_n))
    return 1.0 - distance / len(target_n)


# ----------------------------------------------------------------------------- backends


class OcrBackend(Protocol):
    def read_text(self, images: Sequence[np.ndarray]) -> list[list[str] | Exception]:
        """Text lines read in each RGB uint8 ``[H, W, 3]`` image, or the exception that image raised."""
        ...


def as_rgb_uint8(image) -> np.ndarray:
    """Check one image is a finite uint8 ``[H, W, 3]`` array (raises ``ValueError`` otherwise)."""
    array = np.asarray(image)
    if array.dtype != np.uint8:
        raise ValueError(f"image has dtype {array.dtype}, expected uint8")
    if array.ndim != 3 or array.shape[2] != 3 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"image has shape {array.shape}, expected [H, W, 3]")
    return array


def _resolve_threads(threads: int | None) -> int:
    """An explicit count wins; unset or 0 (``reward.ocr_threads``' default) is the actor pool's
    per-actor cap ($DIFFUSIONRL_REWARD_THREADS), else 0: onnxruntime's own default."""
    if not threads:
        return reward_threads()
    return max(0, int(threads))


class RapidOcrBackend:
    """RapidOCR (PP-OCRv4 ONNX from the wheel). Images are read one at a time: on CPU, stacking
    same-size images into one detector call and batching crops across images is slower than one by
    one, for detection and for recognition (bench/README.md)."""

    def __init__(self, threads: int | None = None, det_limit_side_len: int = 960, text_score: float = 0.5):
        """``threads``: onnxruntime intra-op threads (None or 0: $DIFFUSIONRL_REWARD_THREADS, else all cores).

        Detection keeps images up to ``det_limit_side_len`` at their own size (PaddleOCR's
        behaviour; RapidOCR's default upscales a 512 px image to 736 px, which is slower).
        """
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "the rapidocr OCR backend needs rapidocr_onnxruntime (a core dependency): pip install -e ."
            ) from exc
        self.threads = _resolve_threads(threads)
        kwargs = {"det_limit_type": "max", "det_limit_side_len": det_limit_side_len, "text_score": text_score}
        if self.threads > 0:
            kwargs.update(intra_op_num_threads=self.threads, inter_op_num_threads=1)
        self.engine = RapidOCR(**kwargs)

    def read_one(self, image: np.ndarray) -> list[str]:
        bgr = np.ascontiguousarray(as_rgb_uint8(image)[..., ::-1])  # RapidOCR takes arrays as BGR
        # Generated text is upright: skip the angle classifier, as flow_grpo's PaddleOCR call does.
        result, _ = self.engine(bgr, use_det=True, use_cls=False, use_rec=True)
        return [str(line[1]) for line in result or []]  # line = [box, text, confidence]

    def read_text(self, images):
        out: list[list[str] | Exception] = []
        for image in images:
            try:
                out.append(self.read_one(image))
            except Exception as exc:  # reported per image, scored 0 by the reward
                out.append(exc)
        return out


class PaddleOcrBackend:
    """PaddleOCR 2.x with local inference models: ``<model_dir>/det`` and ``<model_dir>/rec``."""

    def __init__(self, model_dir: str, use_gpu: bool = False):
        det, rec = Path(model_dir or "") / "det", Path(model_dir or "") / "rec"
        if not model_dir:
            raise ValueError(
                "reward.ocr_backend=paddleocr needs reward.ocr_model_dir: a folder holding det/ and rec/ "
                "PaddleOCR inference model folders (e.g. en_PP-OCRv4_det_infer renamed det/, en_PP-OCRv4_rec_infer "
                "renamed rec/); or use reward.ocr_backend=rapidocr, which ships its models"
            )
        missing = [str(p) for p in (det, rec) if not (p / "inference.pdiparams").is_file()]
        if missing:
            raise FileNotFoundError(
                f"reward.ocr_model_dir={model_dir}: no PaddleOCR inference model (inference.pdmodel + "
                f"inference.pdiparams) in {', '.join(missing)}; download the det/rec inference models there "
                "or use reward.ocr_backend=rapidocr"
            )
        try:
            import paddleocr
            from paddleocr import PaddleOCR
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "reward.ocr_backend=paddleocr needs the optional extra: pip install 'diffusionrl[ocr-paddle]' "
                "(paddleocr 2.x and paddlepaddle); or use reward.ocr_backend=rapidocr"
            ) from exc
        version = getattr(paddleocr, "__version__", "0")
        if not version.startswith("2."):
            raise RuntimeError(
                f"paddleocr {version} is installed; the paddleocr backend uses the 2.x API: "
                "pip install 'diffusionrl[ocr-paddle]'"
            )
        self.engine = PaddleOCR(
            use_angle_cls=False, lang="en", det_model_dir=str(det), rec_model_dir=str(rec), use_gpu=use_gpu,
            show_log=False,
        )

    def read_one(self, image: np.ndarray) -> list[str]:
        bgr = np.ascontiguousarray(as_rgb_uint8(image)[..., ::-1])
        result = self.engine.ocr(bgr, det=True, rec=True, cls=False)  # [image][line] = [box, (text, conf)]
        lines = result[0] if result else None
        return [str(line[1][0]) for line in lines or []]

    def read_text(self, images):
        out: list[list[str] | Exception] = []
        for image in images:
            try:
                out.append(self.read_one(image))
            except Exception as exc:
                out.append(exc)
        return out


def make_ocr_backend(reward_cfg=None, threads: int | None = None) -> OcrBackend:
    backend = getattr(reward_cfg, "ocr_backend", "rapidocr")
    if backend == "rapidocr":
        return RapidOcrBackend(threads=threads if threads is not None else getattr(reward_cfg, "ocr_threads", None))
    if backend == "paddleocr":
        return PaddleOcrBackend(getattr(reward_cfg, "ocr_model_dir", ""))
    raise ValueError(f"reward.ocr_backend={backend!r} is not one of: rapidocr, paddleocr")


def render_text_image(
    text: str, size: int = 512, font_size: int = 48, y: float | None = None,
    color=(0, 0, 0), background=(255, 255, 255),
) -> np.ndarray:
    """A ``[size, size, 3]`` uint8 image with ``text`` drawn in Pillow's built-in scalable font,
    centred horizontally, at height ``y`` (centred if None); the font shrinks to fit 90% of the
    width. For tests, benches and sanity checks of the OCR backends."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    width = draw.textlength(text, font=font)
    if width > 0.9 * size:
        font_size = max(8, int(font_size * 0.9 * size / width))
        font = ImageFont.load_default(size=font_size)
        width = draw.textlength(text, font=font)
    draw.text(((size - width) / 2, (size - font_size) / 2 if y is None else y), text, fill=color, font=font)
    return np.asarray(image)


# ----------------------------------------------------------------------------- the reward


@register_reward("ocr")
class OcrReward(Reward):
    """1 - capped Levenshtein distance / len(target) between read text and the prompt's quoted text."""

    name = "ocr"

    def __init__(self, backend: OcrBackend):
        self.backend = backend

    @classmethod
    def from_config(cls, reward_cfg=None) -> OcrReward:
        return cls(make_ocr_backend(reward_cfg))

    @classmethod
    def validate_prompts(cls, prompts, metadata=None, source: str = "prompts", locations=None) -> None:
        """Every row needs a text to read: ``metadata["text"]`` or a quoted span (``validate_ocr_prompts``)."""
        validate_ocr_prompts(prompts, metadata, source=source, locations=locations)

    def __call__(self, images, prompts, metadata) -> RewardResult:
        metadata = list(metadata) if metadata is not None else [{}] * len(prompts)
        targets = validate_ocr_prompts(prompts, metadata, source="ocr reward batch")  # raises: data error
        if len(images) != len(prompts):
            raise ValueError(f"ocr reward: {len(images)} images but {len(prompts)} prompts")
        lines = self.backend.read_text(list(images))
        scores = np.zeros(len(prompts), dtype=np.float32)
        failures = 0
        for i, (read, target) in enumerate(zip(lines, targets)):
            if isinstance(read, Exception):
                failures += 1
                log.warning("reward ocr failed on sample %d (%s): %s", i, prompts[i][:60], read)
                continue
            scores[i] = ocr_score("".join(read), target)
        info = {"exact": float(np.mean(scores == 1.0))} if len(scores) else {}
        return RewardResult(scores, failures, info)
