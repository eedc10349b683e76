"""The machinery of a typed configuration tree, independent of any schema.

A tree is a dataclass of *sections* (dataclasses of plain leaves: str/int/float/bool/list/dict)
plus top-level leaves, mixed with :class:`ConfigTree`. This module gives it:

* fields with help text (:func:`option`) whose type hints carry their constraints (``Literal``,
  pydantic's ``PositiveInt``...), checked by :func:`check_constraints` first in ``__post_init__``;
  one error type, :class:`ConfigError` (a ``diffusionrl.errors.UserError``), of one line;
* a dict round trip (``to_dict`` / ``from_dict``) in which unknown keys are rejected with a
  suggestion, a partial tree is completed from the preset its ``preset`` key names (never from bare
  defaults under a preset's name), and leaves are checked against their type hints by a strict
  pydantic ``TypeAdapter``; numbers (list items and dict values too) must be finite
  (``option(..., allow_inf=True)`` admits +-inf);
* the same checks on every way into a tree from outside Python: ``from_json`` is what ``pyflyte run
  --config FILE`` calls, and mashumaro's ``__pre_deserialize__`` hook runs ``from_dict`` whenever
  flytekit decodes a tree (the Flyte console, a remote launch, every task input; why not pydantic:
  docs/architecture.md, "How a config gets in");
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
import functools
import hashlib
import json
import math
import typing
from dataclasses import field, fields
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BeforeValidator, ConfigDict, TypeAdapter, ValidationError

from diffusionrl.errors import UserError

__all__ = [
    "ConfigError",
    "ConfigTree",
    "apply_overrides",
    "check_constraints",
    "lookup_preset",
    "option",
    "read_config_file",
    "unknown_key_error",
]

T = TypeVar("T")


class ConfigError(UserError):
    """A configuration value is missing, unknown or inconsistent."""

    kind = "config error"


def option(default: Any, help: str, allow_inf: bool = False, **kw: Any) -> Any:
    """A config option: a dataclass field with its default and its help text in ``metadata["help"]``
    (list and dict defaults are copied per instance). Its numbers must be finite unless
    ``allow_inf`` (``metadata["allow_inf"]``: +-inf means something for this key); NaN never is."""
    metadata = {"help": help, "allow_inf": allow_inf}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


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
    def preset_dict(cls, name: str) -> dict[str, Any]:
        """The full dict of the named preset (a ``ConfigError`` naming the known ones if there is none)."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config"):
        """The tree of a full or partial dict (``complete``), type-checked and validated."""
        return _build(cls, cls.complete(data, where), where, "", cls.sections())

    @classmethod
    def complete(cls, data: dict[str, Any], where: str = "config") -> dict[str, Any]:
        """The full dict of a full or partial one; unknown keys are rejected, naming ``where``.

        A partial dict is laid over the preset its ``preset`` key names (the field's default when
        the key is absent), so a tree that says it is preset P holds P's values wherever it is
        silent; a preset that does not exist is then an error. A full dict is taken as it is (its
        ``preset`` is only a label).
        """
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
        base = cls().to_dict()
        missing = _missing_keys(base, data, cls.sections())
        if missing:
            name = data.get("preset", base.get("preset"))
            if not isinstance(name, str):
                raise ConfigError(f"{where}: preset must be a preset name, got {name!r}")
            try:
                base = cls.preset_dict(name)
            except ConfigError as exc:
                shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
                raise ConfigError(f"{where} leaves {len(missing)} keys unset ({shown}) to be filled from its preset, "
                                  f"but {exc}") from None
        return cls.merge_dicts(base, data, where)

    @classmethod
    def from_json(cls, text: str | bytes):
        """The tree of a JSON object, full or partial (``from_dict``): what ``pyflyte run ... --config
        FILE`` calls, so a YAML file there is checked as ``load_config`` checks it (why: docs/architecture.md,
        "How a config gets in")."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data, where="config")
        except ConfigError as exc:  # pyflyte prints a traceback box: keep it to this frame, the message below
            raise exc.with_traceback(None) from None

    @classmethod
    def __pre_deserialize__(cls, data: dict[str, Any]) -> dict[str, Any]:
        """mashumaro's hook, run on the raw dict before it decodes a tree (whenever flytekit decodes one:
        docs/architecture.md, "How a config gets in"). The dict is completed and checked as ``from_dict``
        does: a partial tree is laid over its preset, an unknown key is an error, not a silent drop."""
        return cls.from_dict(data, where="config").to_dict()

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


def _missing_keys(base: dict[str, Any], data: dict[str, Any], sections: dict[str, type]) -> list[str]:
    """Dotted keys of ``base`` (a full dict) that ``data`` leaves out (``preset`` aside: it is the label)."""
    missing = []
    for key, value in base.items():
        if key == "preset":
            continue
        if key not in data:
            missing += [f"{key}.{leaf}" for leaf in value] if key in sections else [key]
        elif key in sections and isinstance(data[key], dict):
            missing += [f"{key}.{leaf}" for leaf in value if leaf not in data[key]]
    return missing


def _build(cls: type, data: dict[str, Any], where: str, prefix: str, sections: dict[str, type] | None = None) -> Any:
    """``cls(**data)`` with unknown keys rejected and leaves coerced; ``sections`` are built
    recursively. ``where`` names the source in unknown-key errors, ``prefix`` is the dotted key of
    ``cls`` in the tree ('' at the root), which value errors name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or where} must be a mapping, got {type(data).__name__}")
    by_name, hints, sections = {f.name: f for f in fields(cls)}, _hints(cls), sections or {}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in by_name:
            raise unknown_key_error(key, list(by_name), f"{where}.{prefix}" if prefix else where)
        dotted = f"{prefix}.{key}" if prefix else key
        if key in sections:
            kwargs[key] = _build(sections[key], value, where, dotted)
        else:
            kwargs[key] = _coerce(value, hints[key], dotted, by_name[key].metadata.get("allow_inf", False))
    return cls(**kwargs)


