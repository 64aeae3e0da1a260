"""Configuration of the weight-sync layer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from weightsync_core.dtypes import parse_dtype
from weightsync_core.errors import BackendNotFoundError, PluginError

__all__ = ["MAX_BUCKET_MEGABYTES", "CheckpointEngineConfig", "parse_dtype"]

MAX_BUCKET_MEGABYTES = 64 << 10
"""The largest bucket accepted (64 GiB): a sender allocates two, a receiver up to three."""


@dataclass
class CheckpointEngineConfig:
    """How weights move from the actor worker group to the rollout replicas.

    Attributes:
        backend: registered engine name (``naive``, ``gloo``, ``nccl``, ``nixl``, ...).
        update_weights_bucket_megabytes: size of each transfer bucket in MiB; a sender
            allocates two (double buffering), a receiver up to three. Tensors larger than a
            bucket are chunked.
        engine_kwargs: extra constructor arguments per backend name, e.g.
            ``{"nixl": {"plugin": "UCX"}}``; only the active backend's entry is used, and it
            is checked against that backend's typed options when the config is built.
        custom_backend_module: dotted module name (or list) imported in every process that
            builds an engine, so that a custom backend registers itself.
        sync_timeout_seconds: a whole sync (all stages) must finish within this time, else it
            raises :class:`~weightsync_core.errors.SyncTimeoutError` naming the stage and ranks.
        verify: receivers check names, shapes, dtypes and a per-bucket checksum against the
            sender's manifest and fail loudly on any mismatch.
        rollout_dtype: if set, floating-point tensors are cast to this dtype before sending.
    """

    backend: str = "naive"
    update_weights_bucket_megabytes: int = 512
    engine_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    custom_backend_module: str | list[str] | None = None
    sync_timeout_seconds: float = 600.0
    verify: bool = True
    rollout_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend must be a non-empty string, got {self.backend!r}")
        if (
            isinstance(self.update_weights_bucket_megabytes, bool)
            or not isinstance(self.update_weights_bucket_megabytes, int)
            or not 0 < self.update_weights_bucket_megabytes <= MAX_BUCKET_MEGABYTES
        ):
            raise ValueError(
                "update_weights_bucket_megabytes must be a positive integer (MiB) of at most "
                f"{MAX_BUCKET_MEGABYTES} (64 GiB), got {self.update_weights_bucket_megabytes!r}"
            )
        timeout = self.sync_timeout_seconds
        if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(
                f"sync_timeout_seconds must be a finite number of seconds > 0, got {timeout!r}"
            )
        if not isinstance(self.engine_kwargs, dict) or not all(
            isinstance(v, dict) for v in self.engine_kwargs.values()
        ):
            raise ValueError(
                "engine_kwargs must map a backend name to a dict of keyword arguments, e.g. "
                "{'gloo': {'host': '127.0.0.1'}}"
            )
        parse_dtype(self.rollout_dtype)
        self.check_engine_options()

    def check_engine_options(self) -> None:
        """Check the active backend's ``engine_kwargs`` against its typed options, here on
        the driver, before any process starts (this imports ``custom_backend_module`` and
        the backend). A backend or custom module that cannot be loaded in this process is
        left to the manager, which says what is missing; a module name that is no dotted
        name, or that the operator's ``WEIGHTSYNC_TRUSTED_MODULES`` does not allow, is not.

        Raises:
            EngineOptionsError: an unknown option, or a value of the wrong type or range.
            PluginError: a ``custom_backend_module`` name refused (see
                :func:`~weightsync_core.plugins.custom_module_names`).
        """
        from weightsync_core.plugins import custom_module_names, load_custom_backend_module
        from weightsync_core.registry import CheckpointEngineRegistry

        custom_module_names(self.custom_backend_module)  # a path, or a module not allowed
        try:
            load_custom_backend_module(self.custom_backend_module)
            engine_cls = CheckpointEngineRegistry.get(self.backend)
        except (PluginError, BackendNotFoundError):
            return
        engine_cls.check_options(self.active_engine_kwargs, self.backend)

    @property
    def bucket_size_bytes(self) -> int:
        """Bucket size in bytes."""
        return self.update_weights_bucket_megabytes << 20

    @property
    def active_engine_kwargs(self) -> dict[str, Any]:
        """The ``engine_kwargs`` entry of the configured backend (empty if none)."""
        return dict(self.engine_kwargs.get(self.backend, {}))
