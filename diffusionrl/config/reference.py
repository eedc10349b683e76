"""The configuration reference, generated from the code: every key of both config trees with its type,
default and help text, grouped by section, and the image presets.

``python -m diffusionrl.config --reference`` prints it; ``docs/config.md`` is its output, and
``tests/test_config_reference.py`` fails when the two differ (regenerate with
``python -m diffusionrl.config --reference > docs/config.md``). Everything here is read from the
dataclasses (``option`` help texts, type hints with their pydantic constraints, defaults), the
objectives' records and the presets, so a key added with its help text appears without an edit here.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any

import yaml

from .tree import ConfigTree, _hints

# What each section holds, in a line (the keys themselves carry the detail).
IMAGE_SECTIONS = {
    "model": "The base model (a builtin, a diffusers folder or a hub id), its device and dtype, and the LoRA.",
    "sampling": "How rollouts are sampled: resolution, steps, guidance, the SDE and which steps are stochastic, "
                "the rollout engine.",
    "algorithm": "The objective (`algorithm.name`) and its settings: first the keys several objectives read, then "
                 "each objective's own.",
    "reward": "Which rewards, their weights, and where they run (in process or Ray CPU actors).",
    "train": "The optimisation loop: batch layout, learning rate and schedule, precision, EMA, checkpoints, ranks "
             "and placement.",
    "eval": "Held-out evaluation, the probes every `eval.every` steps, and how the registry picks its champion.",
    "data": "Where prompts come from and how they are split and sampled.",
    "tracking": "MLflow: the store, the experiment and the registered model.",
}
BDLM_SECTIONS = {
    "model": "The block-diffusion LM (builtin or folder/hub id) and how it decodes.",
    "task": "The verifiable task and its splits.",
    "warm_start": "The masked-diffusion supervised stage before RL.",
    "grpo": "RL on exact traces: the objective and its settings.",
    "eval": "Held-out evaluation.",
    "tracking": "MLflow: the store, the experiment and the registered model.",
}

_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def type_name(tp: Any) -> str:
    """A type hint as a reader writes it: ``int > 0``, ``"a" | "b"``, ``list[str]``, ``dict[str, float]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin is Annotated:
        bounds = [f"{_BOUNDS[k]} {getattr(m, k)}" for m in args[1:] for k in _BOUNDS if hasattr(m, k)]
        return " ".join([type_name(args[0]), *bounds])
    if args:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def default_text(value: Any) -> str:
    """A default as it is written in a YAML config file or a ``--set key=value``."""
    if isinstance(value, float):
        return repr(value)  # 1e-06, not YAML's 1.0e-06
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _owners(section_cls: type) -> dict[str, type]:
    """Each field of ``section_cls`` -> the class in its MRO that declares it (its own annotation)."""
    out: dict[str, type] = {}
    for klass in reversed(section_cls.__mro__):
        for name in vars(klass).get("__annotations__", {}):
            out[name] = klass
    return out


