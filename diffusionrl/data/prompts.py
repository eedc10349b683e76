"""Prompt sources, validation and the deterministic train/test split.

Sources (``data.source``):
- ``builtin:objects``: a small generator of object/scene prompts (the tiny-model default;
  ``diffusionrl.data.objects``);
- ``builtin:ocr``: OCR text-rendering prompts (``diffusionrl.data.ocr``);
- ``builtin:shapes``: the shapes world's prompts with their specs (``diffusionrl.data.shapes``);
- ``builtin:shape-edits[:N]``: edit instructions on rendered shapes-world scenes, each row with its source
  image (PNG bytes) and source and target scenes (``diffusionrl.data.shape_edits``);
- a ``.txt`` file (one prompt a line), a ``.jsonl`` file (``{"prompt": ..., <metadata>}`` a line), a
  ``.parquet`` file (a ``prompt`` column plus metadata columns; the readers: ``diffusionrl.data.readers``);
  a folder in the flowgrpo layout: one ``train`` and one ``test`` file of those kinds (e.g. ``train.jsonl``
  + ``test.txt``), its split kept;
- ``hf://datasets/<owner>/<repo>/<path>[@revision]``: a file of a Hugging Face dataset repo,
  downloaded with ``HF_TOKEN`` (unreachable offline; same parsers).

A row may carry an input image (``image``: a path relative to the dataset file, a URI, or the image's bytes) for
an editing model; ``data.images`` reads and checks it here and rewrites it as a self-contained ``data:`` URI with
its ``image_sha256`` and ``image_uri``. Every row of a source carries an image or none does (the first row that
differs is named here, not in a training step).

Malformed rows raise ``PromptDataError`` (a ``diffusionrl.errors.UserError``) naming the file and line, all of a
file's bad rows in one error (up to ``readers.MAX_REPORTED``), and so do the reward's own prompt checks (e.g. an
OCR prompt without a quoted text). A UTF-8 byte-order mark is
dropped. Blank and duplicate prompts are dropped and counted (a test row that repeats a training prompt is a
duplicate; a row with an input image is a duplicate only with the same prompt on the same image: ``row_key``).
Every source must give both splits, non-empty and disjoint, or ``load_prompts`` fails saying why;
it runs before any model is loaded (``train.build_loop``, and the workflow's ``prepare_prompts``, which the
base-weights fetch waits for). The split of a single file or generator is by a hash of each prompt's text (and
input image digest), so it does not depend on row order and a prompt never moves between train and test when
rows are added.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from diffusionrl.digest import file_sha256

from .images import check_image_rows, image_base, resolve_row_image, resolve_row_images
from .objects import generate_object_prompts
from .readers import READERS, PromptDataError, hf_download, read_file
from .shape_edits import SOURCE as EDIT_SOURCE
from .shape_edits import generate_edit_prompts

log = logging.getLogger(__name__)


@dataclass
class PromptSet:
    train: list[dict[str, Any]]
    test: list[dict[str, Any]]
    source: str
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return rows_digest(self.train, self.test)


def rows_digest(*splits: list[dict[str, Any]]) -> str:
    """sha256 of the canonical JSON of the rows, 16 hex chars (a bytes field, such as a row's input
    image, by the sha256 of its bytes; an array, such as an SFT pair's image, by its dtype, shape and
    the sha256 of its bytes)."""
    h = hashlib.sha256()
    for rows in splits:
        h.update(json.dumps(rows, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                            default=_bytes_digest).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


def _bytes_digest(value: Any) -> str:
    if isinstance(value, bytes):
        return f"sha256:{hashlib.sha256(value).hexdigest()}"
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value).tobytes()
        return f"{value.dtype}{list(value.shape)}:sha256:{hashlib.sha256(data).hexdigest()}"
    raise TypeError(f"a prompt row field of type {type(value).__name__} has no canonical JSON")


def clean_rows(
    rows: list[tuple[str, dict[str, Any]]], stats: dict[str, int], seen: set[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """Strip prompts, drop (and count) blank and duplicate ones (``seen``: ``row_key``s kept before);
    each kept row keeps its ``where``."""
    seen = set() if seen is None else seen
    out = []
    for where, row in rows:
        prompt = row["prompt"].strip()
        if not prompt:
            stats["blank"] = stats.get("blank", 0) + 1
            continue
        key = row_key({**row, "prompt": prompt})
        if key in seen:
            stats["duplicate"] = stats.get("duplicate", 0) + 1
            continue
        seen.add(key)
        out.append((where, {**row, "prompt": prompt}))
    return out


IMAGE_KEY_SEPARATOR = "\x00image:"


def row_key(row: dict[str, Any]) -> str:
    """What makes a row distinct (duplicates, the split): its prompt, and its input image's digest where it
    has one (an editing dataset gives one instruction to many images). A text row's key is its prompt."""
    digest = row.get("image_sha256")
    return row["prompt"] if digest is None else f"{row['prompt']}{IMAGE_KEY_SEPARATOR}{digest}"


