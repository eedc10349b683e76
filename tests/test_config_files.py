"""``configs/*.yaml`` are the dumps of the presets: one file per preset, each byte for byte what
``python -m diffusionrl.config --preset NAME`` prints today."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from diffusionrl.config import PRESETS
from diffusionrl.config.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _regenerate(name: str) -> str:
    return f"python -m diffusionrl.config --preset {name} > configs/{name}.yaml"


def test_every_preset_has_a_file_and_every_file_a_preset():
    files = {path.stem for path in CONFIGS.glob("*.yaml")}
    problems = [f"preset {name!r} has no configs/{name}.yaml; write it with `{_regenerate(name)}`"
                for name in sorted(set(PRESETS) - files)]
    problems += [f"configs/{name}.yaml has no preset {name!r} in diffusionrl/config/presets.py; add the preset or "
                 "delete the file" for name in sorted(files - set(PRESETS))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_file_is_the_dump_of_its_preset(name, capsys):
    path = CONFIGS / f"{name}.yaml"
    if not path.is_file():
        pytest.fail(f"preset {name!r} has no configs/{name}.yaml; write it with `{_regenerate(name)}`")
    capsys.readouterr()
    assert main(["--preset", name]) == 0
    dumped = capsys.readouterr().out
    stored = path.read_text()
    if stored != dumped:
        diff = "".join(difflib.unified_diff(
            stored.splitlines(keepends=True), dumped.splitlines(keepends=True),
            fromfile=f"configs/{name}.yaml", tofile=f"python -m diffusionrl.config --preset {name}",
        ))
        pytest.fail(f"configs/{name}.yaml differs from the dump of preset {name!r}. If the preset changed on "
                    f"purpose, regenerate the file with `{_regenerate(name)}`:\n{diff}", pytrace=False)
