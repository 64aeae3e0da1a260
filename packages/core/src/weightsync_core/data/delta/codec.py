"""Delta sync's two ends: a sender that turns a weight stream into patches against the
version every receiver holds, and a receiver that rebuilds whole tensors from them.

Both keep a host copy of the last version they sent or received (in the rollout dtype) and
the version's token. A sync names the token its deltas are against (``base``; None for a
full sync) and the token of the version it makes (``version``). Either side forgets its
token when a sync starts and learns the new one only when the sync's stream ended
complete, so a sync that fails mid-way leaves no one claiming a version they may hold only
in part: the next sync is a full one.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, cast

import torch

from weightsync_core.api.engine import OwnShareDecoder, OwnShareEncoder
from weightsync_core.api.errors import ManifestChangedError, VerificationError, WeightSyncError
from weightsync_core.data.bucketing import WeightsSource, cast_for_rollout, iter_named_tensors
from weightsync_core.data.delta.patch import PatchDigestError, apply_patch, encode_patch

__all__ = ["DeltaBaselineError", "DeltaPlan", "DeltaReceiver", "DeltaSender", "DeltaStats",
           "ShareDecoder", "ShareEncoder", "host_copy"]


class ShareEncoding(Protocol):
    """What :meth:`DeltaSender.encoded` needs of an engine (a
    :class:`~weightsync_core.api.engine.CheckpointEngine`)."""

    encodes_own_share: ClassVar[bool]
    share_encoder: OwnShareEncoder | None


@dataclass(frozen=True)
class ShareEncoder:
    """How a rank of an engine whose ranks each send their own share (kimi) turns its
    share into what it sends: :meth:`DeltaSender.stream` for one sync's ``plan``."""

    sender: DeltaSender
    plan: DeltaPlan | None
    rollout_dtype: torch.dtype | None
    sending: bool = True

    @property
    def sends_patches(self) -> bool:
        """Whether the share goes as patches (which only holders of the base can use)."""
        return self.sending and self.plan is not None and self.plan.is_delta

    def __call__(self, share: WeightsSource) -> WeightsSource:
        return self.sender.stream(share, self.plan, self.rollout_dtype, self.sending)


class ReceivingEngine(Protocol):
    """What :meth:`DeltaReceiver.received` needs of an engine: a
    :class:`~weightsync_core.api.engine.CheckpointEngine`, or one written for verl (which
    decodes nothing itself)."""

    def receive_weights(self, global_steps: int | None = None
                        ) -> AsyncIterator[tuple[str, torch.Tensor]]: ...


class ShareDecoding(ReceivingEngine, Protocol):
    """An engine that decodes the pieces it receives itself (``decodes_own_pieces``)."""

    decodes_own_pieces: ClassVar[bool]
    share_decoder: OwnShareDecoder | None


@dataclass(frozen=True)
class ShareDecoder:
    """How a rollout worker of an engine that builds its tensors from the pieces it receives
    (``decodes_own_pieces``: the sharded engines) decodes one sync's ``plan`` (None: not
    delta-enabled) against ``receiver``'s copy."""

    receiver: DeltaReceiver
    plan: DeltaPlan | None

    @property
    def receives_patches(self) -> bool:
        """Whether what arrives are patches against the version this worker holds."""
        return self.plan is not None and self.plan.is_delta


class DeltaBaselineError(WeightSyncError):
    """A process was asked to send or apply deltas against a version it does not hold."""


@dataclass(frozen=True)
class DeltaPlan:
    """One sync's versions: ``base``, the token of the version every receiver holds (None:
    send whole tensors), and ``version``, the token of the version this sync makes."""

    version: str
    base: str | None = None

    @property
    def is_delta(self) -> bool:
        """Whether tensors travel as patches against ``base``."""
        return self.base is not None

    @classmethod
    def new(cls, base: str | None = None) -> DeltaPlan:
        """A plan with a fresh random token for the version it makes."""
        return cls(version=secrets.token_hex(8), base=base)

    @classmethod
    def agreed(cls, held: Sequence[str | None]) -> DeltaPlan:
        """The plan of a sync whose sending rank and receivers hold the versions ``held``
        (what each process's ``prepare()`` reported, say): deltas against their version
        where all hold the same one, else a full sync."""
        first = held[0] if held else None
        return cls.new(first if first is not None and all(v == first for v in held) else None)

    @classmethod
    def from_arguments(cls, delta_base: str | None, delta_version: str | None
                       ) -> DeltaPlan | None:
        """The plan handed to a process as ``delta_base`` and ``delta_version`` arguments;
        None where the sync is not delta-enabled (``delta_version`` None).

        Raises:
            ValueError: a ``delta_base`` without a ``delta_version``.
        """
        if delta_version is None:
            if delta_base is not None:
                raise ValueError("delta_base needs a delta_version (the version this sync "
                                 "makes)")
            return None
        return cls(version=delta_version, base=delta_base)


