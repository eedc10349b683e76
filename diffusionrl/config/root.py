"""The typed configuration tree of an image run (``Config``) and its loader.

Every default lives once, in its section (``diffusionrl.config.sections``; ``sampling`` in
``diffusionrl.config.sampling``): ``model``, ``sampling``, ``algorithm``, ``reward``, ``train``,
``eval``, ``data`` and ``tracking``. Each field carries its
help text in ``metadata["help"]``. Presets are named configurations (``tiny-cpu``, ``sd35m-ocr``,
...; ``diffusionrl.config.presets``); a YAML/JSON file and dotted ``key=value`` overrides are applied on
top of a preset (any partial tree is laid over the preset its ``preset`` key names). Unknown keys,
non-finite numbers and inconsistent settings are rejected with a one-line ``ConfigError`` that names
the key and says what to change.

The tree is kept plain (str/int/float/bool/list/dict leaves, no Optional dataclasses) so that it
travels as a Flyte dataclass input and the Flyte console can show it with its defaults. The generic
machinery is ``diffusionrl.config.tree``; the CLI that prints a preset's full config as YAML is
``diffusionrl.config.cli``.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import yaml

from . import sections as sec  # the sections, each named once below: Config's fields
from .objectives import check_objective_fit
from .presets import preset_changes
from .sampling import SamplingConfig
from .tree import (
    ConfigError,
    ConfigTree,
    apply_overrides,
    check_constraints,
    option,
    read_config_file,
)


@dataclass
class Config(ConfigTree):
    model: sec.ModelConfig = field(default_factory=sec.ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: sec.AlgorithmConfig = field(default_factory=sec.AlgorithmConfig)
    reward: sec.RewardConfig = field(default_factory=sec.RewardConfig)
    train: sec.TrainConfig = field(default_factory=sec.TrainConfig)
    eval: sec.EvalConfig = field(default_factory=sec.EvalConfig)
    data: sec.DataConfig = field(default_factory=sec.DataConfig)
    tracking: sec.TrackingConfig = field(default_factory=sec.TrackingConfig)
    preset: str = option("tiny-cpu", "Name of the preset this config started from (informational)")

    def __post_init__(self) -> None:
        check_constraints(self, "")
        check_objective_fit(self)
        check_champion_metric(self.eval.champion_metric, [f"{name}_" for name in self.reward.weights])
        if self.train.mixed_precision != "no" and self.model.device == "cpu":
            raise ConfigError(
                f"train.mixed_precision={self.train.mixed_precision} needs a GPU; set it to 'no' on CPU"
            )

    @classmethod
    def sections(cls) -> dict[str, type]:
        return SECTIONS

    @classmethod
    def preset_dict(cls, name: str) -> dict:
        return get_preset(name).to_dict()


def check_champion_metric(metric: str, prefixes: list[str], fixed: tuple[str, ...] = ("reward_mean",)) -> None:
    """``eval.champion_metric`` names a tuned-model figure of the evaluation summary: ``eval/`` then one of
    ``fixed`` or a figure starting with one of ``prefixes`` (the rewards'); never a base one."""
    name = metric.removeprefix("eval/")
    if metric.startswith("eval/") and not name.startswith("base_") and (
            name in fixed or any(name.startswith(p) and len(name) > len(p) for p in prefixes)):
        return
    options = ", ".join([f"eval/{f}" for f in fixed] + [f"eval/{p}..." for p in prefixes])
    raise ConfigError(f"eval.champion_metric={metric!r} names no figure of the tuned model's evaluation; "
                      f"use one of {options}")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config) if f.default_factory is not MISSING}


def get_preset(name: str) -> Config:
    """The named preset: its change sets (``diffusionrl.config.presets``) laid over the schema's defaults."""
    data = Config().to_dict()
    for changes in preset_changes(name):
        data = Config.merge_dicts(data, changes, f"preset {name}")
    data["preset"] = name
    return Config.from_dict(data, where=f"preset {name}")


def load_config(preset: str | None = None, file: str | Path | None = None,
                overrides: list[str] | None = None) -> Config:
    """The validated config: a preset, a file laid over it, then dotted overrides.

    Args:
        preset (`str`, *optional*, defaults to `None`): a preset name (``diffusionrl.config.PRESETS``);
            `None` takes the file's ``preset`` key, else ``tiny-cpu``.
        file (`str` or `Path`, *optional*, defaults to `None`): a YAML or JSON config file, a partial tree
            laid over the preset (``configs/*.yaml`` are complete ones).
        overrides (`list[str]`, *optional*, defaults to `None`): dotted ``key=value`` strings applied last,
            e.g. ``["train.learning_rate=1e-3", "sampling.num_steps=8"]``.

    Returns:
        `Config`: the config, every leaf type- and range-checked.

    Raises:
        `ConfigError`: in one line naming the key (an unknown key with the closest known one).

    Example::

        cfg = load_config("tiny-cpu-shapes", overrides=["train.steps=10"])
    """
    file_data = read_config_file(file) if file else {}
    name = preset or file_data.get("preset") or "tiny-cpu"
    data = get_preset(name).to_dict()
    if file_data:
        data = Config.merge_dicts(data, file_data, str(file))
    data["preset"] = name
    data = apply_overrides(data, overrides or [])
    return Config.from_dict(data, where=str(file) if file else "config")


def describe() -> str:
    """Every key with its default and help text (for --help-config)."""
    return Config.describe()


def dump_preset(preset: str, file: str | Path | None = None, overrides: list[str] | None = None) -> str:
    """The full config as commented YAML: what the CLI prints and ``configs/<preset>.yaml`` holds."""
    cfg = load_config(preset, file, overrides)
    return (
        f"# Full config of preset {preset} (generated: python -m diffusionrl.config --preset {preset}).\n"
        f"# Pass it to pyflyte run ... --config configs/{preset}.yaml; keys left out come from the 'preset' key's.\n"
        + yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    )

