"""(prompt, image) pairs for supervised fine-tuning (``algorithm.name=sft``, docs/algorithms.md 14.7).

Sources (``algorithm.sft_source``):
- a folder of images with a ``prompts.jsonl`` (or the Hugging Face imagefolder ``metadata.jsonl``):
  one JSON object per line naming the image (``image`` or ``file_name``, relative to the folder,
  and inside it once resolved: an absolute path or one that leaves the folder is refused) and its
  prompt (``prompt`` or ``text``);
- a ``.parquet`` file with a ``prompt`` (or ``text``) column and an ``image`` column of encoded
  image bytes (PNG/JPEG/WebP), or of ``{"bytes": ...}`` structs as Hugging Face datasets store them;
- ``builtin:shapes`` (``builtin:shapes:N``): N seeded scenes of the shapes world (``diffusionrl.data.shapes``:
  1-4 coloured circles, squares, triangles on white) of its training prompts (never a held-out one), for
  tests and the tiny preset.

Every row becomes ``{"prompt": str, "image": uint8 [resolution, resolution, 3]}`` (centre-cropped
to a square, resized with Lanczos). A bad row is a ``PromptDataError`` naming its file and line, and so is an
image over ``images.MAX_IMAGE_PIXELS`` (read from its header before it is decoded).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from .images import confined_path, open_bounded
from .readers import PromptDataError


def to_square(image, resolution: int) -> np.ndarray:
    """A PIL image, centre-cropped to a square and resized to ``resolution``, as uint8 ``[H, W, 3]``."""
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    side = min(w, h)
    box = ((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side)
    return np.asarray(image.crop(box).resize((resolution, resolution), Image.LANCZOS), dtype=np.uint8)


def shape_pairs(num: int, resolution: int, seed: int = 0) -> list[dict[str, Any]]:
    """``num`` seeded scenes of the shapes world's *training* prompts (``diffusionrl.data.shapes``: the
    split ``builtin:tiny-sd3-shapes`` was pretrained on and ``tiny-cpu-shapes`` trains on) with their
    prompts: a warm start never draws a held-out prompt, so the evaluation stays held out."""
    from .shapes import DEFAULT_SPLIT_SEED, DEFAULT_TEST_FRACTION, scene_pairs, world_splits

    train, _ = world_splits(DEFAULT_TEST_FRACTION, DEFAULT_SPLIT_SEED)
    return [{"prompt": p["prompt"], "image": p["image"]} for p in scene_pairs(train, num, resolution, seed)]


def _prompt_of(obj: dict, where: str) -> str:
    prompt = obj.get("prompt", obj.get("text"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptDataError(f"{where}: no non-empty 'prompt' (or 'text')")
    return prompt.strip()


def image_path(folder: Path, name: str, where: str) -> Path:
    """The file ``name`` of an index row, which must be a relative path that stays inside ``folder``
    once resolved (``data.images.confined_path``): an index can only name the dataset's own images."""
    if Path(name).is_absolute() or Path(name).drive or name.startswith("~"):
        raise PromptDataError(f"{where}: image {name!r} is an absolute path; name it relative to {folder}")
    return confined_path(folder, name, where)


