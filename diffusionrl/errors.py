"""The user-error types: mistakes in what a user gave (a config, prompt data), not bugs.

Every such error is a ``UserError`` whose message is one line that names the file, line or
config key and says what to change. The CLIs (``python -m diffusionrl.train``, ``python -m
diffusionrl.config``) print that line alone and exit with status 2; the Flyte tasks raise the same
errors with the same text, without the library frames below the task (``tasks.common.user_errors``).
Anything else that escapes is a bug and keeps its traceback.

This module imports nothing, so every part of the library (and ``diffusionrl.config.tree``, which
imports no schema) can use it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["EXIT_USER_ERROR", "UserError", "run_cli"]

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


def run_cli(body: Callable[[], int | None]) -> int:
    """A CLI's exit status: ``body()``'s (0 for None), or ``EXIT_USER_ERROR`` after printing a
    ``UserError`` as its one line on stderr. Other exceptions propagate with their traceback."""
    try:
        return body() or 0
    except UserError as exc:
        print(exc.report(), file=sys.stderr)
        return EXIT_USER_ERROR
