"""The configuration of an image run: the ``Config`` tree, its sections, presets and loader.

- ``root``: ``Config`` (the sections assembled, cross-section checks), ``load_config`` /
  ``get_preset`` / ``dump_preset``;
- ``cli``: ``python -m diffusionrl.config --preset NAME`` (``__main__``), which prints the full config
  as YAML (how ``configs/*.yaml`` are made), and ``--reference`` (``reference``: ``docs/config.md``);
- ``sections``: the sections (``model``, ``sampling``, ``algorithm``, ``reward``, ``train``, ``eval``,
  ``data``, ``tracking``), every default with its help text and its one-section checks;
- ``objectives``: one block per objective (its own ``algorithm.*`` keys, flags and checks, its record
  in ``OBJECTIVES``) and ``check_objective_fit``;
- ``presets``: ``PRESETS``, the named presets as change sets over the defaults (data only, no schema), from
  ``presets_tiny`` (every ``tiny-cpu*`` preset, over ``TINY_CPU``) and ``presets_gpu`` (the GPU recipes);
- ``tree``: the schema-free machinery ``Config`` and ``bdlm.BDLMConfig`` share (``option`` fields,
  checks, the dict round trip, YAML/JSON files, dotted overrides, ``ConfigError``).

The schema (``root``, ``sections``) builds on ``tree``, ``objectives`` and ``presets``, never the
reverse. Everything other modules import is re-exported here.
"""

from .objectives import ALGORITHMS, RANKED, objective, resolved_kl_space
from .presets import PRESETS
from .root import Config, describe, dump_preset, get_preset, load_config
from .sampling import SamplingConfig
from .sections import (
    AlgorithmConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    RewardConfig,
    TrackingConfig,
    TrainConfig,
)
from .tree import (
    ConfigError,
    ConfigTree,
    apply_overrides,
    check_constraints,
    lookup_preset,
    option,
    read_config_file,
)

__all__ = [
    "ALGORITHMS", "PRESETS", "RANKED", "AlgorithmConfig", "Config", "ConfigError", "ConfigTree",
    "DataConfig", "EvalConfig", "ModelConfig", "RewardConfig", "SamplingConfig", "TrackingConfig", "TrainConfig",
    "apply_overrides", "check_constraints", "describe", "dump_preset", "get_preset", "load_config", "lookup_preset",
    "objective", "option", "read_config_file", "resolved_kl_space",
]
