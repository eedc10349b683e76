"""The user-error types: mistakes in what a user gave (a config, prompt data), not bugs.

Every such error is a ``UserError`` whose message is one line that names the file, line or
config key and says what to change. The CLIs (``python -m diffusionrl.train``, ``python -m
diffusionrl.config``) print that line alone and exit with status 2; the Flyte tasks raise the same
errors with the same text, without the library frames below the task (``tasks.common.user_errors``).
Anything else that escapes is a bug and keeps its traceback, but for the file system refusing a file (no
permission, a read-only file system, a full disk or quota): ``filesystem_error`` turns that ``OSError`` into a
``FileSystemError`` naming the path and the fix, which the CLIs (``run_cli``) and the Flyte tasks report as a
``UserError``; ``naming(path)`` gives the path to such an error raised without one (a write to an open file).

This module imports nothing, so every part of the library (and ``diffusionrl.config.tree``, which
imports no schema) can use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from collections.abc import Callable, Iterator

__all__ = ["EXIT_USER_ERROR", "FileSystemError", "UserError", "filesystem_error", "naming", "run_cli"]

EXIT_USER_ERROR = 2  # the exit status of a CLI that stopped on a UserError (argparse uses 2 too)


class UserError(ValueError):
    """A mistake in the user's input; ``kind`` prefixes the CLI's one-line report."""

    kind = "error"

    def __init__(self, message: str):
        # One line, whatever the parts it was built from held (a prompt with a newline, an OS error).
        super().__init__(" ".join(str(message).split("\n")))

    def report(self) -> str:
        """The line a CLI prints: ``<kind>: <message>``."""
        return f"{self.kind}: {self}"


class FileSystemError(UserError):
    """The file system refused a file the run reads or writes: no permission, read-only, full (or over quota)."""

    kind = "file system error"


_PERMISSION = ("this user (uid {uid}) may not use it; change its permissions or owner (chmod, chown), or use "
               "another path")
_FIXES = {
    errno.EACCES: _PERMISSION,
    errno.EPERM: _PERMISSION,
    errno.EROFS: "the file system is read-only; use a folder on a writable one (--out, checkpoint_dir)",
    errno.ENOSPC: "free some space there (older runs; fewer checkpoints kept: train.keep_checkpoints) or use a folder "
                  "on another disk, then run again: a run resumes from its last complete checkpoint",
    errno.EDQUOT: "this user's disk quota is used up; free some space there (older runs; fewer checkpoints kept: "
                  "train.keep_checkpoints) or use another folder, then run again: a run resumes from its last "
                  "complete checkpoint",
}
_RUST_IO = re.compile(r"\(os error (\d+)\)(?: at path \"([^\"]*)\")?")  # safetensors' I/O errors


def filesystem_error(exc: BaseException, path: str | os.PathLike | None = None) -> FileSystemError | None:
    """The one-line ``FileSystemError`` of ``exc`` when it is the file system refusing a file (``EACCES``,
    ``EPERM``, ``EROFS``, ``ENOSPC``, ``EDQUOT``; an ``OSError``, or a library's error that wraps one, such
    as safetensors' ``... (os error 28) at path "..."``), naming the file (``exc``'s, else ``path``) and
    the fix; None for any other error."""
    code, name = (exc.errno, exc.filename) if isinstance(exc, OSError) else (None, None)
    if code is None and not isinstance(exc, OSError):
        found = _RUST_IO.search(str(exc))
        code, name = (int(found.group(1)), found.group(2)) if found else (None, None)
    if code not in _FIXES:
        return None
    # an OSError's own file, else path; a library's (safetensors names its temporary file) only without path
    where = name if name not in (None, "") and (isinstance(exc, OSError) or path is None) else path
    fix = _FIXES[code].format(uid=os.getuid() if hasattr(os, "getuid") else "?")
    return FileSystemError(f"{where if where is not None else 'a file'}: {os.strerror(code)}; {fix}")


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Inside: a file system refusal (``filesystem_error``) is raised as a ``FileSystemError`` naming the
    file it names, else ``path`` (a write to an open file, a flush, a library's own I/O name none)."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        err = filesystem_error(exc, path)
        if err is None:
            raise
        raise err from exc


def run_cli(body: Callable[[], int | None]) -> int:
    """A CLI's exit status: ``body()``'s (0 for None), or ``EXIT_USER_ERROR`` after printing a
    ``UserError``, or a file system refusal as its ``FileSystemError`` (``filesystem_error``), as its one
    line on stderr. Other exceptions propagate with their traceback."""
    try:
        return body() or 0
    except UserError as exc:
        print(exc.report(), file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as exc:
        err = filesystem_error(exc)
        if err is None:
            raise
        print(err.report(), file=sys.stderr)
        return EXIT_USER_ERROR
