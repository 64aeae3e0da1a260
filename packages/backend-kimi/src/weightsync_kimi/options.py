"""Typed options of the ``kimi`` engine (its ``engine_kwargs``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync_core.spi import (
    BackendLoadError,
    BackendNotInstalledError,
    CheckpointEngineRegistry,
    CollectiveBroadcastCheckpointEngine,
    EngineOptionsError,
)
from weightsync_mooncake.options import TransferEngineOptions

__all__ = ["KimiOptions"]


@dataclass(frozen=True)
class KimiOptions(TransferEngineOptions):
    """Options of the ``kimi`` engine, on top of Transfer Engine's (``protocol``,
    ``device_name``).

    Attributes:
        host: address of this process (default: ``WEIGHTSYNC_HOST``, the Ray node IP, or
            ``127.0.0.1``).
        collective: the broadcast backend inside a replica: ``"gloo"`` (host memory),
            ``"nccl"`` or ``"hccl"`` (installed separately).
        collective_kwargs: its options (checked against that backend's own options where
            that backend is installed; elsewhere by the kimi engine where it runs).
        keep_buffers: keep the leader's pull buffers between syncs.
        rebuild_group: verl's name for starting every sync afresh: the collective builds
            a new group each sync and the pull buffers are not kept.
    """

    host: str | None = None
    collective: str = "gloo"
    collective_kwargs: Mapping[str, Any] = field(default_factory=dict)
    keep_buffers: bool = True
    rebuild_group: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            inner = self.collective_class()
        except (BackendNotInstalledError, BackendLoadError):
            # A known backend that this process cannot load (a driver without
            # weightsync-nccl, say): the kimi engine loads it where it runs and says there
            # what is missing. A name no one knows is still refused here.
            return
        try:
            inner.check_options(self.collective_kwargs, backend=self.collective)
        except EngineOptionsError as exc:
            raise ValueError(f"option 'collective_kwargs': {exc}") from exc

    def collective_class(self) -> type[CollectiveBroadcastCheckpointEngine]:
        """The engine class of ``collective``.

        Raises:
            ValueError: ``collective`` names an engine that is not a broadcast backend.
        """
        inner = CheckpointEngineRegistry.get(self.collective)
        if not issubclass(inner, CollectiveBroadcastCheckpointEngine):
            raise ValueError(
                "option 'collective' must name a broadcast backend (gloo, nccl, hccl), got "
                f"{self.collective!r}"
            )
        return inner
