"""The prompt file readers (``.txt``, ``.jsonl``, ``.parquet``) and ``PromptDataError``.

Each reader gives ``(where, row)`` pairs, ``where`` naming the file and line (or Parquet row), so a
malformed row, and any later check of it, raises a ``PromptDataError`` that names them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffusionrl.errors import UserError


class PromptDataError(UserError):
    """Prompt data that cannot be used: a malformed row (the message names the file and line), a
    missing file, a split that is missing or empty."""

    kind = "prompt data error"


def _row(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise PromptDataError(f"{where}: expected a JSON object with a 'prompt' field, got {type(obj).__name__}")
    if "prompt" not in obj:
        raise PromptDataError(f"{where}: missing the 'prompt' field (keys: {sorted(obj)})")
    if not isinstance(obj["prompt"], str):
        raise PromptDataError(f"{where}: 'prompt' must be a string, got {type(obj['prompt']).__name__}")
    return dict(obj)


def read_txt(path: Path, name: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    name = name or str(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # -sig: a leading byte-order mark is dropped
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise PromptDataError(f"{name}:{line}: not valid UTF-8 ({exc.reason})") from exc
    return [(f"{name}:{i}", {"prompt": line}) for i, line in enumerate(lines, start=1)]


def read_jsonl(path: Path, name: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    name = name or str(path)
    rows = []
    with path.open("rb") as fh:
        for i, raw in enumerate(fh, start=1):
            where = f"{name}:{i}"
            try:
                text = raw.decode("utf-8-sig" if i == 1 else "utf-8")  # a byte-order mark opens line 1 only
            except UnicodeDecodeError as exc:
                raise PromptDataError(f"{where}: not valid UTF-8 ({exc.reason})") from exc
            if not text.strip():
                rows.append((where, {"prompt": ""}))  # counted as blank
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PromptDataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            rows.append((where, _row(obj, where)))
    return rows


def read_parquet(path: Path, name: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    name = name or str(path)
    table = pq.read_table(path)
    if "prompt" not in table.column_names:
        raise PromptDataError(f"{name}: no 'prompt' column (columns: {table.column_names})")
    rows = []
    for i, obj in enumerate(table.to_pylist(), start=1):
        where = f"{name}: row {i}"
        if obj.get("prompt") is None:
            obj["prompt"] = ""
        rows.append((where, _row(obj, where)))
    return rows


def hf_download(source: str) -> Path:
    """``hf://datasets/<owner>/<repo>/<path>[@revision]`` -> local file (uses HF_TOKEN)."""
    from huggingface_hub import hf_hub_download

    from diffusionrl.hub import hf_token

    spec = source[len("hf://datasets/") :]
    revision = None
    if "@" in spec:
        spec, revision = spec.rsplit("@", 1)
    parts = spec.split("/")
    if len(parts) < 3:
        raise PromptDataError(f"{source}: expected hf://datasets/<owner>/<repo>/<path>")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    return Path(
        hf_hub_download(repo_id, filename, repo_type="dataset", revision=revision, token=hf_token())
    )


READERS = {".txt": read_txt, ".jsonl": read_jsonl, ".parquet": read_parquet}


def read_file(path: Path, name: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` pairs of a prompt file, ``where`` naming its file and line (or Parquet row)."""
    if not path.exists():
        raise PromptDataError(f"no such file or folder: {name or path}")
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise PromptDataError(
            f"{name or path}: unsupported prompt file type {path.suffix!r}; use .txt, .jsonl or .parquet "
            "(or a folder holding a train and a test file of those kinds)"
        )
    if not path.is_file():
        raise PromptDataError(f"{name or path}: not a file")
    return reader(path, name)