def read_image_folder(folder: Path, resolution: int) -> list[dict[str, Any]]:
    """Images named by ``prompts.jsonl`` (or ``metadata.jsonl``) in ``folder``."""

    index = next((folder / n for n in ("prompts.jsonl", "metadata.jsonl") if (folder / n).is_file()), None)
    if index is None:
        raise PromptDataError(f"{folder}: an SFT image folder needs a prompts.jsonl (or metadata.jsonl)")
    rows = []
    for lineno, line in enumerate(index.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{index}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptDataError(f"{where}: not JSON ({exc})") from exc
        name = obj.get("image", obj.get("file_name")) if isinstance(obj, dict) else None
        if not isinstance(name, str):
            raise PromptDataError(f"{where}: no 'image' (or 'file_name') naming the image file")
        path = image_path(folder, name, where)
        if not path.is_file():
            raise PromptDataError(f"{where}: image {name!r} not found in {folder}")
        try:
            with open_bounded(path, where) as im:
                image = to_square(im, resolution)
        except OSError as exc:
            raise PromptDataError(f"{where}: cannot read image {name!r} ({exc})") from exc
        rows.append({"prompt": _prompt_of(obj, where), "image": image})
    return rows


def read_image_parquet(path: Path, resolution: int) -> list[dict[str, Any]]:
    """Rows of a Parquet file with a prompt column and an ``image`` column of encoded bytes."""
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    rows = []
    for i, obj in enumerate(table):
        where = f"{path}: row {i}"
        data = obj.get("image")
        data = data.get("bytes") if isinstance(data, dict) else data
        if not isinstance(data, (bytes, bytearray)):
            raise PromptDataError(f"{where}: 'image' is not encoded image bytes")
        try:
            with open_bounded(io.BytesIO(data), where) as im:
                image = to_square(im, resolution)
        except OSError as exc:
            raise PromptDataError(f"{where}: cannot decode the image ({exc})") from exc
        rows.append({"prompt": _prompt_of(obj, where), "image": image})
    return rows


BUILTIN_PAIRS = 256  # scenes of builtin:shapes without a count


def builtin_count(source: str) -> int:
    """N of ``builtin:shapes:N`` (``BUILTIN_PAIRS`` for ``builtin:shapes``); anything else one line."""
    name, _, count = source[len("builtin:"):].partition(":")
    if name != "shapes":
        raise PromptDataError(f"algorithm.sft_source={source!r}: unknown built-in SFT source; the built-in one is "
                              "builtin:shapes[:N]")
    if not count:
        return BUILTIN_PAIRS
    if not count.isdigit() or int(count) < 1:
        raise PromptDataError(f"algorithm.sft_source={source!r}: {count!r} is not a number of scenes; write "
                              "builtin:shapes:N with N >= 1 (e.g. builtin:shapes:64), or builtin:shapes")
    return int(count)


def check_sft_source(source: str) -> None:
    """What can be checked of ``source`` without reading its images (the workflow's first task and
    the SFT loop call it): a built-in name that parses, a folder with its index, an existing
    ``.parquet`` file. Each mistake is one ``PromptDataError`` naming ``algorithm.sft_source``."""
    if source.startswith("builtin:"):
        builtin_count(source)
        return
    if "://" in source:
        raise PromptDataError(f"algorithm.sft_source={source!r}: SFT pairs are read from a local folder or .parquet "
                              "file, not a URI; copy them next to the run, or use builtin:shapes[:N]")
    path = Path(source).expanduser()
    if path.is_dir():
        if not any((path / n).is_file() for n in ("prompts.jsonl", "metadata.jsonl")):
            raise PromptDataError(f"algorithm.sft_source={source!r}: an SFT image folder needs a prompts.jsonl (or "
                                  "metadata.jsonl) naming each image and its prompt")
    elif path.is_file():
        if path.suffix != ".parquet":
            raise PromptDataError(f"algorithm.sft_source={source!r} is a {path.suffix or 'suffix-less'} file; give a "
                                  ".parquet file, an image folder with prompts.jsonl, or builtin:shapes[:N]")
    else:
        raise PromptDataError(f"algorithm.sft_source={source!r}: no such file or folder; fix the path, or use "
                              "builtin:shapes[:N]")


def load_image_pairs(source: str, resolution: int, seed: int = 0) -> list[dict[str, Any]]:
    """The (prompt, image) rows of ``source`` (see the module docstring), images at ``resolution``."""
    check_sft_source(source)
    if source.startswith("builtin:"):
        return shape_pairs(builtin_count(source), resolution, seed)
    path = Path(source).expanduser()
    rows = read_image_folder(path, resolution) if path.is_dir() else read_image_parquet(path, resolution)
    if not rows:
        raise PromptDataError(f"SFT source {source!r} has no rows")
    return rows
