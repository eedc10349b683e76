"""The machinery of a typed configuration tree, independent of any schema.

A tree is a dataclass of *sections* (dataclasses of plain leaves: str/int/float/bool/list/dict)
plus top-level leaves, mixed with :class:`ConfigTree`. This module gives it:

* fields with help text: :func:`option`; value checks for ``__post_init__``: :func:`check_choice`,
  :func:`check_positive`; one error type, :class:`ConfigError`;
* a dict round trip (``to_dict`` / ``from_dict``) in which unknown keys are rejected with a
  suggestion and leaves are type-checked against their annotations;
* dotted flattening (``flat``) and a content digest (``digest``);
* one merge of a partial dict over a full one (``ConfigTree.merge_dicts``), YAML/JSON files
  (:func:`read_config_file`) and dotted ``section.key=value`` overrides (:func:`apply_overrides`);
* a named-preset lookup that suggests the closest name (:func:`lookup_preset`) and the list of every
  key with its default and help text (``describe``).

``diffusionrl.config.Config`` (images) and ``diffusionrl.bdlm.BDLMConfig`` (block-diffusion LMs)
are built on it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
from dataclasses import field, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = [
    "ConfigError",
    "ConfigTree",
    "apply_overrides",
    "check_choice",
    "check_positive",
    "lookup_preset",
    "option",
    "read_config_file",
    "unknown_key_error",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent."""


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config option: a dataclass field with its default and its help text in ``metadata["help"]``
    (list and dict defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def check_choice(section: str, name: str, value: Any, choices: tuple) -> None:
    """Reject ``section.name=value`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not one of {list(choices)}")


def check_positive(section: str, name: str, value: float, allow_zero: bool = False) -> None:
    """Reject ``section.name=value`` unless ``value > 0`` (``>= 0`` with ``allow_zero``)."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{section}.{name}={value!r} must be {bound}")


def unknown_key_error(key: str, known: list[str], where: str) -> ConfigError:
    """The error for an unknown ``key`` in ``where``: the closest known key, else all of them."""
    hint = difflib.get_close_matches(key, known, n=1)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown key {key!r} in {where}{suggestion}")


def lookup_preset(presets: dict[str, T], name: str, what: str = "preset") -> T:
    """``presets[name]``, or an error that lists the known names and suggests the closest one."""
    if name not in presets:
        hint = difflib.get_close_matches(name, list(presets), n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else ""
        raise ConfigError(f"unknown {what} {name!r}; known presets: {', '.join(presets)}{extra}")
    return presets[name]


class ConfigTree:
    """What a config tree (``diffusionrl.config.Config``, ``diffusionrl.bdlm.BDLMConfig``) does with
    its sections: dict round trip with unknown-key checks, merging, dotted flattening, a digest."""

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Field name -> dataclass of each section."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, for MLflow params and logs."""
        out: dict[str, Any] = {}
        for section, values in self.to_dict().items():
            if isinstance(values, dict):
                out.update({f"{section}.{k}": v for k, v in values.items()})
            else:
                out[section] = values
        return out

    def digest(self) -> str:
        """Content digest of the config (sha256 of its canonical JSON), 16 hex chars."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config"):
        """The tree of a (full or partial) dict; missing keys take their defaults."""
        return _build(cls, data, where, cls.sections())

    @classmethod
    def merge_dicts(cls, base: dict[str, Any], update: dict[str, Any], where: str) -> dict[str, Any]:
        """A copy of ``base`` (a full dict of this tree) with the partial ``update`` laid over it:
        sections are merged key by key, every leaf (a dict-valued one such as ``reward.weights``
        too) is replaced whole. A key that ``base`` lacks is rejected, naming ``where``."""
        sections = cls.sections()
        out = copy.deepcopy(base)
        for key, value in update.items():
            if key not in out:
                raise unknown_key_error(key, list(out), where)
            if key in sections and isinstance(out[key], dict) and isinstance(value, dict):
                for leaf, leaf_value in value.items():
                    if leaf not in out[key]:
                        raise unknown_key_error(leaf, list(out[key]), f"{where}.{key}")
                    out[key][leaf] = copy.deepcopy(leaf_value)
            else:
                out[key] = copy.deepcopy(value)
        return out

    @classmethod
    def describe(cls) -> str:
        """Every key with its default and help text (for ``--help-config``)."""
        lines = []
        for section, section_cls in cls.sections().items():
            lines.append(f"[{section}]")
            for f in fields(section_cls):
                missing = f.default is dataclasses.MISSING
                default = f.default_factory() if missing else f.default  # type: ignore[misc]
                lines.append(f"  {section}.{f.name} = {default!r}  # {f.metadata.get('help', '')}")
        return "\n".join(lines)


def _build(cls: type, data: dict[str, Any], where: str, sections: dict[str, type] | None = None) -> Any:
    """``cls(**data)`` with unknown keys rejected and leaves coerced; ``sections`` are built recursively."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    known = [f.name for f in fields(cls)]
    types = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    sections = sections or {}
    for key, value in data.items():
        if key not in known:
            raise unknown_key_error(key, known, where)
        if key in sections:
            kwargs[key] = _build(sections[key], value, f"{where}.{key}")
        else:
            kwargs[key] = _coerce(value, types[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - defensive, names are checked above
        raise ConfigError(f"{where}: {exc}") from exc


def _coerce(value: Any, type_name: str, where: str) -> Any:
    """Check a leaf against its annotation (``float`` also takes ints and numeric strings like
    YAML's ``3e-4``); nested containers are checked by their outer type."""
    base = str(type_name).split("[")[0]
    if base == "float":
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    expected = {"int": int, "bool": bool, "str": str, "list": list, "dict": dict}.get(base)
    if expected is None:
        return value
    if expected is int and isinstance(value, bool) or not isinstance(value, expected):
        raise ConfigError(f"{where} must be of type {type_name}, got {value!r}")
    return value


def _parse_value(raw: str) -> Any:
    """A CLI override value: numbers (`3`, `1e-4`), YAML scalars/lists/maps (`true`, `[0, 5]`, `{a: 1}`)."""
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``section.key=value`` overrides to a config dict (returns a new dict)."""
    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        node = out
        for i, part in enumerate(parts):
            where = ".".join(parts[:i]) or "config"
            if not isinstance(node, dict) or part not in node:
                known = list(node) if isinstance(node, dict) else []
                raise unknown_key_error(part, known, f"override {dotted!r} ({where})")
            if i == len(parts) - 1:
                node[part] = _parse_value(raw)
            else:
                node = node[part]
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (or ``.json``) config file; an empty file is ``{}``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} is not valid {kind}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data
