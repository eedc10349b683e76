"""Input images of prompt rows (image editing): reading, checking and carrying them.

A prompt row may carry an ``image`` field, the image an editing model (``builtin:tiny-flux-kontext``,
FLUX.1 Kontext) edits as the prompt says:

- a path relative to the dataset file, which must stay inside the dataset's folder once resolved (``..``
  and symbolic links included; an absolute path or ``file://`` URI only when it lies inside):
  ``{"prompt": "make it red", "image": "imgs/a.png"}``; a remote dataset's paths stay under its own URI;
- a URI: ``hf://datasets/<owner>/<repo>/<path>[@revision]`` or an object-store one (``s3://``, ``gs://``, ...;
  ``REMOTE_SCHEMES``); no web URL, no chained ``::`` URL;
- the encoded image's bytes (a Parquet ``binary`` column, a generator's rows).

``load_prompts`` resolves every row's image once, before any model loads (``resolve_row_images``): it
reads the bytes, checks they decode (a missing, unreadable or malformed image is a ``PromptDataError``
naming the file and line, as other malformed rows are) and rewrites the row as
``image`` = a ``data:`` URI of the original bytes (the row stays JSON, self-contained on any worker),
``image_sha256`` = their digest, and ``image_uri`` = the reference it came from (absent for bytes). An image is
at most ``MAX_IMAGE_PIXELS`` (16 MP), read from its header before anything is decoded (``open_bounded``; the SFT
pairs' images too); every row of a dataset carries an image or none does (``check_image_rows``).
The rollout decodes ``image`` with ``decode_image`` (``row_images`` over a batch's metadata); the
trajectory Parquet keeps the digest, the URI and the bytes (``trajectory/store.py``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import warnings
from pathlib import Path

import numpy as np

from .readers import BadRows, PromptDataError, hf_download

DATA_URI = "data:"
# the most pixels an input image may have (16 MP), read from its header before it is decoded: PIL's own guard
# only warns up to 179 MP and then fails naming no file (the serving code's bound: request_limits.MAX_IMAGE_PIXELS)
MAX_IMAGE_PIXELS = 4096 * 4096


# URI schemes an ``image`` may name: object stores and the hub, never the machine's own files (a local
# image is a path relative to its dataset), never the open web (no network at run time)
REMOTE_SCHEMES = ("hf", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")


def confined_path(root: str | Path, name: str, where: str) -> Path:
    """The local file ``name`` (relative to ``root``, or an absolute path or ``file://`` URI) once resolved
    (``..`` and symbolic links included), which must lie inside ``root``: a dataset can only name its own
    images, never another file of the machine. Nothing outside is opened, so a refusal tells nothing of it."""
    text = name
    if name.lower().startswith("file://"):
        from urllib.parse import unquote, urlparse

        text = unquote(urlparse(name).path)
    folder = Path(root).resolve()
    path = Path(text)
    path = (path if path.is_absolute() or path.drive else folder / path).resolve()
    if text.startswith("~") or not path.is_relative_to(folder):
        raise PromptDataError(f"{where}: image {name!r} is outside the dataset folder {root}; keep the images "
                              "inside it and name them relative to it")
    return path


def _remote_ref(ref: str, base: str, where: str) -> str:
    """A path relative to a remote dataset's folder ``base`` (a URI, ``hf://`` with its ``@revision``), as
    a URI under it: ``..`` may not leave it."""
    import posixpath

    base, revision = (base.rsplit("@", 1) if base.startswith("hf://") and "@" in base else (base, ""))
    joined = posixpath.normpath(posixpath.join("/", ref))
    if Path(ref).is_absolute() or ref.startswith("~") or ".." in Path(ref).parts:
        raise PromptDataError(f"{where}: image {ref!r} is outside the dataset folder {base}; name the images "
                              "relative to it, without '..'")
    return f"{base.rstrip('/')}{joined}" + (f"@{revision}" if revision else "")


def read_image_bytes(ref: str, base: str | Path | None, where: str) -> tuple[bytes, str]:
    """The bytes an ``image`` reference names, and the reference resolved (a local path or URI).

    ``base``: the folder (local path or URI) of the dataset file. A path is relative to it and must stay
    inside it (a local dataset's ``file://`` URI too); a URI names an object store or the hub
    (``REMOTE_SCHEMES``). Anything else is a ``PromptDataError`` before any file is opened."""
    scheme = ref.split("://", 1)[0].lower() if "://" in ref else ""
    if "::" in ref or (scheme and scheme not in (*REMOTE_SCHEMES, "file")):
        raise PromptDataError(f"{where}: image {ref!r}: only paths inside the dataset folder and "
                              f"{', '.join(s + '://' for s in REMOTE_SCHEMES)} URIs are read (no web, no chained "
                              "URLs); copy the image into the dataset")
    remote_base = base is not None and "://" in str(base)
    if scheme == "file" or not scheme:
        if base is None:
            raise PromptDataError(f"{where}: image {ref!r} is a path, but these rows come from no dataset folder; "
                                  "give the image's bytes or a URI")
        if remote_base and scheme == "file":
            raise PromptDataError(f"{where}: image {ref!r}: a remote dataset's images are read from its own "
                                  "location only; name it relative to the dataset file")
        ref = _remote_ref(ref, str(base), where) if remote_base else str(confined_path(base, ref, where))
    try:
        if ref.startswith("hf://"):
            if not ref.startswith("hf://datasets/"):
                raise PromptDataError("hf:// images are read from datasets: hf://datasets/<owner>/<repo>/<path>")
            return hf_download(ref).read_bytes(), ref
        if "://" in ref:
            import fsspec

            with fsspec.open(ref, "rb") as fh:
                return fh.read(), ref
        path = Path(ref)
        return path.read_bytes(), str(path)
    except PromptDataError as exc:
        raise PromptDataError(f"{where}: image {ref!r}: {exc}") from exc
    except (OSError, ValueError, ImportError) as exc:
        why = "no such file" if isinstance(exc, FileNotFoundError) else f"{type(exc).__name__}: {exc}"
        raise PromptDataError(f"{where}: cannot read the image {ref!r} ({why})") from exc


def image_base(source: str, local: Path) -> str:
    """What a relative ``image`` path in the dataset ``source`` (read from ``local``) is relative to: the
    remote file's folder (``hf://`` keeps its ``@revision``), a local or downloaded folder, a file's folder."""
    if "://" in source and not local.is_dir():
        spec, _, revision = source.partition("@") if source.startswith("hf://") else (source, "", "")
        return spec.rsplit("/", 1)[0] + (f"@{revision}" if revision else "")
    return str(local if local.is_dir() else local.parent)


def too_large(where: str, pixels: int | None, size: tuple[int, int] | None = None) -> str:
    """The line that refuses an image of ``pixels`` (``size``: width, height) over ``MAX_IMAGE_PIXELS``."""
    shown = f"{size[0]}x{size[1]} pixels" if size else f"{pixels} pixels" if pixels else "larger than PIL opens"
    mp = f" ({pixels / 1e6:.0f} MP)" if pixels else ""
    return (f"{where}: the image is {shown}{mp}, over the bound of {MAX_IMAGE_PIXELS} pixels (4096x4096, "
            f"{MAX_IMAGE_PIXELS / 1e6:.1f} MP) an input image may have; downscale it")


def open_bounded(fp, where: str):
    """``PIL.Image.open(fp)`` (lazy: only the header is read), refused in one ``PromptDataError`` naming ``where``
    when the header's size is over ``MAX_IMAGE_PIXELS``, before anything is decoded (PIL's decompression-bomb
    warning and error, which name no file, never reach the user). Unreadable data raises what PIL raises."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(fp)
        except Image.DecompressionBombError as exc:
            pixels = re.search(r"\((\d+) pixels\)", str(exc))
            raise PromptDataError(too_large(where, int(pixels.group(1)) if pixels else None)) from None
    if im.width * im.height > MAX_IMAGE_PIXELS:
        im.close()
        raise PromptDataError(too_large(where, im.width * im.height, im.size))
    return im


def check_image(data: bytes, where: str) -> tuple[str, tuple[int, int]]:
    """The MIME type and ``(width, height)`` of encoded image bytes; undecodable bytes, or an image over
    ``MAX_IMAGE_PIXELS``, fail naming ``where``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open_bounded(io.BytesIO(data), where) as im:
            im.load()  # decode it all: a truncated file fails here, not in a rollout
            return Image.MIME.get(im.format, "image/png"), im.size
    except PromptDataError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise PromptDataError(f"{where}: the 'image' is not a readable image ({len(data)} bytes: {exc})") from exc


def resolve_row_image(row: dict, where: str, base: str | Path | None = None) -> dict:
    """``row`` with its ``image`` read and checked, as a ``data:`` URI plus ``image_sha256`` and, for a
    path or URI, ``image_uri``; a row without ``image`` (or whose image is already resolved) as it is."""
    value = row.get("image")
    if value is None:
        return row
    if isinstance(value, str) and value.startswith(DATA_URI) and "image_sha256" in row:
        return row  # resolved before (a cached prompt set)
    out = {k: v for k, v in row.items() if k not in ("image_uri", "image_sha256")}
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, str) and value.startswith(DATA_URI):
        data = _from_data_uri(value, where)
    elif isinstance(value, str) and value.strip():
        data, out["image_uri"] = read_image_bytes(value.strip(), base, where)
    else:
        raise PromptDataError(f"{where}: 'image' must be a path, a URI or the image's bytes, got "
                              f"{type(value).__name__} {str(value)[:40]!r}")
    mime, _ = check_image(data, where)
    out["image"] = f"{DATA_URI}{mime};base64,{base64.b64encode(data).decode()}"
    out["image_sha256"] = hashlib.sha256(data).hexdigest()
    return out


def resolve_row_images(located: list[tuple[str, dict]], base: str | Path | None = None,
                       name: str = "rows") -> list[tuple[str, dict]]:
    """``resolve_row_image`` over ``(where, row)`` pairs (of the file ``name``); the rows whose image is bad are
    reported together, in one ``PromptDataError`` (``readers.BadRows``)."""
    bad, out = BadRows(name), []
    for where, row in located:
        try:
            out.append((where, resolve_row_image(row, where, base)))
        except PromptDataError as exc:
            bad.add(exc)
    bad.check()
    return out


def check_image_rows(located: list[tuple[str, dict]]) -> None:
    """Every row of ``(where, row)`` pairs carries an ``image``, or none does (an edit and a generation cannot
    share a batch): the first row that differs from the first row is one ``PromptDataError`` naming both."""
    if not located:
        return
    first_where, first = located[0]
    edits = first.get("image") is not None
    for where, row in located[1:]:
        if (row.get("image") is not None) != edits:
            if edits:
                raise PromptDataError(f"{where}: this row has no 'image', while the rows before it have one (from "
                                      f"{first_where}); give every row of an editing dataset an image")
            raise PromptDataError(f"{where}: this row has an 'image', while the rows before it have none (from "
                                  f"{first_where}); give every row an image (an editing dataset) or none")


def _from_data_uri(value: str, where: str = "image") -> bytes:
    head, sep, payload = value.partition(",")
    if not sep or not head.endswith(";base64"):
        raise PromptDataError(f"{where}: an image data URI must be data:<mime>;base64,<bytes>, got {value[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as exc:
        raise PromptDataError(f"{where}: the image data URI is not valid base64 ({exc})") from exc


def image_bytes(value: str | bytes) -> bytes:
    """The encoded bytes of a resolved row's ``image`` (a ``data:`` URI) or of raw bytes."""
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else _from_data_uri(value)


def decode_image(value: str | bytes) -> np.ndarray:
    """A resolved row's ``image`` as RGB uint8 ``[H, W, 3]``."""
    with open_bounded(io.BytesIO(image_bytes(value)), "image") as im:
        return np.asarray(im.convert("RGB"))


def row_images(metadata: list[dict] | None) -> list[np.ndarray] | None:
    """The input images of a batch's rows (its ``metadata``), or None when no row carries one; a batch
    mixing rows with and without an image fails (an edit and a generation cannot share a forward)."""
    if not metadata or not any(m.get("image") is not None for m in metadata):
        return None
    missing = [i for i, m in enumerate(metadata) if m.get("image") is None]
    if missing:
        raise PromptDataError(f"{len(missing)} of {len(metadata)} rows in a batch carry no 'image' while the others "
                              f"do (e.g. row {missing[0]}); give every row of an editing dataset an image")
    return [decode_image(m["image"]) for m in metadata]
