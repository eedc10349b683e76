"""``python -m diffusionrl.config`` (``__main__``): ``--preset NAME [--config FILE] [--set k=v ...]`` prints
the full config as YAML (how ``configs/*.yaml`` are made); ``--reference`` prints every key of both config
trees with its type, default and help text as Markdown (``docs/config.md``, ``reference``).

It sits apart from ``root`` because the reference reads ``bdlm.config``, which builds on this package:
the package itself never imports the CLI."""

from __future__ import annotations

import argparse

from diffusionrl.errors import run_cli

from .presets import PRESETS
from .reference import reference
from .root import dump_preset


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and print the preset's YAML or the reference; the exit status (2: one-line error)."""
    ap = argparse.ArgumentParser(prog="python -m diffusionrl.config")
    ap.add_argument("--preset", default="tiny-cpu", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--config", default=None, help="YAML/JSON file applied over the preset")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--reference", action="store_true",
                    help="print every key of both config trees (type, default, help) as Markdown: docs/config.md")
    args = ap.parse_args(argv)
    if args.reference:
        return run_cli(lambda: print(reference(), end=""))
    return run_cli(lambda: print(dump_preset(args.preset, args.config, args.overrides), end=""))
