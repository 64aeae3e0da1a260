"""Configuration of the weight-sync layer."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from msgspec import Meta

from weightsync_core.api.conversion import check_fields
from weightsync_core.api.dtypes import parse_dtype, parse_rollout_dtype
from weightsync_core.api.errors import BackendNotFoundError, PluginError

if TYPE_CHECKING:
    import torch

    from weightsync_core.api.engine import CheckpointEngine

__all__ = [
    "ADAPTER_CHECK",
    "ADAPTER_KEEP",
    "ADAPTER_SPEC",
    "BEGIN_SYNC",
    "BUILT_SETTINGS",
    "DELTA_HELD",
    "MAX_BUCKET_MEGABYTES",
    "TRAVEL_OPTIONS",
    "CheckpointEngineConfig",
    "parse_dtype",
    "physical_memory_bytes",
]

MAX_BUCKET_MEGABYTES = 64 << 10
"""The largest bucket accepted (64 GiB): a sender allocates two, a receiver up to three."""

TRAVEL_OPTIONS: tuple[str, ...] = (
    "senders", "multi_sender", "direct_send_megabytes", "slots", "chunk_megabytes", "relay",
    "collective", "collective_kwargs",
)
"""Engine options (fields of any backend's ``options_class``) that change what travels or how
its bytes are cut, so that every process of a sync and the manager must agree on them
(:meth:`CheckpointEngineConfig.travel_settings`): which actor ranks send and relay
(``senders``, ``multi_sender``, ``relay``), how tensors are framed (``direct_send_megabytes``,
``chunk_megabytes``, a ring's ``slots``) and kimi's broadcast inside a replica
(``collective``, ``collective_kwargs``). Options of one process's own machine or lifetime
(``host``, ``device``, NICs and plugins, ``keep_buffers``, ``rebuild_group``, timeouts,
``is_master``) may differ between processes and are not compared."""

BUILT_SETTINGS = "built_settings"
"""The call a sync makes on every process (through its worker's
``execute_checkpoint_engine``) to learn the :meth:`CheckpointEngineConfig.travel_settings` its
engine was built with; a worker that does not answer it (verl's own workers) is not
compared."""

BEGIN_SYNC = "begin_sync"
"""The call that begins a sync on a process in one round trip (through its worker's
``execute_checkpoint_engine``, with ``key``): the engine takes the sync's session key
(``set_session_key``), says where it runs (``address``), the worker what the engine was built
with (:data:`BUILT_SETTINGS`), and the engine prepares (``prepare``); answered with
``{"address": ..., "settings": ..., "metadata": ...}``. A step that fails carries its stage
(``authenticate``, ``locate``, ``prepare``: :func:`~weightsync_core.api.errors.failed_stage`).
The manager makes it where every process of the sync answered :data:`BUILT_SETTINGS` in an
earlier sync (weightsync's own workers), else the three stages one after another."""

ADAPTER_SPEC = "adapter_spec"
"""The call an adapter sync makes on every actor rank (through its worker's
``execute_checkpoint_engine``, with ``name``) before any byte moves: the rank's
:class:`~weightsync_core.data.adapters.AdapterSpec` of that adapter, as plain data."""

ADAPTER_CHECK = "adapter_check"
"""The call an adapter sync makes on every rollout worker (with ``adapter``: the actor's spec
as plain data, and ``allow_change``) before any byte moves: the worker refuses, naming both
sides, a spec that differs from the one it holds versions of, or that its server cannot
serve."""

ADAPTER_KEEP = "adapter_keep"
"""The call that ends an adapter sync on every rollout worker of its replicas (with ``name``
and ``versions``): the worker keeps exactly those versions of the adapter (the manager's
ledger: after a success the newest ``config.adapter_versions``, after a failure what each
replica served before) and has its server drop the others."""

DELTA_HELD = "delta_held"
"""The call a delta-enabled sync makes on every process (through its worker's
``execute_checkpoint_engine``) before it chooses who gets patches: ``{"version": token or
None, "needs_base": bool}``, the delta version the process holds a copy of and, on an actor
rank, whether this sync can send patches only where it holds the base (it sends, or keeps a
slice of a copy spread over the ranks). A process that does not answer (verl's own workers)
is taken to hold no known version: it gets whole tensors."""


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (``SC_PHYS_PAGES * SC_PAGE_SIZE``), or None
    where the system does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


@dataclass
class CheckpointEngineConfig:
    """How weights move from the actor worker group to the rollout replicas.

    Attributes:
        backend: registered engine name (``naive``, ``gloo``, ``nccl``, ``nixl``, ...).
        update_weights_bucket_megabytes: size of each transfer bucket in MiB; a sender
            allocates two (double buffering), a receiver up to three (a ring worker its
            slots and three copies). Tensors larger than a bucket are chunked. At most
            64 GiB, and, where the engine keeps its buckets in host memory, the buckets one
            process holds (:meth:`CheckpointEngine.buckets_in_host_memory
            <weightsync_core.api.engine.CheckpointEngine.buckets_in_host_memory>`) must fit
            in this machine's physical memory (checked when the config is built and again where
            each engine is built).
        engine_kwargs: extra constructor arguments per backend name, e.g.
            ``{"nixl": {"plugin": "UCX"}}``; only the active backend's entry is used, and it
            is checked against that backend's typed options when the config is built.
        custom_backend_module: dotted module name (or list) imported in every process that
            builds an engine, so that a custom backend registers itself.
        trusted_modules: not a field (no config file or constructor argument sets it): the
            module prefixes of ``WEIGHTSYNC_TRUSTED_MODULES`` in the environment of the
            process that built the config (the driver), narrowed by the list in force
            wherever the config is pickled for another process, or None. It travels with
            the config to every Ray worker, which refuses a ``custom_backend_module``
            outside it as well as outside its own environment's list (a worker does not
            see a variable the driver set after ``ray.init``, before or after the config
            was built).
        sync_timeout_seconds: a whole sync (all stages) must finish within this time, else it
            raises :class:`~weightsync_core.api.errors.SyncTimeoutError` naming the stage and ranks.
        verify: receivers check names, shapes, dtypes and a per-bucket checksum against the
            sender's manifest and fail loudly on any mismatch.
        rollout_dtype: if set, floating-point tensors are cast to this dtype before sending:
            ``bfloat16``, ``float16`` or ``float32``
            (:data:`~weightsync_core.api.dtypes.ROLLOUT_DTYPES`).
        rollout_quantization: if set, the format weights are quantized to on the sending
            side: ``"fp8_block"`` (:mod:`weightsync_core.data.quantization`: each linear
            layer's weight as float8_e4m3fn plus a float32 ``<name>_scale_inv`` per 128x128
            block, as DeepSeek-V3/Qwen3-FP8 checkpoints store them; embeddings, the LM head,
            norms and routers travel unquantized, cast to ``rollout_dtype`` where set).
            Backends that deliver layouts (the sharded ones) quantize each actor rank's
            rows, one scale per block agreed between the ranks
            (:mod:`weightsync_core.data.shards.quantized`).
        delta: after a full sync, send per tensor only what differs bitwise from the version
            every receiver of the sync holds (a patch; the whole tensor where a patch would
            be larger), and check every rebuilt tensor whole against the sender's digest
            before the server sees it. A sync that any receiver could not apply (a new or
            restarted replica, one whose last sync failed) is a full one. The sending actor
            rank and every rollout worker keep a host copy of the last version (rollout
            dtype). Backends whose engine says ``supports_delta``.
        full_verify_every: with ``delta``, make every Nth sync a full one (0: never);
            refused without ``delta``.
        staging: how ``update_weights`` moves a version into the replicas. ``"auto"``: in
            two phases where every rollout worker can stage (weightsync's own workers):
            the update is moved and checked into a stage on each worker while every replica
            keeps serving, and only then is each replica paused for the switch, which rolls
            back to the version it served where it fails; a failure before the switch
            leaves every replica serving, not paused. Elsewhere (a colocated backend,
            workers that cannot stage, such as verl's own) as with ``"never"``:
            stop-the-world, every replica paused from before the first byte until the
            update is loaded. A stage costs each worker host memory for one more copy of
            its share of the weights, the rollback copy another
            (:mod:`weightsync_core.worker.staging`).
        pause_mode: how a staged sync's switch pauses each replica's server, where it takes
            ``pause_generation(mode)``: ``"keep"`` (requests in flight freeze between two
            tokens and continue on the new weights, their KV cache kept: a response may
            span two versions, which the server reports), ``"drain"`` (they finish on the
            old weights first; new requests wait) or ``"abort"`` (they end at once). A server
            without ``pause_generation`` is paused with ``abort_all_requests``.
        commit: when ``update_weights`` switches the replicas of a staged sync.
            ``"together"`` (default): none switches until every replica of the sync holds a
            complete, checked stage; a failure before the switch leaves the whole fleet on
            the version it served (one version per sync across the fleet, which the
            asynchronous trainer's staleness bound counts on). ``"each"``: a replica
            switches as soon as every worker of it holds its stage, while the transfer to
            the others goes on; after a failure, the replicas whose stages completed serve
            the new version and the others the one they served (fresher, not uniform).
            Callers of ``stage_weights``/``commit_weights`` schedule the switch themselves.
        adapter_versions: how many versions of each LoRA adapter every replica keeps
            (``update_adapter``: TRL's ``max_staleness + 1``); a request may name any of
            them. A sync beyond it drops the oldest, once every worker of the replica took
            the new one (a server defers dropping a version that requests in flight use).
    """

    backend: Annotated[str, Meta(min_length=1, description="a non-empty string")] = "naive"
    update_weights_bucket_megabytes: Annotated[int, Meta(
        gt=0, le=MAX_BUCKET_MEGABYTES,
        description=f"a positive integer (MiB) of at most {MAX_BUCKET_MEGABYTES} (64 GiB)",
    )] = 512
    engine_kwargs: Annotated[dict[str, dict[str, Any]], Meta(
        description="a mapping of a backend name to a dict of keyword arguments, e.g. "
        "{'gloo': {'host': '127.0.0.1'}}",
    )] = field(default_factory=dict)
    custom_backend_module: str | list[str] | None = None
    sync_timeout_seconds: Annotated[float, Meta(
        gt=0, description="a finite number of seconds > 0")] = 600.0
    verify: bool = True
    rollout_dtype: str | None = None
    rollout_quantization: Literal["fp8_block"] | None = None
    delta: bool = False
    full_verify_every: Annotated[int, Meta(
        ge=0, description="an integer >= 0 (every Nth delta-enabled sync is a full one; 0: "
        "never)")] = 0
    staging: Literal["auto", "never"] = "auto"
    pause_mode: Literal["keep", "drain", "abort"] = "keep"
    commit: Literal["together", "each"] = "together"
    adapter_versions: Annotated[int, Meta(
        ge=1, description="an integer >= 1 (versions of each adapter a replica keeps)")] = 2

    def __post_init__(self) -> None:
        from weightsync_core.api.plugins import trusted_module_prefixes

        prefixes = trusted_module_prefixes()
        self._trusted_modules = tuple(prefixes) if prefixes is not None else None
        if isinstance(self.rollout_dtype, torch.dtype):  # kept by its name, as configs write it
            self.rollout_dtype = str(self.rollout_dtype).removeprefix("torch.")
        check_fields(self)  # each field's type and bounds, as its annotation says
        if not math.isfinite(self.sync_timeout_seconds):
            raise ValueError("sync_timeout_seconds must be a finite number of seconds > 0, "
                             f"got {self.sync_timeout_seconds!r}")
        parse_rollout_dtype(self.rollout_dtype)
        every = self.full_verify_every
        if every and not self.delta:
            raise ValueError(
                f"full_verify_every={every} applies to delta sync only, and delta is off (every "
                "sync is a full one already): set delta=True as well, or drop full_verify_every"
            )
        self.check_engine_options()

    def check_engine_options(self) -> None:
        """Check the active backend's ``engine_kwargs`` against its typed options, and the
        bucket size against this machine's memory (:meth:`check_bucket_memory`), here on
        the driver, before any process starts (this imports ``custom_backend_module`` and
        the backend). A backend or custom module that cannot be loaded in this process is
        left to the manager, which says what is missing; a module name that is no dotted
        name, or that the operator's ``WEIGHTSYNC_TRUSTED_MODULES`` does not allow, is not.

        Raises:
            EngineOptionsError: an unknown option, or a value of the wrong type or range.
            PluginError: a ``custom_backend_module`` name refused (see
                :func:`~weightsync_core.api.plugins.custom_module_names`).
            ValueError: buckets that cannot fit in this machine's memory.
        """
        from weightsync_core.api.plugins import custom_module_names, load_custom_backend_module
        from weightsync_core.api.registry import CheckpointEngineRegistry

        # a path, or a module not allowed
        custom_module_names(self.custom_backend_module, self.trusted_modules)
        try:
            load_custom_backend_module(self.custom_backend_module, self.trusted_modules)
            engine_cls = CheckpointEngineRegistry.get(self.backend)
        except (PluginError, BackendNotFoundError):
            return
        engine_cls.check_options(self.active_engine_kwargs, self.backend)
        self.check_bucket_memory(engine_cls)

    def check_bucket_memory(self, engine_cls: type[CheckpointEngine]) -> None:
        """Refuse a bucket size whose buckets cannot fit in this machine's physical memory,
        where ``engine_cls`` (the configured backend's engine, with this config's options)
        keeps them in host memory (``engine_cls.buckets_in_host_memory``; buckets on a
        device are bounded by the 64 GiB cap only). Runs when the config is built and where each
        engine is built (:func:`~weightsync_core.worker.lifecycle.build_engine`), each time against
        the memory of the machine it runs on.

        Raises:
            ValueError: naming ``update_weights_bucket_megabytes``, the memory found and the
                largest value accepted here.
        """
        from weightsync_core.api.options import parse_options

        options = (parse_options(engine_cls.options_class, self.backend,
                                 self.active_engine_kwargs)
                   if engine_cls.declares_options() else None)
        buffers = engine_cls.buckets_in_host_memory(options)
        memory = physical_memory_bytes()
        if not buffers or memory is None or buffers * self.bucket_size_bytes <= memory:
            return
        largest = min(MAX_BUCKET_MEGABYTES, memory // buffers >> 20)
        on_device = (", or keep the buckets on a device (engine option device='cuda')"
                     if hasattr(options, "device") else "")
        raise ValueError(
            f"update_weights_bucket_megabytes={self.update_weights_bucket_megabytes} does not "
            f"fit in this machine's memory: backend {self.backend!r} holds up to {buffers} "
            f"buckets in host memory in one process (a sender 2, a receiver up to 3, a ring "
            f"worker its slots and 3 copies), "
            f"{buffers * self.bucket_size_bytes / (1 << 30):.1f} GiB, and "
            f"this machine has {memory / (1 << 30):.1f} GiB of physical memory. The largest "
            f"accepted here is {largest} MiB: lower update_weights_bucket_megabytes to at "
            f"most {largest}{on_device}"
        )

    @property
    def trusted_modules(self) -> tuple[str, ...] | None:
        """The ``WEIGHTSYNC_TRUSTED_MODULES`` prefixes in force where this config was built
        (the driver) and wherever it was pickled since (:meth:`__getstate__`), or None;
        every process that loads this config's ``custom_backend_module`` applies them as
        well as its own environment's. Read-only, and no field: no config file or
        constructor argument can set it."""
        return vars(self).get("_trusted_modules")

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle of this config holds (as Ray hands it to a worker): its fields and
        :attr:`trusted_modules` narrowed by this process's ``WEIGHTSYNC_TRUSTED_MODULES``
        now, so that a list the operator set after the config was built binds the
        processes it goes to (which do not see that variable) as well."""
        from weightsync_core.api.plugins import allowed_by_both, trusted_module_prefixes

        return {**vars(self), "_trusted_modules": allowed_by_both(
            self.trusted_modules, trusted_module_prefixes())}

    def travel_settings(
        self, engine_cls: type[CheckpointEngine], options: Any = None
    ) -> dict[str, Any]:
        """The settings of this config that change what travels, as ``engine_cls`` (the
        configured backend's engine) uses them: the manager's and every process's must be
        equal, or a sync is refused before any byte moves (values are plain: they cross
        Ray and vLLM's msgpack). Keys, in the order a refusal names them:

        - ``backend``;
        - ``rollout_dtype`` (the dtype's name, or None);
        - ``rollout_quantization`` (the format's name, or None);
        - ``verify``;
        - ``update_weights_bucket_megabytes``, where the engine packs buckets (not one that
          :attr:`~weightsync_core.api.engine.CheckpointEngine.executes_layouts`, whose pieces
          travel in ``chunk_megabytes``);
        - ``engine_kwargs[<backend>][<option>]`` for each of :data:`TRAVEL_OPTIONS` the
          engine's options have, defaults filled in.

        Not compared: ``delta`` and ``full_verify_every`` (the manager alone decides each
        sync's delta plan and hands it to every process; a process never reads its own),
        ``sync_timeout_seconds`` (a deadline, the manager's bounds the sync), ``staging``,
        ``pause_mode`` and ``commit`` (the manager alone decides each sync's phases and
        pauses), ``adapter_versions`` (the manager says which versions each worker keeps),
        ``custom_backend_module`` (how the backend is found; the backend is compared) and
        every other engine option (see :data:`TRAVEL_OPTIONS`).

        Args:
            engine_cls: the engine class this config builds.
            options: the engine's parsed options where it has them (a built engine's
                ``options``); else parsed here from :attr:`active_engine_kwargs`.
        """
        from weightsync_core.api.options import parse_options

        dtype = self.rollout_torch_dtype
        settings: dict[str, Any] = {
            "backend": self.backend,
            "rollout_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "rollout_quantization": self.rollout_quantization,
            "verify": bool(self.verify),
        }
        if not getattr(engine_cls, "executes_layouts", False):
            settings["update_weights_bucket_megabytes"] = self.update_weights_bucket_megabytes
        if options is None and engine_cls.declares_options():
            options = parse_options(engine_cls.options_class, self.backend,
                                    self.active_engine_kwargs)
        for name in TRAVEL_OPTIONS:
            if options is not None and hasattr(options, name):
                settings[f"engine_kwargs[{self.backend!r}][{name!r}]"] = _plain(
                    getattr(options, name))
        return settings

    @property
    def rollout_torch_dtype(self) -> torch.dtype | None:
        """``rollout_dtype`` as a ``torch.dtype`` (None: tensors keep their dtype)."""
        return parse_rollout_dtype(self.rollout_dtype)

    @property
    def bucket_size_bytes(self) -> int:
        """Bucket size in bytes."""
        return self.update_weights_bucket_megabytes << 20

    @property
    def active_engine_kwargs(self) -> dict[str, Any]:
        """The ``engine_kwargs`` entry of the configured backend (empty if none)."""
        return dict(self.engine_kwargs.get(self.backend, {}))


def _plain(value: Any) -> Any:
    """``value`` made of None, bools, numbers, strings, lists and string-keyed dicts (what
    crosses Ray and vLLM's msgpack, and compares by value); anything else as its repr."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in sorted(
            value.items(), key=lambda entry: str(entry[0]))}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return repr(value)
