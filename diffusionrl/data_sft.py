"""(prompt, image) pairs for supervised fine-tuning (``algorithm.name=sft``, docs/algorithms.md 14.7).

Sources (``algorithm.sft_source``):
- a folder of images with a ``prompts.jsonl`` (or the Hugging Face imagefolder ``metadata.jsonl``):
  one JSON object per line naming the image (``image`` or ``file_name``, relative to the folder)
  and its prompt (``prompt`` or ``text``);
- a ``.parquet`` file with a ``prompt`` (or ``text``) column and an ``image`` column of encoded
  image bytes (PNG/JPEG/WebP), or of ``{"bytes": ...}`` structs as Hugging Face datasets store them;
- ``builtin:shapes`` (``builtin:shapes:N``): N seeded scenes of the shapes world (``diffusionrl.data_shapes``:
  1-4 coloured circles, squares, triangles on white) with their prompts, for tests and the tiny preset.

Every row becomes ``{"prompt": str, "image": uint8 [resolution, resolution, 3]}`` (centre-cropped
to a square, resized with Lanczos). A bad row is a ``PromptDataError`` naming its file and line.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from diffusionrl.data import PromptDataError


def to_square(image, resolution: int) -> np.ndarray:
    """A PIL image, centre-cropped to a square and resized to ``resolution``, as uint8 ``[H, W, 3]``."""
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    side = min(w, h)
    box = ((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side)
    return np.asarray(image.crop(box).resize((resolution, resolution), Image.LANCZOS), dtype=np.uint8)


def shape_pairs(num: int, resolution: int, seed: int = 0) -> list[dict[str, Any]]:
    """``num`` seeded scenes of the shapes world (``diffusionrl.data_shapes``, all its prompts) with
    their prompts."""
    from diffusionrl.data_shapes import scene_pairs, shape_prompts

    return [{"prompt": p["prompt"], "image": p["image"]} for p in scene_pairs(shape_prompts(), num, resolution, seed)]


def _prompt_of(obj: dict, where: str) -> str:
    prompt = obj.get("prompt", obj.get("text"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptDataError(f"{where}: no non-empty 'prompt' (or 'text')")
    return prompt.strip()


def read_image_folder(folder: Path, resolution: int) -> list[dict[str, Any]]:
    """Images named by ``prompts.jsonl`` (or ``metadata.jsonl``) in ``folder``."""
    from PIL import Image

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
        path = (folder / name).resolve()
        if not path.is_file():
            raise PromptDataError(f"{where}: image {name!r} not found in {folder}")
        try:
            with Image.open(path) as im:
                image = to_square(im, resolution)
        except OSError as exc:
            raise PromptDataError(f"{where}: cannot read image {name!r} ({exc})") from exc
        rows.append({"prompt": _prompt_of(obj, where), "image": image})
    return rows


def read_image_parquet(path: Path, resolution: int) -> list[dict[str, Any]]:
    """Rows of a Parquet file with a prompt column and an ``image`` column of encoded bytes."""
    import pyarrow.parquet as pq
    from PIL import Image

    table = pq.read_table(path).to_pylist()
    rows = []
    for i, obj in enumerate(table):
        where = f"{path}: row {i}"
        data = obj.get("image")
        data = data.get("bytes") if isinstance(data, dict) else data
        if not isinstance(data, (bytes, bytearray)):
            raise PromptDataError(f"{where}: 'image' is not encoded image bytes")
        try:
            with Image.open(io.BytesIO(data)) as im:
                image = to_square(im, resolution)
        except OSError as exc:
            raise PromptDataError(f"{where}: cannot decode the image ({exc})") from exc
        rows.append({"prompt": _prompt_of(obj, where), "image": image})
    return rows


def load_image_pairs(source: str, resolution: int, seed: int = 0) -> list[dict[str, Any]]:
    """The (prompt, image) rows of ``source`` (see the module docstring), images at ``resolution``."""
    if source.startswith("builtin:"):
        name, _, count = source[len("builtin:"):].partition(":")
        if name != "shapes":
            raise PromptDataError(f"unknown SFT source {source!r}; the built-in one is builtin:shapes[:N]")
        return shape_pairs(int(count or 256), resolution, seed)
    path = Path(source).expanduser()
    if path.is_dir():
        rows = read_image_folder(path, resolution)
    elif path.suffix == ".parquet" and path.is_file():
        rows = read_image_parquet(path, resolution)
    else:
        raise PromptDataError(f"SFT source {source!r} is neither a folder, a .parquet file nor builtin:shapes")
    if not rows:
        raise PromptDataError(f"SFT source {source!r} has no rows")
    return rows
