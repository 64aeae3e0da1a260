"""A stand-in for vLLM's ``StatelessProcessGroup``, for verl's engines that import it (verl
0.9.1's Mooncake engine) where neither vLLM nor SGLang is installed.

It has the interface those engines use (``create``, ``send_obj``, ``recv_obj``,
``all_gather_obj``, ``broadcast_obj``, ``barrier``) and none of vLLM's exposure: vLLM's
group pickles objects through a ``TCPStore`` that anyone who connects can read and write.
Here rank 0 serves weightsync's sealed rendezvous store on the address the engine gave
(``weightsync_core.spi.create_store``): only the processes of the running sync, which hold
its session key, can use it, and objects travel as msgpack with two extension types
(``torch.dtype`` by name and ``torch.Size``), so nothing received can carry code.

The session key and the timeout come from the engine whose ``init_process_group`` is
running (:func:`membership`): :func:`weightsync_verl.verl_engines.load_on_weightsync` wraps
that method of the engines it loads.
"""

from __future__ import annotations

import contextlib
import contextvars
import socket
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import torch

from weightsync_core.spi import (
    GroupInitTimeoutError,
    MessageSealer,
    RendezvousStore,
    check_bind_host,
    create_store,
    rendezvous,
)

__all__ = ["MAX_DEPTH", "MAX_PARTS", "Membership", "StatelessProcessGroup", "decode_object",
           "encode_object", "membership"]