def split_rows(rows: list[dict], test_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic split by a seeded hash of the prompt text (order-independent)."""

    def bucket(prompt: str) -> float:
        h = hashlib.sha256(f"{seed}:{prompt}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64

    train = [r for r in rows if bucket(row_key(r)) >= test_fraction]
    test = [r for r in rows if bucket(row_key(r)) < test_fraction]
    if rows and not test:  # tiny sets: keep at least one held-out prompt
        test, train = train[-1:], train[:-1]
    return train, test


def _fsspec_download(source: str) -> Path:
    """An object-store file or folder (``s3://``, ``gs://``, ...) copied to a local temp path."""
    import tempfile

    import fsspec

    fs, path = fsspec.core.url_to_fs(source)
    local = Path(tempfile.mkdtemp(prefix="prompts-")) / Path(path.rstrip("/")).name
    fs.get(path, str(local), recursive=fs.isdir(path))
    return local


def source_fingerprint(source: str) -> str:
    """What a cache of prepared prompts keys on, read without parsing anything: the bytes of a local
    file or folder, the object store's ETag/size/mtime of a remote one (a refreshed ``latest/``
    prefix changes it), the source string itself for generators and hub files (pinned by
    ``@revision``). A missing path gets a key of its own; ``load_prompts`` then names the problem."""
    digest = hashlib.sha256(source.encode())
    if source.startswith(("builtin:", "hf://")):
        return digest.hexdigest()[:16]
    if "://" in source:
        import fsspec

        fs, path = fsspec.core.url_to_fs(source)
        files = sorted(fs.find(path)) if fs.isdir(path) else [path]
        for f in files:
            info = fs.info(f)
            keys = ("name", "size", "ETag", "etag", "mtime", "LastModified")
            stamp = {k: str(info.get(k)) for k in keys if k in info}
            digest.update(json.dumps(stamp, sort_keys=True).encode())
        return digest.hexdigest()[:16]
    path = Path(source).expanduser()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
    for f in files:
        digest.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        digest.update(file_sha256(f).digest())
    return digest.hexdigest()[:16] if files else f"missing-{digest.hexdigest()[:16]}"


def load_prompts(data_cfg, validate=None) -> PromptSet:
    """Load, validate and split the prompts of ``data_cfg`` (a ``DataConfig``).

    ``validate(rows, where, locations=None)`` is an extra check (e.g. the OCR reward needs a quoted span;
    ``rewards.prompt_validator``); ``locations[i]`` names row i's file and line. Its ``ValueError``
    becomes a ``PromptDataError``. Both splits must be non-empty and disjoint.
    """
    source = data_cfg.source
    stats: dict[str, int] = {}
    if source in BUILTIN_SOURCES or source.startswith(f"{EDIT_SOURCE}:"):
        train, test = _generated(source, data_cfg)
        train = [resolve_row_image(r, f"{source} (train) row {i}") for i, r in enumerate(train, start=1)]
        test = [resolve_row_image(r, f"{source} (test) row {i}") for i, r in enumerate(test, start=1)]
        _validate(validate, train, f"{source} (train)")
        _validate(validate, test, f"{source} (test)")
    elif source.startswith("builtin:"):
        raise PromptDataError(f"unknown built-in prompt generator {source!r}; use {', '.join(BUILTIN_SOURCES)}")
    else:
        path = _local_path(source)
        if path.is_dir():
            train, test = _read_split_folder(path, source, stats, validate)
        else:
            located = clean_rows(resolve_row_images(read_file(path, source), image_base(source, path), source), stats)
            check_image_rows(located)
            if len(located) < 2:
                raise PromptDataError(f"{source}: {_too_few(len(located), stats)}")
            _validate(validate, [r for _, r in located], source, [w for w, _ in located])
            train, test = split_rows([r for _, r in located], data_cfg.test_fraction, data_cfg.seed)
    _check_splits(source, train, test, data_cfg.test_fraction)
    stats.update(train=len(train), test=len(test), blank=stats.get("blank", 0), duplicate=stats.get("duplicate", 0))
    if stats["blank"] or stats["duplicate"]:
        log.warning("%s: dropped %d blank and %d duplicate prompts", source, stats["blank"], stats["duplicate"])
    return PromptSet(train=train, test=test, source=source, stats=stats)


BUILTIN_SOURCES = ("builtin:objects", "builtin:ocr", "builtin:shapes", EDIT_SOURCE)


def _generated(source: str, cfg) -> tuple[list[dict], list[dict]]:
    """The train and test rows of a built-in generator (``cfg``: the ``DataConfig``)."""
    if source == "builtin:objects":
        return split_rows(generate_object_prompts(cfg.num_prompts, cfg.seed), cfg.test_fraction, cfg.seed)
    if source.startswith(EDIT_SOURCE):
        return generate_edit_prompts(source, cfg.num_prompts, cfg.seed, cfg.test_fraction)
    from .ocr import generate_ocr_prompts
    from .shapes import generate_shape_prompts
    generate = generate_ocr_prompts if source == "builtin:ocr" else generate_shape_prompts
    return generate(cfg.num_prompts, cfg.seed, cfg.test_fraction)


def _local_path(source: str) -> Path:
    """A local path for ``source``: downloaded from the hub or an object store, else the path itself."""
    if source.startswith("hf://datasets/"):
        return hf_download(source)
    if "://" in source:
        return _fsspec_download(source)
    return Path(source).expanduser()


def _too_few(kept: int, stats: dict[str, int]) -> str:
    """Why ``kept`` (< 2) usable prompts are not enough, counting what was dropped."""
    dropped = [f"{stats[k]} {k}" for k in ("blank", "duplicate") if stats.get(k)]
    why = f" ({' and '.join(dropped)} rows dropped)" if dropped else ""
    what = "no prompts" if kept == 0 else "only 1 prompt"
    return f"{what}{why}; at least 2 are needed, one to train on and one held out for evaluation"


def _validate(validate, rows: list[dict], where: str, locations: list[str] | None = None) -> None:
    """Run the reward's prompt check; its ``ValueError`` is a ``PromptDataError``."""
    if validate is None or not rows:
        return
    try:
        if locations is not None and "locations" in inspect.signature(validate).parameters:
            validate(rows, where, locations=locations)
        else:
            validate(rows, where)
    except PromptDataError:
        raise
    except ValueError as exc:
        raise PromptDataError(str(exc)) from exc


def _check_splits(source: str, train: list[dict], test: list[dict], test_fraction: float) -> None:
    """Both splits non-empty and disjoint (what every source must give; the readers see to most of it)."""
    if not train or not test:
        empty, other = ("training", test) if not train else ("test", train)
        raise PromptDataError(
            f"{source}: the {empty} split is empty: all {len(other)} prompts fell on the other side at "
            f"data.test_fraction={test_fraction}; change it"
        )
    both = {row_key(r) for r in train} & {row_key(r) for r in test}
    if both:
        example = sorted(both)[0].split(IMAGE_KEY_SEPARATOR)[0]
        raise PromptDataError(f"{source}: {len(both)} prompts are in both splits, e.g. {example!r}")


def _read_split_folder(folder: Path, name: str, stats: dict[str, int], validate=None) -> tuple[list[dict], list[dict]]:
    """The given split of a folder: exactly one ``train`` and one ``test`` file of any supported kind.
    Test rows that repeat a training prompt are dropped as duplicates; each split must keep a row."""
    files = {split: sorted(p for p in folder.iterdir() if p.stem == split and p.suffix.lower() in READERS)
             for split in ("train", "test")}
    for split, other in (("train", "test"), ("test", "train")):
        found = files[split]
        if not found:
            beside = f" beside {files[other][0].name}" if files[other] else ""
            raise PromptDataError(
                f"{name}: no {split} split in this folder; put one of {', '.join(split + k for k in READERS)}{beside}"
            )
        if len(found) > 1:
            raise PromptDataError(f"{name}: {' and '.join(p.name for p in found)} are both {split} splits; keep one")
    seen: set[str] = set()
    splits = []
    kept: list[tuple[str, dict]] = []  # both files' rows: an image on every row or on none (check_image_rows)
    for split, (path,) in files.items():
        where = f"{name.rstrip('/')}/{path.name}"
        split_stats: dict[str, int] = {}
        rows = read_file(path, where)
        located = clean_rows(resolve_row_images(rows, folder, where), split_stats, seen)
        for k, v in split_stats.items():
            stats[k] = stats.get(k, 0) + v
        if not located:
            dup = split_stats.get("duplicate", 0)
            why = (f": its {len(rows)} rows are blank or repeat training prompts ({dup} duplicates)" if dup
                   else f": it has {len(rows)} rows, all blank" if rows else ": the file is empty")
            raise PromptDataError(f"{where}: the {split} split is empty{why}")
        kept += located
        check_image_rows(kept)
        _validate(validate, [r for _, r in located], where, [w for w, _ in located])
        splits.append([r for _, r in located])
    return splits[0], splits[1]


class _Stream:
    """One list of rows as an endless stream of epoch-wise permutations seeded by ``(*seed, epoch)``."""

    def __init__(self, rows: list[dict], seed: tuple[int, ...]):
        self.rows = rows
        self.seed = seed
        self._perm_epoch: int | None = None
        self._perm_cache = np.empty(0, dtype=np.int64)

    def __getitem__(self, pos: int) -> dict:
        epoch, offset = divmod(pos, len(self.rows))
        if self._perm_epoch != epoch:  # a step spans at most two epochs: keep the current one
            self._perm_cache = np.random.default_rng([*self.seed, epoch]).permutation(len(self.rows))
            self._perm_epoch = epoch
        return self.rows[int(self._perm_cache[offset])]


class PromptSampler:
    """Which prompts a step uses: epoch-wise permutations seeded by (seed, epoch).

    Step ``s`` takes the next ``per_step`` prompts of the stream, so the choice depends only on
    the step number: a resumed run sees exactly the prompts the uninterrupted one would have.

    ``balance_by`` (``data.balance_by``, a row field such as ``category``): the stream visits the field's
    values in turn (sorted), each value's rows in their own seeded permutations, so every value gets the
    same share of the steps' prompts however many rows it has (GenEval's score is the mean over its
    categories; the shapes world has 72 ``color_attr`` prompts and 3 ``single`` ones).
    """

    def __init__(self, rows: list[dict], per_step: int, seed: int, balance_by: str = ""):
        if not rows:
            raise ValueError("PromptSampler needs at least one prompt")
        self.rows = rows
        self.per_step = per_step
        self.seed = seed
        if not balance_by:
            self._streams = [_Stream(rows, (seed,))]
            return
        missing = [i for i, r in enumerate(rows) if r.get(balance_by) in (None, "")]
        if missing:
            raise PromptDataError(
                f"data.balance_by={balance_by!r}: {len(missing)} of {len(rows)} training rows have no "
                f"{balance_by!r} field (the first: row {missing[0]}, {rows[missing[0]].get('prompt', '')!r})")
        values = sorted({str(r[balance_by]) for r in rows})
        self._streams = [_Stream([r for r in rows if str(r[balance_by]) == v], (seed, k, 1))
                         for k, v in enumerate(values)]

    def batch(self, step: int) -> tuple[list[dict], int]:
        """The rows of ``step`` and the data cursor after it."""
        k = len(self._streams)
        start = step * self.per_step
        out = [self._streams[pos % k][pos // k] for pos in range(start, start + self.per_step)]
        return out, start + self.per_step
