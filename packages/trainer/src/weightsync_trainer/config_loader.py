"""Build an :class:`ExperimentConfig` from the packaged YAML defaults, an optional YAML file and
dotted ``key=value`` overrides (``rollout.checkpoint_engine.backend=nixl``).

Every key is checked against the dataclasses: an unknown key is refused with the closest valid
names, a value of the wrong type with the expected type. Values are parsed as YAML
(``null``, ``true``, ``[a, b]``, ``{}``); numbers written like ``1e-3`` are accepted for floats.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from weightsync_trainer.config import ExperimentConfig
from weightsync_trainer.errors import ConfigError

__all__ = ["apply_override", "build_config", "config_to_dict", "default_config_dict",
           "load_config"]


def default_config_dict() -> dict[str, Any]:
    """The packaged defaults (``default.yaml``) as a nested dict."""
    text = resources.files("weightsync_trainer").joinpath("default.yaml").read_text()
    return yaml.safe_load(text)


def load_config(
    config_file: str | Path | None = None, overrides: Iterable[str] = ()
) -> ExperimentConfig:
    """Defaults, then ``config_file`` (a YAML mapping of overrides), then ``overrides``."""
    data = default_config_dict()
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a YAML mapping at top level")
        _merge(data, loaded)
    for override in overrides:
        apply_override(data, override)
    return build_config(data)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``a.b.c=value`` override to the nested dict ``data`` in place."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"override {override!r} must look like section.key=value, e.g. trainer.total_steps=20"
        )
    parts = key.split(".")
    if any(not part for part in parts):
        raise ConfigError(f"override {override!r}: {key!r} is not a valid dotted key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({exc})") from exc
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"override {override!r}: {where} is a value ({child!r}), not a section"
            )
        node = child
    node[parts[-1]] = value


def build_config(data: Mapping[str, Any]) -> ExperimentConfig:
    """Build and validate an :class:`ExperimentConfig` from a nested dict."""
    return _build_dataclass(ExperimentConfig, data, "")


def config_to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as plain, YAML-serialisable data."""
    return dataclasses.asdict(config)


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _build_dataclass(cls: type, data: Any, path: str) -> Any:
    where = path or "the configuration"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [key for key in data if key not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), fields, n=3)
        hint = f" Did you mean {' or '.join(_join(path, c) for c in close)}?" if close else ""
        raise ConfigError(
            f"unknown configuration key {_join(path, str(key))!r}.{hint} Valid keys under "
            f"{where}: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {key: _coerce(data[key], hints[key], _join(path, key)) for key in data}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid value in {where}: {exc}") from exc


def _describe(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(
            f"{path} must be {_describe(tp)}, got {value!r}"
        ) from (errors[0] if errors else None)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is dict or tp is dict:
        if isinstance(value, dict):
            return value
    elif origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(value, list):
            return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    else:  # pragma: no cover - a field type this loader does not know
        raise ConfigError(f"{path}: unsupported field type {_describe(tp)}")
    raise ConfigError(
        f"{path} must be {_describe(tp)}, got {value!r} ({type(value).__name__})"
    )