_DTYPE = 1
_SIZE = 2
_PART_BYTES = 32 << 10
"""Values travel in parts of at most this size: the sealed store takes requests of up to
64 KiB (a bucket's metadata, one entry per tensor, can be far larger)."""
_STORE_BYTES = 64 << 20
"""What the sealed rendezvous store holds in all (weightsync-core's
``sealed_store.MAX_STORED_BYTES``): no value stored there has more parts than fit in it."""
MAX_PARTS = -(-_STORE_BYTES // _PART_BYTES)
"""The most parts a value can have (2,048): a count above it is refused before any key is
read."""
MAX_DEPTH = 32
"""The deepest nesting of lists and dicts an object may have (verl's bucket messages nest 4
deep, their ``torch.Size`` included)."""

_Dimensions = list[Annotated[int, msgspec.Meta(ge=0)]]


@dataclass(frozen=True)
class Membership:
    """What a group needs from the sync it serves.

    Attributes:
        session_key: the sync's session key (the store's key is derived from it).
        timeout: seconds a ``recv_obj`` or the group's forming may wait.
        rank_name: names the process in errors (``"verl_mooncake engine"``).
    """

    session_key: bytes
    timeout: float
    rank_name: str


_CURRENT: contextvars.ContextVar[Membership | None] = contextvars.ContextVar(
    "weightsync_verl_group_membership", default=None
)


@contextlib.contextmanager
def membership(member: Membership) -> Iterator[None]:
    """Groups created inside this block belong to ``member``'s sync."""
    token = _CURRENT.set(member)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _with_sizes_marked(value: Any) -> Any:
    """``value`` with every ``torch.Size`` as its extension (msgpack would send a tuple
    subclass as a plain array)."""
    if isinstance(value, torch.Size):
        return msgspec.msgpack.Ext(_SIZE, msgspec.msgpack.encode(list(value)))
    if isinstance(value, dict):
        return {key: _with_sizes_marked(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_with_sizes_marked(item) for item in value]
    return value


def _encode_extension(value: Any) -> msgspec.msgpack.Ext:
    if isinstance(value, torch.dtype):
        return msgspec.msgpack.Ext(_DTYPE, str(value).removeprefix("torch.").encode())
    raise TypeError(f"a {type(value).__name__} cannot be sent through the group: send "
                    f"dicts, lists, str, int, float, bool, None, torch.dtype or torch.Size")


def _decode_extension(code: int, data: memoryview) -> Any:
    if code == _DTYPE:
        dtype = getattr(torch, bytes(data).decode(), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{bytes(data)[:40]!r} names no torch dtype")
        return dtype
    if code == _SIZE:
        try:
            return torch.Size(msgspec.msgpack.decode(data, type=_Dimensions))
        except msgspec.ValidationError as exc:
            raise msgspec.DecodeError(f"a torch.Size holds non-negative integer dimensions "
                                      f"only: {exc}") from None
    raise ValueError(f"unknown extension type {code}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_extension)
_DECODER = msgspec.msgpack.Decoder(ext_hook=_decode_extension)


def encode_object(value: Any) -> bytes:
    """``value`` (plain data, ``torch.dtype``, ``torch.Size``) as msgpack bytes."""
    return _ENCODER.encode(_with_sizes_marked(value))


def decode_object(data: bytes) -> Any:
    """What :func:`encode_object` made; never runs code, whatever ``data`` holds.

    Raises:
        msgspec.DecodeError: ``data`` is no such object: not msgpack, lists or dicts
            nested deeper than :data:`MAX_DEPTH`, a ``torch.Size`` with a negative
            dimension (``ValueError`` where an extension names no torch dtype or is of no
            known type).
    """
    try:
        value = _DECODER.decode(data)
    except RecursionError:
        raise msgspec.DecodeError(f"the object nests deeper than the {MAX_DEPTH} levels of "
                                  "lists and dicts accepted") from None
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    """Refuse ``value`` where its lists, tuples (dict keys) and dicts nest deeper than
    :data:`MAX_DEPTH`.

    Raises:
        msgspec.DecodeError: naming the limit.
    """
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        children = ([*item.keys(), *item.values()] if isinstance(item, dict)
                    else item if isinstance(item, list | tuple) else ())
        if children and depth == MAX_DEPTH:
            raise msgspec.DecodeError(f"the object nests deeper than the {MAX_DEPTH} levels "
                                      "of lists and dicts accepted")
        pending.extend((child, depth + 1) for child in children)


def _wait_until_listening(host: str, port: int, member: Membership) -> None:
    """Wait until rank 0 listens on ``host:port`` (it binds only when its own
    ``init_process_group`` runs, which may come after this rank's, as with vLLM's group).

    Raises:
        GroupInitTimeoutError: nothing listened there within the timeout.
    """
    deadline = time.monotonic() + member.timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise GroupInitTimeoutError(
                    f"{member.rank_name}: group rank 0 did not listen on {host}:{port} within "
                    f"{member.timeout:.0f}s ({exc})", missing_ranks=[0]
                ) from exc
            time.sleep(0.05)


class StatelessProcessGroup:
    """vLLM's ``StatelessProcessGroup`` interface over weightsync's sealed store (see the
    module). Build it with :meth:`create` inside :func:`membership`."""

    def __init__(self, store: RendezvousStore, rank: int, world_size: int,
                 timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._timeout = timeout
        self._sent: Counter[int] = Counter()
        self._received: Counter[int] = Counter()
        self._collectives = 0
        weakref.finalize(self, store.close)

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int,
               **_vllm_options: Any) -> StatelessProcessGroup:
        """Form the group: rank 0 serves its store on ``host:port`` (that address only);
        returns once all ``world_size`` ranks have arrived.

        Raises:
            RuntimeError: called outside :func:`membership` (no sync to belong to).
            GroupInitTimeoutError: ranks that did not arrive within the timeout, named.
        """
        member = _CURRENT.get()
        if member is None:
            raise RuntimeError(
                "this StatelessProcessGroup is weightsync's stand-in for vLLM's: it forms only "
                "inside a weightsync sync (an engine loaded by weightsync_verl.verl_engines), "
                "which gives it the sync's key; install vllm or sglang to use theirs elsewhere"
            )
        listener = None
        if rank == 0:
            listener = socket.create_server((check_bind_host(host), port))
        else:
            _wait_until_listening(host, port, member)
        key = MessageSealer(member.session_key).derive_key("verl stateless process group")
        store = create_store(host, port, rank, world_size, member.timeout, "verl", key,
                             listener)
        try:
            rendezvous(store, rank, world_size, member.timeout)
        except GroupInitTimeoutError as exc:
            store.close()
            raise GroupInitTimeoutError(f"{member.rank_name}: {exc}",
                                        missing_ranks=exc.missing_ranks) from exc
        except BaseException:
            store.close()
            raise
        return cls(store, rank, world_size, member.timeout)

    def send_obj(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to rank ``dst`` (returns at once)."""
        self._put(f"p2p/{self.rank}/{dst}/{self._sent[dst]}", encode_object(obj))
        self._sent[dst] += 1

    def recv_obj(self, src: int) -> Any:
        """The next object rank ``src`` sent to this rank (waits up to the timeout)."""
        key = f"p2p/{src}/{self.rank}/{self._received[src]}"
        value = self._take(key)
        self._received[src] += 1
        return decode_object(value)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        round_ = self._collectives
        self._collectives += 1
        self._put(f"gather/{round_}/{self.rank}", encode_object(obj))
        return [decode_object(self._get(f"gather/{round_}/{peer}"))
                for peer in range(self.world_size)]

    def broadcast_obj(self, obj: Any | None, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        round_ = self._collectives
        self._collectives += 1
        key = f"broadcast/{round_}"
        if self.rank == src:
            self._put(key, encode_object(obj))
            return obj
        return decode_object(self._get(key))

    def barrier(self) -> None:
        """Wait until every rank has reached this barrier."""
        self.all_gather_obj(None)

    # -- values in parts the store takes (its requests are small by design) ---------------
    def _put(self, key: str, value: bytes) -> None:
        parts = [value[start:start + _PART_BYTES]
                 for start in range(0, len(value), _PART_BYTES)] or [b""]
        for index, part in enumerate(parts):
            self._store.client.set(f"{key}/{index}", part)
        self._store.client.set(key, str(len(parts)))  # last: the parts are there once it is

    def _get(self, key: str) -> bytes:
        return self._read(key)[0]

    def _take(self, key: str) -> bytes:
        value, names = self._read(key)
        for name in names:
            self._store.client.deleteKey(name)
        return value

    def _read(self, key: str) -> tuple[bytes, list[str]]:
        """The value under ``key`` and the store keys that hold it.

        Raises:
            ValueError: ``key`` holds no count of parts from 1 to :data:`MAX_PARTS`
                (checked before any part's name is made).
        """
        count = self._store.client.get(key)
        if not (count.isdigit() and len(count) <= len(str(MAX_PARTS))
                and 1 <= int(count) <= MAX_PARTS):
            raise ValueError(f"group key {key!r} holds {count[:20]!r}, not a count of parts "
                             f"from 1 to {MAX_PARTS} (a value the store can hold)")
        parts = [f"{key}/{index}" for index in range(int(count))]
        return b"".join(self._store.client.get(part) for part in parts), [key, *parts]
