"""verl's LoRA policies delivered through weightsync backends (verl #7495).

verl 0.9.1's actor sends ``get_per_tensor_param()`` in a disaggregated sync: for a LoRA
policy (``lora_rank > 0``, not ``lora.merge``) that is the frozen base, every step, and
never the adapter, and its ``CheckpointEngineWorker`` hands what arrives to the server with
no ``peft_config``: the replicas sample the initial policy for the whole run, silently.

With a weightsync backend (``weightsync_<name>``), importing this package fixes both ends,
in both ways in (verl's manager and weightsync's):

- the actor sends the base once (only where the replicas start on dummy weights,
  ``rollout.load_format: dummy``; verl's colocated path does the same), then only the
  adapter: PEFT's ``lora_A``/``lora_B`` tensors, each section of the stream opened by a
  header (:class:`LoraHeader`: JSON, never pickle) that carries verl's ``peft_config``;
- the rollout worker splits the stream at the headers and hands each section to verl's
  server adapter as verl's colocated path does (``peft_config=``, ``base_sync_done=``), each
  adapter tensor checked against the header's spec as it arrives
  (:class:`weightsync_core.AdapterSpec`), the adapter refused if incomplete.

verl builds these workers itself and has no setting for their classes; the only code of
ours it runs in them is ``custom_backend_module``, so :func:`install` (run when
``weightsync_verl`` is imported) wraps the two ``update_weights`` methods in place. The
wrappers act only where the worker's checkpoint engine is a weightsync backend, and on the
actor only for an unmerged LoRA policy: everything else runs verl's code unchanged.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import torch
from verl.checkpoint_engine import CheckpointEngineWorker
from verl.workers.engine_workers import ActorRolloutRefWorker

from weightsync_core import AdapterSpec
from weightsync_core.spi import WeightSyncError
from weightsync_verl.engines import LORA_HEADER, WeightsyncCheckpointEngine

__all__ = [
    "ADAPTER_NAME",
    "HEADER_PREFIX",
    "LoraHeader",
    "deliver_sections",
    "install",
    "is_lora_policy",
    "lora_stream",
]

HEADER_PREFIX = LORA_HEADER
"""The reserved prefix of a :class:`LoraHeader`'s name in a sync's stream of tensors (the
phase follows: ``weightsync_verl.lora_header.adapter``)."""
ADAPTER_NAME = "default"
"""The adapter's name in weightsync's checks (PEFT's name of verl's one adapter)."""
_MAX_HEADER_BYTES = 1 << 20
"""A header longer than this is refused before it is decoded."""

Phase = Literal["base", "adapter"]


@dataclass(frozen=True)
class LoraHeader:
    """What opens a section of a LoRA policy's sync: the base weights (``phase="base"``,
    loaded once into replicas that started on dummy weights) or the adapter
    (``phase="adapter"``), and verl's ``peft_config`` (``LoraConfig.to_dict()``), which
    verl's server adapter takes with either.

    Raises:
        ValueError: ``phase`` is neither, or ``peft_config`` does not describe an adapter
            weightsync can check (:meth:`weightsync_core.AdapterSpec.from_peft_config`).
    """

    phase: Phase
    peft_config: dict[str, Any]

    def __post_init__(self) -> None:
        if self.phase not in ("base", "adapter"):
            raise ValueError(f"a LoRA header's phase is 'base' or 'adapter', got {self.phase!r}")
        self.spec  # noqa: B018  (checks the config)

    @property
    def spec(self) -> AdapterSpec:
        """The adapter the config describes."""
        return AdapterSpec.from_peft_config(ADAPTER_NAME, self.peft_config)

    @property
    def base_sync_done(self) -> bool:
        """verl's flag for the section: ``True`` for the adapter (the base is in place)."""
        return self.phase == "adapter"

    @property
    def name(self) -> str:
        """The header's name in the stream."""
        return f"{HEADER_PREFIX}{self.phase}"

    def to_tensor(self) -> torch.Tensor:
        """The header as the stream carries it: UTF-8 JSON in a ``uint8`` tensor."""
        text = json.dumps({"phase": self.phase, "peft_config": self.peft_config})
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor) -> LoraHeader:
        """The header a stream carried under ``name`` (plain JSON, bounded; never code).

        Raises:
            WeightSyncError: the tensor is not a header: not 1-D ``uint8``, longer than
                1 MiB, not JSON, not a header's fields, or of another phase than its name's.
        """
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise WeightSyncError(f"{name} must be a 1-D uint8 tensor, got "
                                  f"{tensor.dtype} of shape {list(tensor.shape)}")
        if tensor.numel() > _MAX_HEADER_BYTES:
            raise WeightSyncError(f"{name} is {tensor.numel()} bytes, over the "
                                  f"{_MAX_HEADER_BYTES} a header may take")
        try:
            data = json.loads(bytes(tensor.cpu().numpy()).decode())
            if not isinstance(data, dict) or set(data) != {"phase", "peft_config"} or (
                    not isinstance(data["peft_config"], dict)):
                raise ValueError("expected {'phase': ..., 'peft_config': {...}}")
            header = cls(data["phase"], data["peft_config"])
            if header.name != name:
                raise ValueError(f"a {header.phase} header named {name!r}")
            return header
        except ValueError as error:  # JSON and UTF-8 errors are ValueErrors too
            raise WeightSyncError(f"{name} is not a LoRA header: {error}") from error

    @classmethod
    def of_config(cls, phase: Phase, peft_config: Mapping[str, Any]) -> LoraHeader:
        """The header of verl's ``peft_config`` (sets become sorted lists, enums their
        values).

        Raises:
            TypeError: a value of the config is not plain data.
        """
        return cls(phase, _plain(dict(peft_config), "peft_config"))


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data (a PEFT config's sets and enums included)."""
    if isinstance(value, Enum):
        value = value.value
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_plain(item, where) for item in value)
    if isinstance(value, list | tuple):
        return [_plain(item, where) for item in value]
    raise TypeError(f"{where} is a {type(value).__name__}, which a LoRA header cannot carry "
                    "(plain data only)")


