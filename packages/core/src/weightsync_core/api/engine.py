"""The checkpoint-engine interface every backend implements (verl's names and shapes), with
working defaults a backend overrides only where its transport differs."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from weightsync_core.api.checksums import bucket_checksum, copy_with_host_checksum
from weightsync_core.api.dtypes import parse_rollout_dtype
from weightsync_core.api.errors import EngineOptionsError, WeightSyncError
from weightsync_core.api.hosts import default_host
from weightsync_core.api.options import (
    CONFIG_SETTINGS,
    EngineOptions,
    parse_options,
    unknown_option,
)
from weightsync_core.api.passes import PassTimes
from weightsync_core.api.session_key import check_session_key

__all__ = [
    "CheckpointEngine",
    "CheckpointEngineWithCache",
    "OwnShareDecoder",
    "OwnShareEncoder",
    "SyncProgress",
    "TransferStats",
    "WeightsSource",
]

WeightsSource = (
    Iterable[tuple[str, torch.Tensor]]
    | AsyncIterable[tuple[str, torch.Tensor]]
    | Mapping[str, torch.Tensor]
)
"""What ``send_weights`` accepts: a sync or async iterable of pairs, or a state dict."""


class OwnShareEncoder(Protocol):
    """What turns an actor rank's own share of the tensors into what it sends (delta
    sync's :class:`~weightsync_core.data.delta.ShareEncoder`)."""

    @property
    def sends_patches(self) -> bool:
        """Whether the share goes as patches (which only holders of the base can use)."""
        ...

    def __call__(self, share: WeightsSource) -> WeightsSource: ...


class OwnShareDecoder(Protocol):
    """What a rollout worker's engine that builds its tensors from what it receives
    (:attr:`CheckpointEngine.decodes_own_pieces`) decodes them with (delta sync's
    :class:`~weightsync_core.data.delta.ShareDecoder`)."""

    @property
    def receives_patches(self) -> bool:
        """Whether what arrives are patches against the version this worker holds."""
        ...