def _rows(section: str, section_cls: type, names: list[str] | None = None) -> list[str]:
    hints, by_name = _hints(section_cls), {f.name: f for f in dataclasses.fields(section_cls)}
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name in names if names is not None else list(by_name):
        f = by_name[name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        kind = type_name(hints[name]) + (" (inf allowed)" if f.metadata.get("allow_inf") else "")
        lines.append(f"| `{section}.{name}` | `{_cell(kind)}` | `{_cell(default_text(default))}` | "
                     f"{_cell(f.metadata.get('help', ''))} |")
    return lines


def _algorithm_groups(section_cls: type) -> list[tuple[str, list[str]]]:
    """The ``algorithm`` keys grouped by who reads them: the shared ones, then each objective's own."""
    from .objectives import OBJECTIVES

    owner_of = {o.options: o.name for o in OBJECTIVES if o.options is not None}
    owners = _owners(section_cls)
    groups: dict[str, list[str]] = {}
    for f in dataclasses.fields(section_cls):
        name = owner_of.get(owners[f.name])
        title = f"`{name}`'s own keys" if name else "Keys several objectives read"
        groups.setdefault(title, []).append(f.name)
    return list(groups.items())


def _tree(tree: type[ConfigTree], intros: dict[str, str], level: str) -> list[str]:
    lines: list[str] = []
    for section, section_cls in tree.sections().items():
        lines += ["", f"{level} `{section}`", ""]
        if intros.get(section):
            lines += [intros[section], ""]
        if section_cls.__name__ == "AlgorithmConfig":
            for title, names in _algorithm_groups(section_cls):
                lines += [f"{title}:", "", *_rows(section, section_cls, names), ""]
            lines.pop()
        else:
            lines += _rows(section, section_cls)
    top = [f for f in dataclasses.fields(tree) if f.name not in tree.sections()]
    if top:
        lines += ["", f"{level} top level", "", *_rows("", tree, [f.name for f in top])]
        lines = [line.replace("| `.", "| `") for line in lines]
    return lines


def _presets() -> list[str]:
    from .presets import PRESETS
    from .root import get_preset

    lines = ["| preset | `model.name` | `algorithm.name` | `reward.weights` | `data.source` | `sampling.resolution` "
             "| `train.world_size` | `model.device` |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in PRESETS:
        c = get_preset(name)
        cells = [c.model.name, c.algorithm.name, default_text(c.reward.weights), c.data.source,
                 c.sampling.resolution, c.train.world_size, c.model.device]
        lines.append(f"| `{name}` | " + " | ".join(f"`{_cell(v)}`" for v in cells) + " |")
    return lines


def reference() -> str:
    """The whole reference as Markdown (what ``docs/config.md`` holds)."""
    from diffusionrl.bdlm.config import PRESETS as BDLM_PRESETS
    from diffusionrl.bdlm.config import BDLMConfig

    from .root import Config

    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m diffusionrl.config --reference > docs/config.md`; do not edit by hand "
        "(tests/test_config_reference.py checks it). -->",
        "",
        "Every key of the two config trees, with its type, its schema default and its help text. A run starts "
        "from a preset, which changes some of these defaults: `python -m diffusionrl.config --preset NAME` prints "
        "a preset's full tree (`configs/NAME.yaml` holds each one). A config file holds the keys it changes; "
        "`--set section.key=value` (`--overrides '[\"section.key=value\"]'` for `pyflyte run`) changes one. "
        "Values are written as in YAML. Types: `int > 0` and the like are bounds the config checks; "
        "`\"a\" | \"b\"` lists the accepted values.",
        "",
        "- [Image runs](#image-runs-config-workflowsgrpopy): "
        + ", ".join(f"[`{s}`](#{s})" for s in Config.sections()) + ", [presets](#image-presets)",
        "- [Block-diffusion LM runs](#block-diffusion-lm-runs-bdlmconfig-workflowsbdlmpy)",
        "",
        "## Image runs (`Config`, `workflows/grpo.py`)",
        "",
        "`python -m diffusionrl.train --preset NAME`, `pyflyte run workflows/grpo.py grpo --config FILE`.",
        *_tree(Config, IMAGE_SECTIONS, "###"),
        "",
        "### Image presets",
        "",
        "Each preset's main settings (`diffusionrl/config/presets.py`: the tiny CPU ones in `presets_tiny.py`, "
        "the GPU recipes in `presets_gpu.py`); its full tree is `configs/<preset>.yaml`.",
        "",
        *_presets(),
        "",
        "## Block-diffusion LM runs (`BDLMConfig`, `workflows/bdlm.py`)",
        "",
        "`pyflyte run workflows/bdlm.py bdlm --config FILE`; presets: "
        + ", ".join(f"`{n}`" for n in BDLM_PRESETS) + " (`diffusionrl/bdlm/config.py`; the model and the "
        "task: `docs/bdlm.md`).",
        *_tree(BDLMConfig, BDLM_SECTIONS, "###"),
    ]
    return "\n".join(lines) + "\n"