def trains_unmerged_lora(model_config: Any) -> bool:
    """Whether verl model config ``model_config`` (``actor_rollout_ref.model``, or a
    training engine's ``HFModelConfig``) trains a LoRA adapter that syncs as one:
    ``lora_rank > 0`` without ``lora.merge``."""
    if model_config is None or (getattr(model_config, "lora_rank", 0) or 0) <= 0:
        return False
    return not (getattr(model_config, "lora", None) or {}).get("merge", False)


def is_lora_policy(worker: Any) -> bool:
    """Whether verl actor worker ``worker`` trains an unmerged LoRA adapter
    (:func:`trains_unmerged_lora` of its training engine's model config)."""
    actor = getattr(worker, "actor", None)
    return trains_unmerged_lora(getattr(getattr(actor, "engine", None), "model_config", None))


def lora_stream(engine: Any, with_base: bool, layered_summon: bool = False
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """What a LoRA policy's sync carries, from verl training engine ``engine``: the base
    (``with_base``) under a ``base`` header, then the adapter under an ``adapter`` header.
    Every actor rank iterates it (the gathers are collective).

    Raises:
        WeightSyncError: the engine exports no PEFT config (it trains no unmerged LoRA).
    """
    adapter, peft_config = engine.get_per_tensor_param(layered_summon=layered_summon,
                                                       base_sync_done=True)
    if peft_config is None:
        raise WeightSyncError("the actor's engine exports no peft_config: it trains no "
                              "unmerged LoRA adapter (lora_rank > 0, lora.merge false)")
    if with_base:
        base, _ = engine.get_per_tensor_param(layered_summon=False, base_sync_done=False)
        header = LoraHeader.of_config("base", peft_config)
        yield header.name, header.to_tensor()
        yield from base
    header = LoraHeader.of_config("adapter", peft_config)
    yield header.name, header.to_tensor()
    yield from adapter


class _Sections:
    """A received stream split at its LoRA headers."""

    def __init__(self, weights: AsyncIterator[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self._next: tuple[str, torch.Tensor] | None = None
        self._done = False

    async def peek(self) -> tuple[str, torch.Tensor] | None:
        """The next item, left in the stream (``None`` at its end)."""
        if self._next is None and not self._done:
            try:
                self._next = await anext(self._weights)
            except StopAsyncIteration:
                self._done = True
        return self._next

    async def take(self) -> tuple[str, torch.Tensor] | None:
        """The next item, taken from the stream (``None`` at its end)."""
        item = await self.peek()
        self._next = None
        return item

    async def rest(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every item left."""
        while (item := await self.take()) is not None:
            yield item

    async def section(self, header: LoraHeader) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The items up to the next header, the adapter's checked against the header."""
        check = header.spec.tensor_check() if header.phase == "adapter" else None
        while (item := await self.peek()) is not None and not item[0].startswith(HEADER_PREFIX):
            self._next = None
            name, tensor = item
            if check is not None:
                check.check(name, tensor)
            elif ".lora_" in name:
                raise WeightSyncError(f"{name!r} arrived among the base weights of a LoRA sync")
            yield item
        if check is not None:
            check.finish()


async def deliver_sections(
    weights: AsyncIterator[tuple[str, torch.Tensor]],
    update: Callable[..., Any],
    **kwargs: Any,
) -> None:
    """Hand received ``weights`` to a verl server adapter's ``update`` (its
    ``update_weights``, with ``kwargs``): a plain stream in one call, as verl's worker does;
    a LoRA policy's stream one call per section, with its ``peft_config`` and
    ``base_sync_done``.

    Raises:
        WeightSyncError: a header is malformed or an adapter tensor does not fit its spec
            (:class:`weightsync_core.AdapterMismatchError`), or the server stopped reading
            a section before its end.
    """
    stream = _Sections(weights)
    first = await stream.peek()
    if first is None or not first[0].startswith(HEADER_PREFIX):
        await update(stream.rest(), **kwargs)
        return
    while (item := await stream.take()) is not None:
        header = LoraHeader.from_tensor(*item)
        await update(stream.section(header), peft_config=header.peft_config,
                     base_sync_done=header.base_sync_done, **kwargs)
        following = await stream.peek()
        if following is not None and not following[0].startswith(HEADER_PREFIX):
            raise WeightSyncError(f"the server stopped reading the LoRA sync's {header.phase} "
                                  f"section before {following[0]!r}")


def install() -> None:
    """Wrap verl's actor and rollout workers' ``update_weights`` (in this process) so that
    a LoRA policy's syncs through a weightsync backend carry the adapter (see the module).
    Idempotent."""
    _wrap(ActorRolloutRefWorker, _actor_update_weights)
    _wrap(CheckpointEngineWorker, _rollout_update_weights)


def _wrap(cls: type, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = cls.__dict__["update_weights"]
    if original in _WRAPPERS:
        return
    wrapper = functools.wraps(original)(make(original))  # keeps verl's @register marks
    _WRAPPERS.add(wrapper)
    setattr(cls, "update_weights", wrapper)  # noqa: B010  (cls is any class)


_WRAPPERS: set[Callable[..., Any]] = set()
"""The methods :func:`install` put in place."""


def _actor_update_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    async def update_weights(self: Any, global_steps: int | None = None,
                             mode: str = "auto") -> Any:
        backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        engine = getattr(self, "checkpoint_engine", None)
        if (backend == "naive" or not isinstance(engine, WeightsyncCheckpointEngine)
                or not is_lora_policy(self)):
            return await original(self, global_steps, mode)
        with_base = not getattr(self, "_weightsync_base_sent", False) and (
            "dummy" in str(self.config.rollout.get("load_format", "")))
        weights = lora_stream(self.actor.engine, with_base,
                              layered_summon=bool(self.config.rollout.get("layered_summon",
                                                                          False)))
        metrics = await engine.send_weights(weights, global_steps=global_steps)
        self._weightsync_base_sent = True
        return metrics or {}

    return update_weights


def _rollout_update_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    async def update_weights(self: Any, global_steps: int | None = None) -> None:
        engine = self.checkpoint_engine
        if not isinstance(engine, WeightsyncCheckpointEngine):
            await original(self, global_steps)
            return
        await deliver_sections(engine.receive_weights(global_steps, lora_sections=True),
                               self.server_adapter.update_weights, global_steps=global_steps,
                               wire_format=getattr(engine, "wire_format", "named_tensors"))

    return update_weights

