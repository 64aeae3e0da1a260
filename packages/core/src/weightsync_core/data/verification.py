"""Verified delivery: receivers check what arrived against the sender's manifest."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightsync_core.api.checksums import host_checksum
from weightsync_core.api.errors import EmptyWeightsError, ManifestChangedError, VerificationError
from weightsync_core.data.bucketing import BucketMeta

__all__ = [
    "DeliveryVerifier",
    "Manifest",
    "ManifestEntry",
    "ManifestGuard",
]

ManifestEntry = tuple[str, tuple[int, ...], torch.dtype]
"""``(name, shape, dtype)`` of one tensor."""
Manifest = Sequence[ManifestEntry]
"""``(name, shape, dtype)`` of every tensor the sender sent, in order."""


class DeliveryVerifier:
    """Receiver-side checks: per-bucket checksum, then names/shapes/dtypes at the end."""

    def __init__(self, checksum=host_checksum) -> None:
        self._checksum = checksum
        self._received: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def check_bucket(self, data: torch.Tensor, meta: BucketMeta, *, source: str) -> None:
        """Raise if the bucket's bytes do not match the sender's checksum."""
        if meta.checksum is None:
            return
        self.check_checksum(self._checksum(data), meta, source=source)

    def check_checksum(self, actual: int, meta: BucketMeta, *, source: str) -> None:
        """Raise if ``actual``, the checksum of the bucket's bytes as received, is not the
        sender's."""
        if meta.checksum is not None and actual != meta.checksum:
            names = sorted({tensor.name for tensor in meta.tensors})
            raise VerificationError(
                f"bucket {meta.index} from {source} is corrupt (checksum {actual:#018x}, "
                f"sender sent {meta.checksum:#018x}); it holds: {', '.join(names)}",
                tensors=names, source=source,
            )

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """Note one delivered tensor."""
        self._received[name] = (tuple(tensor.shape), tensor.dtype)

    def finish(self, manifest: Manifest, *, incomplete: Sequence[str] = ()) -> None:
        """Compare everything delivered with the sender's manifest; raise on any difference."""
        expected = {name: (tuple(shape), dtype) for name, shape, dtype in manifest}
        missing = sorted(set(expected) - set(self._received))
        extra = sorted(set(self._received) - set(expected))
        mismatched = sorted(
            name for name, spec in self._received.items()
            if name in expected and expected[name] != spec
        )
        problems = []
        if incomplete:
            problems.append(f"incomplete (chunks missing): {', '.join(incomplete)}")
        if missing:
            problems.append(f"missing: {', '.join(missing[:20])}"
                            + (f" and {len(missing) - 20} more" if len(missing) > 20 else ""))
        if extra:
            problems.append(f"not in the sender's manifest: {', '.join(extra[:20])}")
        for name in mismatched[:20]:
            problems.append(
                f"{name}: received shape/dtype {self._received[name]}, sent {expected[name]}"
            )
        if problems:
            raise VerificationError(
                "received weights do not match the sender's manifest: " + "; ".join(problems),
                tensors=[*incomplete, *missing, *extra, *mismatched],
            )


def _describe_spec(spec: tuple[tuple[int, ...], torch.dtype]) -> str:
    shape, dtype = spec
    return f"shape {list(shape)} {str(dtype).removeprefix('torch.')}"


class ManifestGuard:
    """What a receiving process loaded in its last complete sync, checked against each new
    stream as it arrives: a tensor whose name, shape or dtype is new fails *before* the
    server sees it; a tensor that went missing fails at the end of the stream; an empty
    stream always fails. The first sync (nothing loaded yet) and syncs the caller marks with
    ``allow_change`` accept any non-empty set of tensors. A stream becomes the reference for
    the next sync only through :meth:`accept`, once the server has taken all of it: a sync
    the server refused (a tensor its model lacks, one it missed) never becomes one.
    """

    def __init__(self) -> None:
        self._previous: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._current: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._allow_change = True

    def start(self, *, allow_change: bool = False) -> None:
        """Begin checking a new stream."""
        self._current = {}
        self._allow_change = allow_change or self._previous is None

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Note one arriving tensor; raise :class:`ManifestChangedError` if it differs from
        the previous sync's."""
        spec = (tuple(tensor.shape), tensor.dtype)
        self._current[name] = spec
        previous = self._previous
        if self._allow_change or previous is None:  # no reference yet: any layout goes
            return
        before = previous.get(name)
        if before == spec:
            return
        change = ("was not in the previous sync's weights" if before is None else
                  f"changed from {_describe_spec(before)} to {_describe_spec(spec)}")
        raise ManifestChangedError(
            f"tensor {name!r} {change}; refused before loading it. If the model's layout "
            "changed on purpose, pass allow_manifest_change=True to update_weights",
            tensors=[name],
        )

    def finish(self) -> None:
        """End the stream: raise if it was empty or lost tensors."""
        if not self._current:
            raise EmptyWeightsError(
                "the weight stream of this sync held no tensors; nothing was loaded (does the "
                "actor's weight iterator yield anything?)"
            )
        if not self._allow_change and self._previous is not None:
            missing = sorted(set(self._previous) - set(self._current))
            if missing:
                shown = ", ".join(missing[:20]) + (
                    f" and {len(missing) - 20} more" if len(missing) > 20 else ""
                )
                raise ManifestChangedError(
                    f"{len(missing)} tensor(s) of the previous sync are missing from this one: "
                    f"{shown}. If the model's layout changed on purpose, pass "
                    "allow_manifest_change=True to update_weights",
                    tensors=missing,
                )

    def accept(self) -> None:
        """Make the finished stream the reference for the next sync (after the server took
        all of it)."""
        self._previous, self._current = self._current, {}

    @property
    def reference(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """A copy of what the next stream is checked against (None: nothing loaded yet)."""
        return None if self._previous is None else dict(self._previous)

    def restore(self, reference: dict[str, tuple[tuple[int, ...], torch.dtype]] | None
                ) -> None:
        """Make ``reference`` (an earlier :attr:`reference`) the reference again: the load
        that replaced it was undone."""
        self._previous = None if reference is None else dict(reference)