@dataclass
class TransferStats:
    """What one side of a sync moved."""

    num_tensors: int = 0
    nbytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Plain dict, for returning across Ray."""
        return asdict(self)


_WAIT_TOKENS = itertools.count()


@dataclass
class SyncProgress:
    """What this process is doing in the current sync, so that the manager can tell which
    process stopped making progress when a sync times out.

    Attributes:
        state: ``idle``; on the actor side ``producing`` (waiting for the weights
            iterator) or ``sending``; on the rollout side ``receiving`` (waiting for the
            engine) or ``loading`` (the server holds a tensor).
        since: ``time.monotonic()`` when the state began.
        tensors: tensors handed on so far in this sync.
        waits: what the engine waits on peers for right now (see :meth:`waiting_on`).
    """

    state: str = "idle"
    since: float = field(default_factory=time.monotonic)
    tensors: int = 0
    waits: dict[int, tuple[str, str, float]] = field(default_factory=dict)

    def enter(self, state: str) -> None:
        """Switch to ``state`` (restarting its clock)."""
        self.state = state
        self.since = time.monotonic()

    @contextlib.contextmanager
    def waiting_on(self, peer: str, what: str) -> Iterator[None]:
        """Mark a wait on ``peer`` (e.g. ``"rollout rank 2"``) for ``what`` (``"writing
        bucket 3"``) as outstanding while the block runs: when a sync stalls, two processes
        waiting on each other point at the network between them."""
        token = next(_WAIT_TOKENS)
        self.waits[token] = (peer, what, time.monotonic())
        try:
            yield
        finally:
            self.waits.pop(token, None)

    def snapshot(self) -> dict[str, Any]:
        """``{"state", "seconds" (in that state), "tensors", "waiting": [{"peer", "what",
        "seconds"}, ...] (oldest first)}``, for the manager."""
        now = time.monotonic()
        waiting = sorted(({"peer": peer, "what": what, "seconds": now - since}
                          for peer, what, since in list(self.waits.values())),
                         key=lambda wait: -wait["seconds"])
        return {"state": self.state, "seconds": now - self.since, "tensors": self.tensors,
                "waiting": waiting[:8]}


class CheckpointEngine(ABC):
    """Moves one version of the weights from the actor worker group to rollout workers.

    One instance lives in each worker process, on both sides. A sync runs, in every process:
    :meth:`prepare` (returns metadata such as an address), the driver calls
    :meth:`build_topology` with all metadata, each process gets its keyword arguments for
    :meth:`init_process_group`, then actor ranks call :meth:`send_weights` while rollout
    workers iterate :meth:`receive_weights`, and everyone calls :meth:`finalize`.

    These are verl's untyped methods. weightsync's engines implement them through
    :class:`~weightsync_core.engines.TypedEngine`, whose typed hooks (``announce``, ``plan``,
    ``join``) take and return each engine family's
    :class:`~weightsync_core.api.handshake.Handshake` structures, carried as plain data.

    Args:
        bucket_size: bytes per transfer bucket.
        rollout_dtype: cast floating-point tensors to this dtype before sending (one of
            :data:`~weightsync_core.api.dtypes.ROLLOUT_DTYPES`, else ``ValueError``).
        verify: check deliveries against the sender's manifest (engines that move bytes).
        timeout: seconds any single wait may take before the engine raises.
        **options: the backend's ``engine_kwargs``, checked against its ``options_class``
            (a frozen dataclass of typed options; see :mod:`weightsync_core.api.options`) and
            kept as :attr:`options`.

    An engine written for verl, whose constructor sets its own attributes without calling
    this one, runs as it is: the attributes here have class defaults.
    """

    is_colocated: ClassVar[bool] = False
    """True for engines where actor and rollout share one process (no transfer)."""

    supports_delta: ClassVar[bool] = False
    """True for engines that move delta syncs (``CheckpointEngineConfig.delta``): one actor
    rank reads the weight stream and sends it (:meth:`sends_weights`), or each sends its
    own share (:attr:`encodes_own_share`), and every tensor reaches every rollout worker as
    sent (``uint8`` patches included)."""

    encodes_own_share: ClassVar[bool] = False
    """True for engines whose actor ranks each send their own share of the tensors (kimi).
    In a delta sync every such rank gets the whole stream, chooses its share, and passes
    that through :attr:`share_encoder` (so each rank diffs, and keeps a copy of, its share
    only)."""

    decodes_own_pieces: ClassVar[bool] = False
    """True for engines whose rollout workers build each tensor from the pieces they
    receive and so decode a delta sync's patches piece by piece themselves (the sharded
    engines), through :attr:`share_decoder`; their actor ranks also set
    :attr:`encodes_own_share`."""

    share_decoder: OwnShareDecoder | None = None
    """Set by the worker before :meth:`receive_weights` where :attr:`decodes_own_pieces`:
    how what arrives becomes this worker's tensors (patches applied to its copy in a delta
    sync); None: as it arrives."""

    executes_layouts: ClassVar[bool] = False
    """True for engines that deliver each rollout worker only the boxes its layout needs
    (sharded delivery: ``gloo_sharded``). The workers hand them each process's layout
    through :meth:`declare_layout` before :meth:`prepare`, and actor ranks that declare one
    send the pieces they hold (``iter_weight_shards``)."""

    share_encoder: OwnShareEncoder | None = None
    """Set by the worker before :meth:`send_weights` where :attr:`encodes_own_share`: turns
    this rank's share into what it sends (patches in a delta sync); None: as it is."""

    options_class: ClassVar[type[EngineOptions]] = EngineOptions
    """The engine's typed options; a subclass with options of its own sets a subclass of
    :class:`~weightsync_core.api.options.EngineOptions` here."""

    options: Any = EngineOptions()
    """The engine's checked options, an instance of :attr:`options_class` (a subclass
    narrows the annotation: ``options: MyOptions``)."""

    host_buckets: ClassVar[int] = 3
    """The most buckets one process of this engine holds in host memory at once (a sender
    two, a receiver up to three); the config refuses a bucket size whose buckets would not
    fit in the machine's memory. Engines whose count depends on their options override
    :meth:`buckets_in_host_memory`."""

    @classmethod
    def buckets_in_host_memory(cls, options: Any) -> int:
        """Override point: the most buckets one process holds in host memory with
        ``options`` (its checked options, or None for an engine without typed options);
        0 where buckets live on a device or there are none. Default: :attr:`host_buckets`,
        none for a colocated engine."""
        return 0 if cls.is_colocated else cls.host_buckets

    rollout_dtype: torch.dtype | None = None
    verify: bool = True
    timeout: float = 600.0
    is_master: bool = False
    _session_key: bytes | None = None
    host: str | None = None
    """Address this process binds and peers reach it at (``None``: :func:`default_host`)."""

    def __init__(
        self,
        bucket_size: int,
        *,
        rollout_dtype: str | torch.dtype | None = None,
        verify: bool = True,
        timeout: float = 600.0,
        **options: Any,
    ) -> None:
        if bucket_size <= 0:
            raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size}")
        self.bucket_size = int(bucket_size)
        self.rollout_dtype = parse_rollout_dtype(rollout_dtype)
        self.verify = verify
        self.timeout = float(timeout)
        self.options = parse_options(self.options_class, type(self).__name__, options)
        self.is_master = self.options.is_master

    @classmethod
    def check_options(cls, given: Mapping[str, Any], backend: str | None = None) -> None:
        """Check ``given`` (this engine's ``engine_kwargs``) on the driver, before any process
        starts; ``backend`` is the name the error gives (default: the class name).

        An engine with typed options is checked field by field
        (:func:`~weightsync_core.api.options.parse_options`). An engine written for verl, which
        has its own constructor and no ``options_class`` of its own, is checked by its
        constructor's keyword names.

        Raises:
            EngineOptionsError: naming the option, the value given and what is accepted.
        """
        backend = backend or cls.__name__
        for name in given:
            if name in CONFIG_SETTINGS:
                raise EngineOptionsError(
                    f"backend {backend!r}: {name!r} is a setting of the whole config, not an "
                    f"engine option; set CheckpointEngineConfig.{CONFIG_SETTINGS[name]} instead "
                    f"of engine_kwargs[{backend!r}][{name!r}]"
                )
        if cls.declares_options():
            parse_options(cls.options_class, backend, given)
            return
        parameters = inspect.signature(cls).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return
        accepted = sorted(name for name in parameters if name not in CONFIG_SETTINGS)
        for name, value in given.items():
            if name not in parameters:
                raise EngineOptionsError(unknown_option(backend, name, value, accepted))

    @classmethod
    def declares_options(cls) -> bool:
        """Whether this engine's options are its typed ``options_class`` (every engine built
        on this class's constructor), rather than an own constructor's keyword arguments (an
        engine written for verl)."""
        return any("options_class" in vars(klass) for klass in cls.__mro__
                   if klass is not CheckpointEngine) or cls.__init__ is CheckpointEngine.__init__

    @functools.cached_property
    def progress(self) -> SyncProgress:
        """Updated by the worker that owns the engine; read through :meth:`sync_progress`."""
        return SyncProgress()

    @functools.cached_property
    def passes(self) -> PassTimes:
        """Seconds this process spent in each pass over the last sync's bytes (the worker
        that owns the engine clears it as a sync begins and reports it as it ends; engines
        time their passes in it: :mod:`~weightsync_core.api.passes`)."""
        return PassTimes()

    def set_session_key(self, key: bytes) -> None:
        """Take this sync's session key: a fresh secret the manager hands every process of
        the sync through Ray before :meth:`init_process_group`. Engines authenticate every
        network message and group join of the sync with it (see
        :mod:`weightsync_core.net.wire`)."""
        self._session_key = check_session_key(key)

    @property
    def session_key(self) -> bytes:
        """This sync's session key.

        Raises:
            WeightSyncError: none was set (the engine is driven without the manager).
        """
        if self._session_key is None:
            raise WeightSyncError(
                f"{type(self).__name__} has no session key: call set_session_key(key) on "
                "every engine of the sync, with one key from "
                "weightsync_core.new_session_key(), before init_process_group "
                "(CheckpointEngineManager does this)"
            )
        return self._session_key

    def address(self) -> str:
        """The address other processes reach this one at (the host a failure names)."""
        return self.host or default_host()

    def sync_progress(self) -> dict[str, Any]:
        """What this process is doing in the current sync (see :class:`SyncProgress`)."""
        return self.progress.snapshot()

    def sends_weights(self) -> bool:
        """Whether this process's :meth:`send_weights` sends what it reads (after
        :meth:`init_process_group`); False on actor ranks that only drain their iterator.
        Delta sync keeps a baseline only where this is True. By default True."""
        return True

    def declare_layout(self, layout: Mapping[str, Any] | None,
                       weights: Mapping[str, Any] | None = None,
                       quantization: str | None = None) -> None:
        """Take what this process holds or needs (a
        :data:`~weightsync_core.data.shards.LayoutSpec`; None: every tensor whole) and, from an
        actor rank, every tensor's shape and dtype and the format the sync quantizes them to
        (``rollout_quantization``); engines that :attr:`executes_layouts` override it. Others
        deliver every tensor whole.

        Raises:
            WeightSyncError: a layout other than the whole model, for an engine that
                delivers every tensor whole.
        """
        if layout is not None:
            raise WeightSyncError(
                f"{type(self).__name__} delivers every tensor whole, but this process "
                f"declares the layout {layout!r}; use backend 'gloo_sharded'")

    def bucket_checksum(self, data: torch.Tensor) -> int:
        """Checksum of a bucket's used bytes, for verification (computed where they live:
        xxh3 on the host, a position-weighted sum on a device)."""
        return bucket_checksum(data)

    def copy_with_checksum(self, target: torch.Tensor, source: torch.Tensor) -> int | None:
        """Copy a received bucket's bytes ``source`` into ``target`` and return
        :meth:`bucket_checksum` of the copy, in one pass over the bytes where that is the
        host's xxh3 (:func:`~weightsync_core.api.checksums.copy_with_host_checksum`); None
        (nothing copied) where it is not: a device bucket, or an engine with a checksum of
        its own."""
        if not self.hashes_on_host(target.device) or source.device.type != "cpu":
            return None
        return copy_with_host_checksum(target, source)

    def hashes_on_host(self, device: torch.device) -> bool:
        """Whether :meth:`bucket_checksum` of a bucket on ``device`` is the host's xxh3,
        which can be taken in pieces as the bytes are copied
        (:class:`~weightsync_core.api.checksums.HostDigest`): a host bucket, and the engine
        keeps this class's checksum."""
        replaced = "bucket_checksum" in vars(self) or (
            type(self).bucket_checksum is not CheckpointEngine.bucket_checksum)
        return not replaced and device.type == "cpu"

    @abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Allocate what the sync needs and return this process's metadata for the topology."""

    @classmethod
    @abstractmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Return ``(actor_wg_kwargs, rollout_kwargs)``: per-rank lists of keyword arguments.

        ``metadata`` holds the :meth:`prepare` results of the actor ranks, then of the rollout
        workers. ``actor_wg_kwargs[key][i]`` goes to actor rank ``i``'s
        :meth:`init_process_group`; likewise for rollout worker ``i``.
        """

    @classmethod
    def build_replica_topology(
        cls, actor_wg_world_size: int, replica_sizes: list[int], metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """:meth:`build_topology` for engines that need to know which rollout workers form a
        replica (``replica_sizes[i]`` workers in replica ``i``, in rank order). The manager
        calls this; by default it ignores the replica layout."""
        return cls.build_topology(actor_wg_world_size, sum(replica_sizes), metadata)

    @abstractmethod
    def init_process_group(self, *args: Any, **kwargs: Any) -> None:
        """Join this sync's communication group with the arguments from :meth:`build_topology`."""

    @abstractmethod
    async def send_weights(
        self, weights: WeightsSource, global_steps: int | None = None
    ) -> TransferStats:
        """Actor side: send ``weights`` (ranks that do not send still drain the iterator)."""

    @abstractmethod
    def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Rollout side: async iterator of received ``(name, tensor)`` pairs."""

    @abstractmethod
    def finalize(self) -> None:
        """End this sync (an engine may keep its group for the next one); safe to call after
        a failure, and twice."""

    def abort(self) -> None:
        """Release everything after a failed sync, whatever state the peers are in. The
        manager calls it on every reachable worker when a sync fails; by default it is
        :meth:`finalize`."""
        self.finalize()

    def close(self) -> None:
        """Release everything the engine holds, listening sockets included (it may be used
        again: what it needs is created anew). By default it is :meth:`abort`."""
        self.abort()


class CheckpointEngineWithCache(CheckpointEngine):
    """An engine whose actor side keeps a host copy of the latest weights after sending.

    A replica added after an update gets those weights through
    :meth:`CheckpointEngineManager.update_replicas_from_cache`: the usual prepare /
    topology / group steps run, then the new rollout workers iterate :meth:`get_weights`
    while the actor ranks send nothing.
    """

    @abstractmethod
    def get_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Rollout side: fetch the latest cached weights (the actor ranks do not send)."""
