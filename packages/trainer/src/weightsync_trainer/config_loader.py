"""Build an :class:`ExperimentConfig` from the packaged YAML defaults, an optional YAML file and
dotted ``key=value`` overrides (``rollout.checkpoint_engine.backend=nixl``).

Every key is checked against the dataclasses (with weightsync-core's strict converter): an
unknown key is refused with the closest valid names, a value of the wrong type with what the
field accepts. Values are parsed as YAML (``null``, ``true``, ``[a, b]``, ``{}``); numbers
written like ``1e-3`` are floats (as in YAML 1.2).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from weightsync_core import ConversionError, convert
from weightsync_trainer.config import ExperimentConfig
from weightsync_trainer.errors import ConfigError

__all__ = ["apply_override", "build_config", "config_to_dict", "default_config_dict",
           "load_config"]

_FLOAT_TAG = "tag:yaml.org,2002:float"
_FLOAT = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
"""YAML 1.1's floats, and YAML 1.2's without a dot or an exponent sign (``1e-3``, ``1.0e3``)."""


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-3`` as a float (YAML 1.1 reads it as a string)."""


# The safe loader's resolvers, its float pattern replaced in place (it is tried before the
# integer one, for the same first characters: ``-+0123456789.``).
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, _FLOAT if tag == _FLOAT_TAG else regexp) for tag, regexp in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader: plain data only


def default_config_dict() -> dict[str, Any]:
    """The packaged defaults (``default.yaml``) as a nested dict."""
    text = resources.files("weightsync_trainer").joinpath("default.yaml").read_text()
    return _load_yaml(text)


def load_config(
    config_file: str | Path | None = None, overrides: Iterable[str] = ()
) -> ExperimentConfig:
    """Defaults, then ``config_file`` (a YAML mapping of overrides), then ``overrides``."""
    data = default_config_dict()
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = _load_yaml(path.read_text()) or {}
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
        value = _load_yaml(raw) if raw.strip() else ""
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
    """Build and validate an :class:`ExperimentConfig` from a nested dict.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a value the configuration's
            checks refuse; the message names the key.
    """
    try:
        return convert(data, ExperimentConfig)
    except ConversionError as exc:
        if isinstance(exc.error, ConfigError):
            raise exc.error from None  # the configuration's own check: it names the key
        raise _config_error(exc) from exc


def config_to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as plain, YAML-serialisable data."""
    return dataclasses.asdict(config)


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _config_error(exc: ConversionError) -> ConfigError:
    """``exc`` worded for a configuration key."""
    section = ".".join(exc.path[:-1] if exc.kind == "unknown" else exc.path)
    where = section or "the configuration"
    if exc.kind == "unknown":
        hint = f" Did you mean {' or '.join(exc.close)}?" if exc.close else ""
        return ConfigError(
            f"unknown configuration key {exc.where!r}.{hint} Valid keys under {where}: "
            f"{', '.join(exc.choices)}"
        )
    if exc.kind == "type":
        return ConfigError(
            f"{where} must be {exc.expected}, got {exc.value!r} ({type(exc.value).__name__})"
        )
    return ConfigError(f"invalid value in {where}: {exc.reason}")
