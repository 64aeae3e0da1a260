"""The key paths of weightsync-trainer 0.6 and before, mapped to verl's (0.7).

``rollout.checkpoint_engine.backend=nixl``, ``trainer.total_steps=20``, ``algorithm.name=ppo``
and the other old spellings keep working until 0.8: :func:`translate_override` and
:func:`translate_tree` rewrite them to the new paths (in an override, or a user's YAML file)
and say so once per spelling (a :class:`FutureWarning`, printed by ``weightsync-train``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LEGACY_KEYS", "LegacyKey", "legacy_key", "suggestions_at", "translate_override",
           "translate_tree"]

REMOVED_IN = "0.8"

MINI_BATCH_RESOLVER = "weightsync.prompts_per_mini_batch"
"""OmegaConf resolver of the old ``algorithm.ppo_mini_batches`` (a count of mini-batches):
``${weightsync.prompts_per_mini_batch:${data.train_batch_size},COUNT}`` is verl's
``ppo_mini_batch_size`` (prompts per mini-batch)."""


@dataclass(frozen=True)
class LegacyKey:
    """One old key path (or a section's prefix) and where it lives now.

    Attributes:
        old: the old dotted path; a key under it moves with it.
        new: its new dotted path.
        values: old value -> new value (``algorithm.name``'s ``ppo`` is ``gae``).
        per_mini_batch: the old value is a count of mini-batches, the new one prompts per
            mini-batch (``algorithm.ppo_mini_batches``).
    """

    old: str
    new: str
    values: Mapping[str, str] | None = None
    per_mini_batch: bool = False


LEGACY_KEYS: tuple[LegacyKey, ...] = (
    LegacyKey("model", "actor_rollout_ref.model"),
    LegacyKey("rollout.tensor_parallel_size",
              "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    LegacyKey("rollout", "actor_rollout_ref.rollout"),
    LegacyKey("actor.world_size", "trainer.n_gpus_per_node"),
    LegacyKey("actor.optim.max_grad_norm", "actor_rollout_ref.actor.optim.clip_grad"),
    LegacyKey("actor.optim", "actor_rollout_ref.actor.optim"),
    LegacyKey("critic.optim.max_grad_norm", "critic.optim.clip_grad"),
    LegacyKey("task.prompt_length", "data.max_prompt_length"),
    LegacyKey("task.response_length", "data.max_response_length"),
    LegacyKey("algorithm.name", "algorithm.adv_estimator", values={"grpo": "grpo", "ppo": "gae"}),
    LegacyKey("algorithm.group_size", "actor_rollout_ref.rollout.n"),
    LegacyKey("algorithm.clip_ratio", "actor_rollout_ref.actor.clip_ratio"),
    LegacyKey("algorithm.ppo_epochs", "actor_rollout_ref.actor.ppo_epochs"),
    LegacyKey("algorithm.ppo_mini_batches", "actor_rollout_ref.actor.ppo_mini_batch_size",
              per_mini_batch=True),
    LegacyKey("algorithm.value_clip", "critic.cliprange_value"),
    LegacyKey("trainer.total_steps", "trainer.total_training_steps"),
    LegacyKey("trainer.prompts_per_step", "data.train_batch_size"),
    LegacyKey("trainer.ray_num_cpus", "ray_kwargs.ray_init.num_cpus"),
)
"""Longest prefixes first where one old path is under another."""


def legacy_key(key: str) -> tuple[LegacyKey, str] | None:
    """The rule an old dotted ``key`` falls under and its new path, or None for a key of the
    current tree."""
    for rule in LEGACY_KEYS:
        if key == rule.old or key.startswith(rule.old + "."):
            return rule, rule.new + key[len(rule.old):]
    return None


def suggestions_at(section: str) -> dict[str, str]:
    """Old key names directly under ``section`` (dotted; ``""``: the top), each with the new
    path to suggest for it."""
    found: dict[str, str] = {}
    for rule in LEGACY_KEYS:
        parent, _, name = rule.old.rpartition(".")
        if parent == section:
            found.setdefault(name, rule.new)
    return found


def _note(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is now {new} (verl's key path); the old spelling works until "
        f"weightsync-trainer {REMOVED_IN}", FutureWarning, stacklevel=4,
    )


def _new_value(rule: LegacyKey, value: Any) -> Any:
    """The new value for the old ``value``, or ``value`` itself."""
    if rule.values is not None and isinstance(value, str) and value in rule.values:
        return rule.values[value]
    if rule.per_mini_batch and isinstance(value, int) and not isinstance(value, bool):
        return f"${{{MINI_BATCH_RESOLVER}:${{data.train_batch_size}},{value}}}"
    return value


def translate_override(key: str, kind: str, value: Any, text: str) -> str | None:
    """The override that replaces an old one, or None when ``key`` is a current path.

    Args:
        key: the override's dotted key.
        kind: its prefix: ``""`` (change), ``"+"`` (add), ``"++"`` (force add), ``"~"``
            (delete).
        value: its value as Hydra parsed it (None for ``~key``).
        text: its value as typed (after the first ``=``; empty for ``~key``).

    An old ``key=value`` becomes ``++new.key=value``: 0.6 set a key whether or not the
    packaged defaults had it (``...engine_kwargs.nixl.plugin=UCX``), and an unknown key is
    still refused when the config is built.
    """
    found = legacy_key(key)
    if found is None:
        return None
    rule, new = found
    _note(key, new)
    changed = _new_value(rule, value)
    if changed is not value:  # a plain word, or an interpolation (quoted for Hydra's grammar)
        text = f"'{changed}'" if str(changed).startswith("$") else str(changed)
    prefix = "~" if kind == "~" else "+" if kind == "+" else "++"
    return f"{prefix}{new}" + (f"={text}" if text or kind != "~" else "")


def translate_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A user's YAML tree with every old key moved to its new path (values as they are:
    interpolations stay unresolved)."""
    result: dict[str, Any] = {}
    for path, value in _leaves(tree, ()):
        key = ".".join(path)
        found = legacy_key(key)
        if found is not None:
            rule, new = found
            _note(key, new)
            value = _new_value(rule, value)
            path = tuple(new.split("."))
        _set(result, path, value)
    return result


def _leaves(tree: Mapping[str, Any], path: tuple[str, ...]):
    for key, value in tree.items():
        inner = (*path, str(key))
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, inner)
        else:
            yield inner, value


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = tree
    for name in path[:-1]:
        child = node.get(name)
        if not isinstance(child, dict):
            child = node[name] = {}
        node = child
    node[path[-1]] = value
