"""The prompt file readers (``.txt``, ``.jsonl``, ``.parquet``) and ``PromptDataError``.

Each reader gives ``(where, row)`` pairs, ``where`` naming the file and line (or Parquet row), so a
malformed row, and any later check of it, raises a ``PromptDataError`` that names them. A file's bad rows are
reported together, in one error listing up to ``MAX_REPORTED`` of them (``BadRows``): one run shows them all.
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


MAX_REPORTED = 20  # the bad rows one PromptDataError lists (it counts the others)


class BadRows:
    """The bad rows of a file, gathered so that one ``PromptDataError`` lists them all (the first
    ``MAX_REPORTED``, and how many more), instead of one run per bad row."""

    def __init__(self, name: str):
        self.name = name
        self.messages: list[str] = []
        self.count = 0

    def add(self, exc: PromptDataError) -> None:
        self.count += 1
        if len(self.messages) < MAX_REPORTED:
            self.messages.append(str(exc))

    def check(self) -> None:
        """Raise the one error, if any row was bad (a single bad row: its own message)."""
        if self.count == 1:
            raise PromptDataError(self.messages[0])
        if self.count:
            more = f"; and {self.count - len(self.messages)} more" if self.count > len(self.messages) else ""
            raise PromptDataError(f"{self.name}: {self.count} bad rows, fix them all: {'; '.join(self.messages)}{more}")


def _row(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise PromptDataError(f"{where}: expected a JSON object with a 'prompt' field, got {type(obj).__name__}")
    if "prompt" not in obj:
        raise PromptDataError(f"{where}: missing the 'prompt' field (keys: {sorted(obj)})")
    if not isinstance(obj["prompt"], str):
        raise PromptDataError(f"{where}: 'prompt' must be a string, got {type(obj['prompt']).__name__}")
    return dict(obj)


def _text(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")  # a byte-order mark opens line 1 only
    except UnicodeDecodeError as exc:
        raise PromptDataError(f"{where}: not valid UTF-8 ({exc.reason})") from exc


def read_txt(path: Path, name: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    name = name or str(path)
    bad, rows = BadRows(name), []
    text = path.read_bytes().decode("utf-8", errors="surrogateescape")  # bad bytes kept, to report per line
    for i, line in enumerate(text.splitlines(), start=1):  # the lines str.splitlines cuts, as before
        raw = line.encode("utf-8", errors="surrogateescape")
        try:
            rows.append((f"{name}:{i}", {"prompt": _text(raw, f"{name}:{i}", i == 1)}))
        except PromptDataError as exc:
            bad.add(exc)
    bad.check()
    return rows


def _json_error(exc: json.JSONDecodeError) -> str:
    """``Expecting value at column 3``; json's "Unterminated string starting at" ends in its own "at"."""
    msg = exc.msg[: -len(" at")] if exc.msg.endswith(" at") else exc.msg
    return f"{msg} at column {exc.colno}"


def read_jsonl(path: Path, name: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    name = name or str(path)
    bad, rows = BadRows(name), []
    with path.open("rb") as fh:
        for i, raw in enumerate(fh, start=1):
            where = f"{name}:{i}"
            try:
                text = _text(raw, where, i == 1)
                if not text.strip():
                    rows.append((where, {"prompt": ""}))  # counted as blank
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise PromptDataError(f"{where}: invalid JSON ({_json_error(exc)})") from exc
                rows.append((where, _row(obj, where)))
            except PromptDataError as exc:
                bad.add(exc)
    bad.check()
    return rows


def read_parquet(path: Path, name: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    name = name or str(path)
    table = pq.read_table(path)
    if "prompt" not in table.column_names:
        raise PromptDataError(f"{name}: no 'prompt' column (columns: {table.column_names})")
    bad, rows = BadRows(name), []
    for i, obj in enumerate(table.to_pylist(), start=1):
        where = f"{name}: row {i}"
        if obj.get("prompt") is None:
            obj["prompt"] = ""
        try:
            rows.append((where, _row(obj, where)))
        except PromptDataError as exc:
            bad.add(exc)
    bad.check()
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