@dataclass
class DeltaStats:
    """What one side of a delta-enabled sync saw: elements compared and changed, bytes of
    the weights and of what travelled, seconds spent diffing (or applying)."""

    elements: int = 0
    changed: int = 0
    model_bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat numbers for metrics (``delta_`` prefixed)."""
        return {
            "delta_elements": float(self.elements),
            "delta_changed": float(self.changed),
            "delta_model_bytes": float(self.model_bytes),
            "delta_wire_bytes": float(self.wire_bytes),
            "delta_seconds": self.seconds,
        }


def _patchable(in_place: Mapping[str, torch.Tensor] | None, name: str,
               received: torch.Tensor) -> torch.Tensor | None:
    """The server's own tensor of ``name`` where a delta sync can patch it in place (same
    shape, dtype and device as ``received``, contiguous), else None."""
    target = None if in_place is None else in_place.get(name)
    if target is None or not target.is_contiguous():
        return None
    if (target.shape, target.dtype, target.device) != (
            received.shape, received.dtype, received.device):
        return None
    return target


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` in host memory (a baseline)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


class _Versioned:
    """The baselines and token one side keeps."""

    def __init__(self) -> None:
        self.baselines: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        self.last_stats = DeltaStats()

    @property
    def kept_bytes(self) -> int:
        """Bytes of the copies this side keeps."""
        return sum(copy.numel() * copy.element_size() for copy in self.baselines.values())

    def forget(self) -> None:
        """Drop the baselines and the token (the next sync must be full)."""
        self.baselines = {}
        self.version = None

    def begin(self, plan: DeltaPlan, who: str) -> DeltaStats:
        """Start a sync of ``plan`` (``who``: this process, for errors): this side claims
        no version until :meth:`end`; returns the sync's stats, to fill in.

        Raises:
            DeltaBaselineError: a delta sync against a version this side does not hold (its
                copies are dropped).
        """
        if plan.is_delta and self.version != plan.base:
            held = "no version" if self.version is None else f"version {self.version}"
            self.forget()
            raise DeltaBaselineError(
                f"{who} holds {held}, but this sync sends deltas against version "
                f"{plan.base}; nothing was applied, and the next sync is a full one"
            )
        self.version = None  # until this sync's stream ended complete
        self.last_stats = DeltaStats()
        return self.last_stats

    def end(self, plan: DeltaPlan, seen: set[str]) -> None:
        """End a sync of ``plan`` whose stream ended complete, having held the tensors
        ``seen``: the copies of any others are dropped, and this side holds ``plan``'s
        version."""
        for name in set(self.baselines) - seen:  # left the model (a full sync only)
            del self.baselines[name]
        self.version = plan.version


class DeltaSender(_Versioned):
    """The sending actor rank's side: keeps the last sent version (rollout dtype, host
    memory) and encodes each new tensor as a patch against it."""

    deltas_since_full = 0
    """Delta syncs this sender encoded to the end since its last full one."""

    def stream(self, weights: WeightsSource, plan: DeltaPlan | None,
               rollout_dtype: torch.dtype | None, sending: bool = True) -> WeightsSource:
        """What a sending process hands its engine: ``weights`` encoded for ``plan``
        (:meth:`encode`), or, where the sync is not delta-enabled (``plan`` None) or this
        process does not send (``sending`` False), ``weights`` as they are, this side's copy
        dropped (the receivers' copies no longer match it), unless it is already of
        ``plan``'s version: this process sent it in an earlier round of the same sync (a
        relay that sent patches to some replicas and has no share of the round of whole
        tensors to the rest), and its receivers hold it."""
        if plan is None or not sending:
            self.skip(plan)
            return weights
        return self.encode(weights, plan, rollout_dtype)

    def end(self, plan: DeltaPlan, seen: set[str]) -> None:
        """As :meth:`_Versioned.end`, counting :attr:`deltas_since_full`."""
        super().end(plan, seen)
        self.deltas_since_full = self.deltas_since_full + 1 if plan.is_delta else 0

    def skip(self, plan: DeltaPlan | None) -> None:
        """This process sends nothing of ``plan``'s sync (or the sync is not delta-enabled:
        ``plan`` None): drop this side's copy, unless it is already of ``plan``'s version
        (see :meth:`stream`)."""
        if plan is None or self.version != plan.version:
            self.forget()

    def encoded(self, engine: ShareEncoding, weights: WeightsSource, plan: DeltaPlan | None,
                rollout_dtype: torch.dtype | None, sending: bool = True) -> WeightsSource:
        """What a sending process hands ``engine.send_weights``: :meth:`stream` of
        ``weights``, or, for an engine whose ranks each send their own share
        (``encodes_own_share``), ``weights`` as they are, with ``engine.share_encoder`` set
        to :meth:`stream` its share."""
        if not engine.encodes_own_share:
            return self.stream(weights, plan, rollout_dtype, sending)
        engine.share_encoder = ShareEncoder(self, plan, rollout_dtype, sending)
        return weights

    async def encode(
        self, weights: WeightsSource, plan: DeltaPlan,
        rollout_dtype: torch.dtype | None, who: str = "this actor rank",
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """``weights`` as this sync sends them: cast to ``rollout_dtype``, then whole (a
        full sync) or as patches (a delta sync; a ``uint8`` tensor per name).

        Raises:
            DeltaBaselineError: a delta sync against a version this sender does not hold.
            ManifestChangedError: a delta sync meets a tensor that was not in the last
                version, or whose shape or dtype changed (a change of layout needs a full
                sync: ``allow_manifest_change=True``).
        """
        stats = self.begin(plan, who)
        seen: set[str] = set()
        async for name, tensor in iter_named_tensors(weights):
            tensor = cast_for_rollout(tensor, rollout_dtype)
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            stats.elements += tensor.numel()
            stats.model_bytes += nbytes
            if not plan.is_delta:
                self.baselines[name] = host_copy(tensor)
                stats.changed += tensor.numel()
                stats.wire_bytes += nbytes
                yield name, tensor
                continue
            start = time.perf_counter()
            patch, patch_stats = encode_patch(tensor, self._baseline(name, tensor))
            stats.seconds += time.perf_counter() - start
            stats.changed += patch_stats.changed
            stats.wire_bytes += patch_stats.nbytes
            yield name, patch
        self.end(plan, seen)

    def _baseline(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        old = self.baselines.get(name)
        if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            self.forget()
            raise layout_changed(name, None if old is None else (old.shape, old.dtype), tensor)
        return old


def layout_changed(name: str, last: tuple[torch.Size, torch.dtype] | None,
                   tensor: torch.Tensor) -> ManifestChangedError:
    """The error of a delta sync meeting ``tensor`` under ``name`` whose shape and dtype in
    the last version were ``last`` (None: it was not in it)."""
    was = ("was not in the last version" if last is None else
           f"changed from {list(last[0])} {last[1]} to {list(tensor.shape)} {tensor.dtype}")
    return ManifestChangedError(
        f"tensor {name!r} {was}: a delta sync needs the layout of the last one. If the "
        "model's layout changed on purpose, pass allow_manifest_change=True (that sync is a "
        "full one)", tensors=[name],
    )


class DeltaReceiver(_Versioned):
    """A rollout worker's side: keeps the last received version and rebuilds each tensor of
    a delta sync from its patch, checking the whole result against the sender's digest
    before the server sees it. The last version is a host copy of each tensor, private to
    this receiver (the server gets tensors of its own, which it may keep or change), or,
    where the server offers its own tensor of that shape and dtype (``in_place``), that
    tensor, patched where it lives."""

    def __init__(self) -> None:
        super().__init__()
        self._in_place: set[str] = set()
        """Names whose copy is the server's own tensor."""

    @property
    def kept_bytes(self) -> int:
        """Bytes of the copies this receiver keeps itself (the server's own tensors that it
        patches in place not counted)."""
        return sum(copy.numel() * copy.element_size() for name, copy in self.baselines.items()
                   if name not in self._in_place)

    def keep(self, name: str, copy: torch.Tensor) -> None:
        """Keep ``copy`` (this receiver's own) as the copy of ``name`` in a full sync."""
        self.baselines[name] = copy
        self._in_place.discard(name)

    def detach_from_server(self) -> None:
        """Make every copy that is the server's own tensor (patched in place by earlier
        syncs) a private copy, so that decoding the next sync writes into no tensor the
        server serves (a staged sync, whose server keeps serving the last version)."""
        for name in self._in_place:
            self.baselines[name] = self.baselines[name].clone()
        self._in_place.clear()

    def received(self, engine: ReceivingEngine, global_steps: int | None,
                 plan: DeltaPlan | None, in_place: Mapping[str, torch.Tensor] | None = None,
                 ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """What a receiving process hands its server: :meth:`stream` of what ``engine``
        receives, or, for an engine that decodes the pieces it receives itself
        (``decodes_own_pieces``), what it receives, with ``engine.share_decoder`` set to
        decode them against this receiver's copy."""
        if not getattr(engine, "decodes_own_pieces", False):
            return self.stream(engine.receive_weights(global_steps), plan, in_place)
        cast(ShareDecoding, engine).share_decoder = ShareDecoder(self, plan)
        return engine.receive_weights(global_steps)

    def stream(self, received: AsyncIterator[tuple[str, torch.Tensor]],
               plan: DeltaPlan | None, in_place: Mapping[str, torch.Tensor] | None = None,
               ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """What a receiving process hands its server: ``received`` decoded for ``plan``
        (:meth:`decode`), or, where the sync is not delta-enabled, ``received`` as it is,
        this side's copy dropped (the weights change under it)."""
        if plan is None:
            self.forget()
            return received
        return self.decode(received, plan, in_place=in_place)

    async def decode(
        self, stream: AsyncIterator[tuple[str, torch.Tensor]], plan: DeltaPlan,
        who: str = "this rollout worker", in_place: Mapping[str, torch.Tensor] | None = None,
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Whole tensors from what arrived, the server's to keep or change: no later sync
        writes into them. In a full sync they are the tensors that arrived; in a delta sync,
        a copy of this receiver's copy once patched (:meth:`_handed_over`), or, for a name
        in ``in_place`` (the server's own tensors: see :meth:`stream`), the server's tensor
        itself, patched. A full sync keeps the server's tensor of a name as the copy of the
        version where it has the received tensor's shape, dtype and device and is
        contiguous (the server loads the tensor into it; it must not change it between
        syncs), else a host copy of its own.

        Raises:
            DeltaBaselineError: a delta sync against a version this receiver does not hold
                (raised before anything is applied).
            VerificationError: a rebuilt tensor differs from the sender's, or a patch names
                a tensor this receiver holds no copy of, or is no patch.
        """
        stats = self.begin(plan, who)
        seen: set[str] = set()
        async for name, tensor in stream:
            seen.add(name)
            stats.wire_bytes += tensor.numel() * tensor.element_size()
            if plan.is_delta:
                tensor = self._apply(name, tensor, who, stats)
            else:
                target = _patchable(in_place, name, tensor)
                if target is None:  # the server gets the tensor that arrived
                    self.baselines[name] = host_copy(tensor)
                    self._in_place.discard(name)
                else:  # the server loads ``tensor`` into it
                    self.baselines[name] = target
                    self._in_place.add(name)
                stats.changed += tensor.numel()
            stats.elements += tensor.numel()
            stats.model_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor
        self.end(plan, seen)

    def _handed_over(self, name: str, patched: torch.Tensor) -> torch.Tensor:
        """What the server gets of ``name`` once its copy is ``patched``: the server's own
        tensor where it is patched in place, else a copy (the next sync patches this
        receiver's copy, and the server may keep what it gets, or change it while loading)."""
        return patched if name in self._in_place else patched.clone()

    def _apply(self, name: str, patch: torch.Tensor, who: str,
               stats: DeltaStats) -> torch.Tensor:
        """Apply ``patch`` to this receiver's copy of ``name``; returns what the server gets
        (:meth:`_handed_over`)."""
        baseline = self.copy_of(name, who)
        self.apply(name, patch, baseline, who, stats)
        return self._handed_over(name, baseline)

    def copy_of(self, name: str, who: str) -> torch.Tensor:
        """This receiver's copy of ``name``, which a delta sync patches.

        Raises:
            VerificationError: it holds none (its copies are dropped).
        """
        baseline = self.baselines.get(name)
        if baseline is None:
            self.forget()
            raise VerificationError(
                f"{who}: the delta sync sent a patch for tensor {name!r}, of which it holds "
                "no copy; it gets a full copy next sync", tensors=[name],
            )
        return baseline

    def apply(self, name: str, patch: torch.Tensor, baseline: torch.Tensor, who: str,
              stats: DeltaStats) -> None:
        """Apply ``patch`` to ``baseline`` (contiguous: this receiver's copy of ``name``, or
        of a piece of it), the time it took and what changed counted in ``stats``.

        Raises:
            VerificationError: the result differs from the sender's, or ``patch`` is none
                of ``baseline`` (naming ``who`` and ``name``; its copies are dropped).
        """
        start = time.perf_counter()
        try:
            patch_stats = apply_patch(patch, baseline, name)
        except PatchDigestError as exc:
            self.forget()
            raise VerificationError(
                f"{who}: {exc}: its copy of the last version was not the sender's; it was "
                "not loaded, and this worker gets a full copy next sync", tensors=[name],
            ) from None
        except ValueError as exc:
            self.forget()
            raise VerificationError(f"{who}: {exc}", tensors=[name]) from None
        stats.seconds += time.perf_counter() - start
        stats.changed += patch_stats.changed
