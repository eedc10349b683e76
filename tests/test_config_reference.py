"""docs/config.md is what ``python -m diffusionrl.config --reference`` prints now: every key of both config
trees with its type, default and help text. A key added, removed or re-documented without regenerating the
file fails here, with the command that fixes it."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from diffusionrl.bdlm.config import BDLMConfig
from diffusionrl.config import Config
from diffusionrl.config.cli import main
from diffusionrl.config.reference import default_text, type_name

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
FIX = "python -m diffusionrl.config --reference > docs/config.md"


def test_committed_reference_is_what_the_command_prints(capsys):
    assert main(["--reference"]) == 0
    printed = capsys.readouterr().out
    committed = DOC.read_text()
    if printed != committed:
        diff = "\n".join(list(difflib.unified_diff(committed.splitlines(), printed.splitlines(), "docs/config.md",
                                                   "--reference", lineterm="", n=0))[:40])
        raise AssertionError(f"docs/config.md is out of date; regenerate it: {FIX}\n{diff}")


def test_every_key_is_documented_with_its_type_default_and_help():
    image, bdlm = DOC.read_text().split("\n## Block-diffusion LM runs", 1)
    for tree, text in ((Config, image), (BDLMConfig, bdlm)):
        for section, cls in tree.sections().items():
            for f in dataclasses.fields(cls):
                row = next((line for line in text.splitlines() if line.startswith(f"| `{section}.{f.name}` |")), None)
                assert row is not None, f"{tree.__name__}: {section}.{f.name} is missing from docs/config.md ({FIX})"
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                assert f"`{default_text(default)}`" in row.replace("\\|", "|"), row
                assert f.metadata.get("help"), f"{section}.{f.name} has no help text: give its option(...) one"


def test_types_read_as_a_user_writes_them():
    from typing import Literal

    from pydantic import NonNegativeFloat, PositiveInt

    assert type_name(PositiveInt) == "int > 0"
    assert type_name(NonNegativeFloat) == "float >= 0"
    assert type_name(Literal["a", "b"]) == '"a" | "b"'
    assert type_name(dict[str, float]) == "dict[str, float]"
    assert default_text(1e-6) == "1e-06" and default_text([0, 5]) == "[0, 5]" and default_text("") == "''"
