"""Build an :class:`ExperimentConfig` as verl builds its own: Hydra composes the packaged
defaults (``conf/ppo_trainer.yaml``), a user's YAML file and overrides in Hydra's syntax
(``key=value``, ``+key=value``, ``++key=value``, ``~key``); OmegaConf resolves ``${...}``
interpolations; weightsync-core's :func:`~weightsync_core.convert` builds the dataclasses,
whose checks run on construction.

Every error is a :class:`ConfigError` that names the full key: an unknown key with the closest
valid names (old spellings included), a value of the wrong type with what the key accepts, a
backend that is not installed with the backends that are. Keys of weightsync-trainer 0.6
(``rollout.*``, ``trainer.total_steps``, ``algorithm.name``, ...) are moved to their new paths
first (:mod:`weightsync_trainer.legacy_keys`), with a :class:`FutureWarning` per spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from weightsync_core import (
    BackendNotFoundError,
    CheckpointEngineConfig,
    CheckpointEngineRegistry,
    ConversionError,
    PluginError,
    convert,
    load_custom_backend_module,
)
from weightsync_trainer.config import ExperimentConfig
from weightsync_trainer.errors import ConfigError
from weightsync_trainer.legacy_keys import (
    MINI_BATCH_RESOLVER,
    suggestions_at,
    translate_override,
    translate_tree,
)

__all__ = ["CONFIG_MODULE", "PACKAGED_CONFIG", "build_config", "check_backend",
           "compose_config", "config_to_dict", "default_config_dict", "load_config"]

CONFIG_MODULE = "weightsync_trainer.conf"
"""The package holding the packaged configs (Hydra's ``pkg://weightsync_trainer.conf``)."""

PACKAGED_CONFIG = "ppo_trainer"
"""The packaged defaults, named as verl's: a user's file may start from them with
``defaults: [ppo_trainer, _self_]``."""

_USER_NODE = "weightsync_trainer_user_config"
"""The name under which a user's file (old keys moved) is handed to Hydra's config store."""

_ENGINE_KEY = "actor_rollout_ref.rollout.checkpoint_engine"

_PREFIXES = {OverrideType.CHANGE: "", OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++",
             OverrideType.DEL: "~"}


def _prompts_per_mini_batch(prompts: Any, count: Any) -> int:
    """The old ``algorithm.ppo_mini_batches`` (a count) as prompts per mini-batch."""
    if (not isinstance(prompts, int) or isinstance(count, bool) or not isinstance(count, int)
            or count <= 0 or prompts % count):
        raise ValueError(
            f"algorithm.ppo_mini_batches={count!r} (now actor_rollout_ref.actor."
            "ppo_mini_batch_size: prompts per mini-batch) must split data.train_batch_size "
            f"({prompts!r}) evenly"
        )
    return prompts // count


OmegaConf.register_new_resolver(MINI_BATCH_RESOLVER, _prompts_per_mini_batch, replace=True)


def load_config(
    config_file: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    config_name: str | None = None,
    config_path: str | Path | None = None,
) -> ExperimentConfig:
    """The packaged defaults, then a user's YAML file, then ``overrides``, built and checked.

    Args:
        config_file: a YAML file (same as ``config_path`` = its folder, ``config_name`` = its
            name).
        overrides: Hydra overrides: ``a.b=1``, ``+a.new=1``, ``++a.b=1``, ``~a.b``.
        config_name: a YAML file's name (``.yaml`` optional) in ``config_path``, else one of
            the packaged configs (``ppo_trainer``). Without a ``defaults`` list the file is
            merged over ``ppo_trainer``; with one (verl's ``[ppo_trainer, _self_]``) Hydra
            composes what it lists.
        config_path: the folder of ``config_name`` (default: the current directory).

    Raises:
        ConfigError: naming the key and the fix.
    """
    return build_config(compose_config(
        config_file, overrides, config_name=config_name, config_path=config_path))


def default_config_dict() -> dict[str, Any]:
    """The packaged defaults, composed and resolved, as a nested dict."""
    return compose_config()


def compose_config(
    config_file: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    config_name: str | None = None,
    config_path: str | Path | None = None,
) -> dict[str, Any]:
    """The composed and resolved configuration tree as plain data (not yet checked); the
    arguments are :func:`load_config`'s."""
    overrides = list(overrides)
    lines = [_new_spelling(override) for override in _parse(overrides)]
    primary, user_file = _primary_config(config_file, config_name, config_path)
    if user_file is not None:
        folder = str(user_file.parent).replace("'", "\\'")  # quoted in Hydra's grammar
        lines.insert(0, f"hydra.searchpath=['file://{folder}']")
    with _hydra():
        try:
            composed = compose(primary, overrides=lines)
        except (HydraException, OmegaConfBaseException) as exc:
            error = _composition_error(exc, primary, lines[:1] if user_file else [], lines)
            if user_file is not None:  # name the user's file, not the store entry
                error = ConfigError(str(error).replace(repr(_USER_NODE), repr(str(user_file))))
            raise error from None
    try:
        data = OmegaConf.to_container(composed, resolve=True)
    except OmegaConfBaseException as exc:  # an interpolation that does not resolve
        cause = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc
        raise ConfigError(f"{exc.full_key}: {_first_line(cause)}") from None
    if not isinstance(data, dict):  # pragma: no cover - a composed config is a mapping
        raise ConfigError("the configuration must be a mapping of keys")
    return {str(key): value for key, value in data.items()}


def build_config(data: Mapping[str, Any]) -> ExperimentConfig:
    """Build and check an :class:`ExperimentConfig` from a nested dict (new key paths), and
    check that its backend is installed (:func:`check_backend`).

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a value the configuration's
            checks refuse; the message names the key.
    """
    try:
        config = convert(data, ExperimentConfig)
    except ConversionError as exc:
        raise _conversion_error(exc) from None
    check_backend(config.actor_rollout_ref.rollout.checkpoint_engine)
    return config


def check_backend(engine: CheckpointEngineConfig) -> None:
    """Import ``custom_backend_module`` here and resolve ``backend`` in the registry, so that
    a backend that is not installed is refused with the configuration, not after the run
    starts.

    Raises:
        ConfigError: the module does not load, or no backend of that name is installed (the
            message names the installed ones and the closest).
    """
    try:
        load_custom_backend_module(engine.custom_backend_module, engine.trusted_modules)
    except PluginError as exc:
        raise ConfigError(f"{_ENGINE_KEY}.custom_backend_module: {exc}") from None
    try:
        CheckpointEngineRegistry.get(engine.backend)
    except BackendNotFoundError as exc:
        raise ConfigError(f"{_ENGINE_KEY}.backend={engine.backend!r}: {exc}") from None


def config_to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as plain, YAML-serialisable data."""
    return dataclasses.asdict(config)


# --- composition --------------------------------------------------------------------------


def _parse(overrides: Sequence[str]) -> list[Override]:
    parser = OverridesParser.create()
    parsed = []
    for line in overrides:
        try:
            parsed.extend(parser.parse_overrides([line]))
        except HydraException as exc:
            raise ConfigError(
                f"override {line!r} is not in Hydra's override syntax (key=value, "
                f"+key=value to add a key, ++key=value to add or change, ~key to delete): "
                f"{_first_line(exc, skip_prefix='Error parsing override')}"
            ) from None
    return parsed


def _new_spelling(override: Override) -> str:
    """``override`` as typed, or rewritten to the new key path if it uses an old one."""
    line = override.input_line or ""
    kind = _PREFIXES[override.type]
    text = line.partition("=")[2] if "=" in line else ""
    value = override.value() if text else None
    translated = translate_override(override.key_or_group, kind, value, text)
    return line if translated is None else translated


def _primary_config(
    config_file: str | Path | None, config_name: str | None, config_path: str | Path | None
) -> tuple[str, Path | None]:
    """The config Hydra composes first, and the user's file (its folder goes on Hydra's search
    path)."""
    if config_file is not None:
        if config_name is not None or config_path is not None:
            raise ConfigError("give either a config file or config_name/config_path, not both")
        path = Path(config_file)
    elif config_name is not None:
        name = config_name.removesuffix(".yaml")
        folder = Path(config_path) if config_path is not None else Path.cwd()
        path = folder / f"{name}.yaml"
        if not path.is_file() and config_path is None and _is_packaged(name):
            return name, None
        if not path.is_file():
            where = f"in {str(folder)!r}" + (
                "" if config_path is not None else f" or among the packaged configs "
                f"({PACKAGED_CONFIG})")
            raise ConfigError(f"config {config_name!r} not found: no {path.name} {where}")
    elif config_path is not None:
        raise ConfigError("--config-path needs --config-name (the YAML file in that folder)")
    else:
        return PACKAGED_CONFIG, None
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    ConfigStore.instance().store(name=_USER_NODE, node=_user_node(path))
    return _USER_NODE, path.resolve()


def _is_packaged(name: str) -> bool:
    from importlib import resources

    return resources.files(CONFIG_MODULE).joinpath(f"{name}.yaml").is_file()


def _user_node(path: Path) -> dict[str, Any]:
    """A user's YAML file with old keys moved, over ``ppo_trainer`` unless it has its own
    ``defaults`` list."""
    try:
        loaded = OmegaConf.load(path)
    except Exception as exc:  # YAML's and OmegaConf's parse errors alike
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {str(path)!r} must hold a YAML mapping at top level")
    tree = OmegaConf.to_container(loaded, resolve=False)
    assert isinstance(tree, dict)
    defaults = tree.pop("defaults", None)
    return {"defaults": defaults if defaults is not None else [PACKAGED_CONFIG, "_self_"],
            **translate_tree({str(key): value for key, value in tree.items()})}


@contextmanager
def _hydra() -> Iterator[None]:
    """Hydra initialised on the packaged configs, also inside a Hydra application (whose
    state is put back after)."""
    outer = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            yield
    finally:
        if outer is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(outer)


# --- errors -------------------------------------------------------------------------------


def _first_line(exc: BaseException, skip_prefix: str = "") -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if skip_prefix and len(lines) > 1 and lines[0].startswith(skip_prefix):
        lines = lines[1:]
    return lines[0] if lines else type(exc).__name__


def _composition_error(exc: BaseException, primary: str, search: list[str],
                       lines: list[str]) -> ConfigError:
    """Hydra's refusal, explained: the first override whose key is not in the configuration
    composed without overrides (with the closest keys), or a value where it needs a section;
    else Hydra's own words (a user's file that does not compose)."""
    try:
        tree = OmegaConf.to_container(compose(primary, overrides=search), resolve=False)
    except (HydraException, OmegaConfBaseException):
        return ConfigError(" ".join(str(exc).split()))
    added: list[tuple[str, ...]] = []
    for override in OverridesParser.create().parse_overrides(lines):
        path = tuple(override.key_or_group.split("."))
        if override.type in (OverrideType.ADD, OverrideType.FORCE_ADD):
            added.append(path)
            continue
        if override.key_or_group.startswith("hydra.") or any(
                path[:len(prefix)] == prefix for prefix in added):
            continue
        problem = _missing_key(tree, path, override)
        if problem is not None:
            return problem
    return ConfigError(" ".join(str(exc).split()))


def _missing_key(tree: Any, path: tuple[str, ...], override: Override) -> ConfigError | None:
    node = tree
    for depth, name in enumerate(path):
        if not isinstance(node, Mapping):
            where = ".".join(path[:depth])
            return ConfigError(f"override {override.input_line!r}: {where} is a value "
                               f"({node!r}), not a section")
        if name not in node:
            if override.type is OverrideType.DEL:
                return unknown_key_error(path[:depth + 1], verb="delete")
            return unknown_key_error(path[:depth + 1], full=path,
                                     value=(override.input_line or "").partition("=")[2])
        node = node[name]
    return None


def _fields_at(path: tuple[str, ...]) -> list[str] | None:
    """The keys the configuration has under ``path``, or None where it takes any keys (a
    mapping such as ``engine_kwargs``) or ``path`` is no section."""
    hint: Any = ExperimentConfig
    for name in path:
        if not dataclasses.is_dataclass(hint):
            return None
        hint = typing.get_type_hints(hint).get(name)
    if not (dataclasses.is_dataclass(hint) and isinstance(hint, type)):
        return None
    return sorted(field.name for field in dataclasses.fields(hint) if field.init)


def unknown_key_error(path: Sequence[str], *, full: Sequence[str] | None = None,
                      value: str = "", verb: str = "") -> ConfigError:
    """An unknown key at ``path`` (dotted names from the top), with the closest keys there
    (new paths; an old spelling suggests its new path).

    Args:
        path: the first name that is not in the configuration, with its parents.
        full: the whole key of the override that named it, when longer than ``path``.
        value: that override's value, for the ``+key=value`` advice where a section takes any
            keys.
        verb: ``"delete"`` for a ``~key`` override.
    """
    parent, name = tuple(path[:-1]), path[-1]
    key = ".".join(path)
    section = ".".join(parent)
    fields = _fields_at(parent)
    if fields is None:  # a mapping of any keys (engine_kwargs): Hydra adds keys with +
        whole = ".".join(full or path)
        if verb == "delete":
            return ConfigError(f"cannot delete {key!r}: it is not set")
        return ConfigError(
            f"{key!r} is not set, and key=value only changes a key that is: add it with "
            f"+{whole}={value or 'VALUE'} (Hydra's override syntax)"
        )
    candidates = {field: ".".join((*parent, field)) for field in fields}
    for old, new in suggestions_at(section).items():
        candidates.setdefault(old, new)
    close = list(dict.fromkeys(
        candidates[match] for match in difflib.get_close_matches(name, list(candidates), n=3)))
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    action = "cannot delete unknown" if verb == "delete" else "unknown"
    return ConfigError(f"{action} configuration key {key!r}.{hint} Valid keys under "
                       f"{section or 'the top level'}: {', '.join(fields)}")


def _conversion_error(exc: ConversionError) -> ConfigError:
    """``exc`` worded for a configuration key."""
    where = ".".join(exc.path)
    if exc.kind == "unknown":
        return unknown_key_error(exc.path)
    if exc.kind == "type":
        return ConfigError(f"{where or 'the configuration'} must be {exc.expected}, got "
                           f"{exc.value!r} ({type(exc.value).__name__})")
    if isinstance(exc.error, ConfigError):  # the configuration's own check
        return ConfigError(f"{where}.{exc.error}" if where else str(exc.error))
    return ConfigError(f"invalid value in {where or 'the configuration'}: {exc.reason}")