def _numeric(value: Any) -> Any:
    try:
        return float(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    except ValueError:
        return value


# The two leniencies of the strict check: JSON from the Flyte console has no ints (an integral float
# is an int), YAML 1.1 reads 3e-4 as a string (a numeric string is a float).
_LENIENCY = {int: lambda v: int(v) if isinstance(v, float) and v.is_integer() else v, float: _numeric}
_LENIENT = {tp: Annotated[tp, BeforeValidator(f)] for tp, f in _LENIENCY.items()}


def _lenient(tp: Any) -> Any:
    """``tp`` with the leniencies applied to its ints and floats, list items and dict values too."""
    args = typing.get_args(tp)
    return typing.get_origin(tp)[tuple(map(_lenient, args))] if args else _LENIENT[tp] if tp in (int, float) else tp


_hints = functools.cache(lambda cls: typing.get_type_hints(cls, include_extras=True))


@functools.cache
def _adapter(tp: Any, strict: bool = True) -> TypeAdapter:
    return TypeAdapter(_lenient(tp), config=ConfigDict(strict=strict))


def _coerce(value: Any, tp: Any, key: str, allow_inf: bool = False) -> Any:
    """Check a leaf against its type hint with pydantic, strictly (no bool for a number, no number
    for a str) but for ``_LENIENT``, with the hint's constraints (``Literal``, ``PositiveInt``...);
    numbers must be finite (unless ``allow_inf``; NaN never). The one-line error names the dotted
    ``key`` (``key[i]``, ``key.k`` for a list item, a dict value)."""
    try:
        value = _adapter(tp).validate_python(value)
    except ValidationError as exc:
        raise _one_line(exc, tp, key, allow_inf) from None
    _check_finite(value, key, {"allow_inf": allow_inf})
    return value


def check_constraints(obj: Any, section: str) -> None:
    """Check the dataclass ``obj`` (a section, or a tree with ``section=''``) against what its type
    hints constrain (``Literal`` choices, ``PositiveInt``, ``NonNegativeFloat``...) and its numbers
    for finiteness (``option(allow_inf=...)``), naming ``section.key``: call it first in
    ``__post_init__``. Types are checked (strictly) where a dict comes in, ``from_dict``."""
    hints = _hints(type(obj))
    for f in fields(obj):
        key, value, tp = f"{section}.{f.name}" if section else f.name, getattr(obj, f.name), hints[f.name]
        if typing.get_origin(tp) in (Annotated, typing.Literal):
            try:
                _adapter(tp, strict=False).validate_python(value)
            except ValidationError as exc:
                raise _one_line(exc, tp, key, f.metadata.get("allow_inf", False), coerced=False) from None
        _check_finite(value, key, f.metadata)


def _one_line(exc: ValidationError, tp: Any, key: str, allow_inf: bool, coerced: bool = True) -> ConfigError:
    """The first error of ``exc`` (checking a leaf of type ``tp``) in this module's words; a number is
    shown as the leniencies make it when the value came from a dict (``coerced``), else as given."""
    err = exc.errors()[0]
    value, kind, loc = err["input"], err["type"], err["loc"]
    if "[key]" in loc:
        return ConfigError(f"{key} keys must be strings, got {value!r}")
    where = key + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    for _ in loc:  # the type of the item or value that failed
        tp = typing.get_args(tp)[-1]
    base = typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp
    if coerced:
        value = _LENIENCY.get(base, lambda v: v)(value)
    if kind in ("greater_than", "greater_than_equal"):  # NaN, -inf fail the bound: said to be not finite
        _check_finite(value, where, {"allow_inf": allow_inf})
        bound = f"> {err['ctx']['gt']}" if kind == "greater_than" else f">= {err['ctx']['ge']}"
        return ConfigError(f"{where}={value!r} must be {bound}")
    if kind == "literal_error" and isinstance(value, str):
        return ConfigError(f"{where}={value!r} is not one of {list(typing.get_args(tp))}")
    if kind == "literal_error":  # YAML's `true` for 'true' is a type error
        base = type(typing.get_args(tp)[0])
    what = "a number" if base is float else f"of type {base.__name__ if isinstance(base, type) else base}"
    return ConfigError(f"{where} must be {what}, got {value!r}")


def _check_finite(value: Any, key: str, metadata: Any) -> None:
    """Reject NaN anywhere in ``value`` (list items, dict values too); +-inf unless ``metadata["allow_inf"]``."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}", metadata)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]", metadata)
    elif isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value) or not metadata.get("allow_inf", False):
            raise ConfigError(f"{key}={value!r} must be a finite number")


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
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give the YAML (or .json) file in it, e.g. "
                          f"{path / 'config.yaml'}")
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
