"""A rendezvous store that only the members of one sync can use.

torch's ``TCPStore`` answers anyone who connects: it lists its keys, hands out values and
takes writes, so a process outside the sync could read the members' addresses, claim a rank
or fill the store. The broadcast engines' groups rendezvous through this store instead:
group rank 0 serves it (:class:`SealedStoreServer`) on the socket it reserved on the
configured host, and every rank talks to it through :class:`SealedStore`, a
``torch.distributed.Store`` that gloo (and NCCL, HCCL) use as they would a ``TCPStore``.

Every request and every reply is a fixed ``msgspec`` schema sealed with HMAC-SHA256 under a
key derived from the sync's session key (:class:`~weightsync_core.net.wire.MessageSealer`), and
carries a random nonce the server accepts once: without the key nothing can be read, written,
listed or joined, and a captured request cannot be played again. There is no operation that
lists keys. Before a request is authenticated it costs the server little: a frame over
:data:`MAX_FRAME_BYTES` closes the connection before it is read, a request must arrive whole
within :data:`REQUEST_SECONDS` of the connection, and at most :data:`MAX_CONNECTIONS`
connections wait for their request at once (a new one closes the oldest: a member, who
sends its request as soon as it connects, gets through a flood of idle connections).

A flood of connections (opened and closed as fast as an attacker's program can) fills the
listener's queue, and the kernel drops a connection that finds it full: a member would then
wait for TCP's retransmission, a second and more, doubling each time. A member instead gives
a connection :data:`CONNECT_SECONDS` to open and then opens a new one, and sends a request
the store closed unanswered (it never took it) again under a new nonce, until the
request's deadline: a flood delays a member by its own length at most, never past it.
A group kept between syncs keeps its store under the key of the sync that built it, which no
one outside that sync ever held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Literal

import msgspec
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from weightsync_core.api.errors import MalformedMessageError, UnauthenticatedMessageError
from weightsync_core.net.wire import MessageCodec, MessageSealer, worth_logging

__all__ = [
    "CONNECT_SECONDS",
    "MAX_CONNECTIONS",
    "MAX_FRAME_BYTES",
    "REQUEST_SECONDS",
    "SealedStore",
    "SealedStoreServer",
]

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 10
"""The largest request or reply (rendezvous values are a few hundred bytes)."""
REQUEST_SECONDS = 2.0
"""A connection must deliver its whole request within this time, or it is closed."""
MAX_CONNECTIONS = 256
"""Connections waiting for their request at once; a new one closes the oldest."""
CONNECT_SECONDS = 0.25
"""How long a member waits for a connection to the store to open before it tries a new one
(a full listener queue drops the attempt, and TCP would retry only after a second)."""
MAX_KEYS = 1 << 16
MAX_STORED_BYTES = 64 << 20
"""What members may store in all (a guard against a member's bug, not against outsiders,
who can store nothing)."""
_LENGTH = struct.Struct("!I")
_NONCE_BYTES = 16

Operation = Literal["set", "get", "add", "compare_set", "check", "wait", "delete", "count"]


class _Request(msgspec.Struct, array_like=True, frozen=True):
    nonce: bytes
    op: Operation
    keys: list[str]
    value: bytes = b""
    expected: bytes = b""
    amount: int = 0
    timeout: float = 0.0


class _Reply(msgspec.Struct, array_like=True, frozen=True):
    nonce: bytes
    value: bytes = b""
    number: int = 0
    missing: list[str] = []
    error: str = ""


_REQUESTS: MessageCodec[_Request] = MessageCodec(_Request)
_REPLIES: MessageCodec[_Reply] = MessageCodec(_Reply)


class _StoreFull(Exception):
    """A member stored more than the store holds."""


class _Table:
    """The stored keys and values, with waits on keys (lives on the server's loop)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.nbytes = 0
        self.changed = asyncio.Condition()
        self.closing = False

    async def until_present(self, keys: list[str], timeout: float) -> list[str]:
        """Wait until every key is present (or the store closes); the keys still missing
        then, or after ``timeout`` seconds (none: all present)."""
        async with self.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait_for(
                    lambda: self.closing or all(key in self.values for key in keys)), timeout)
            return [key for key in keys if key not in self.values]

    async def close(self) -> None:
        """End every wait now: each is answered with the keys it still misses."""
        async with self.changed:
            self.closing = True
            self.changed.notify_all()

    async def put(self, key: str, value: bytes) -> None:
        old = self.values.get(key)
        size = self.nbytes + len(value) - (len(old) if old is not None else 0)
        if (old is None and len(self.values) >= MAX_KEYS) or size > MAX_STORED_BYTES:
            raise _StoreFull(f"the rendezvous store holds at most {MAX_KEYS} keys and "
                             f"{MAX_STORED_BYTES} bytes")
        async with self.changed:
            self.values[key] = value
            self.nbytes = size
            self.changed.notify_all()

    def pop(self, key: str) -> bool:
        value = self.values.pop(key, None)
        if value is None:
            return False
        self.nbytes -= len(value)
        return True


class SealedStoreServer:
    """Serves a rendezvous store on ``listener`` (a socket already listening on the
    configured host) to whoever holds ``key``, from a thread of its own until
    :meth:`close`.

    Args:
        listener: the listening socket (the server takes it over).
        key: the store's key (derived from the sync's session key).
        timeout: the longest a member's blocking ``get`` or ``wait`` may last.
    """

    def __init__(self, listener: socket.socket, key: bytes, timeout: float) -> None:
        self._sealer = MessageSealer(key)
        self._timeout = timeout
        self._seen: set[bytes] = set()
        self.rejected = 0
        """Connections closed for an unauthenticated, malformed, oversized, late or
        replayed request."""
        self._waiting: dict[asyncio.Task, None] = {}
        """Connections whose request has not arrived, oldest first."""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=self._run, args=(listener,), name="weightsync-store", daemon=True
        )
        self._thread.start()
        self._started.wait()

    def _run(self, listener: socket.socket) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve_until_closed(listener))
        finally:
            self._loop.close()

    async def _serve_until_closed(self, listener: socket.socket) -> None:
        self._table = _Table()
        self._stopped = asyncio.Event()
        server = await asyncio.start_server(self._serve, sock=listener,
                                            limit=MAX_FRAME_BYTES + _LENGTH.size)
        self._started.set()
        await self._stopped.wait()
        server.close()
        # members still waiting (a rank whose group is failing) get their answer, not a
        # closed connection: which keys never came names the ranks that never arrived
        await self._table.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=REQUEST_SECONDS)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()

    def close(self) -> None:
        """Stop serving and close every connection and the listener (idempotent)."""
        stopped = self._stopped
        if stopped is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(stopped.set)
        self._thread.join(timeout=5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is None:  # a connection callback always runs in a task
            raise RuntimeError("the rendezvous store served a connection outside a task")
        self._waiting[me] = None
        if len(self._waiting) > MAX_CONNECTIONS:
            next(iter(self._waiting)).cancel()  # the oldest connection still silent
        try:
            try:
                request = await self._read_request(reader)
            finally:
                self._waiting.pop(me, None)
            if request is None:
                return
            reply = await self._answer(request)
            writer.write(_frame(self._sealer.seal(_REPLIES.encode(reply))))
            await asyncio.wait_for(writer.drain(), REQUEST_SECONDS)
        except (OSError, TimeoutError, asyncio.CancelledError):
            pass  # the peer went away, would not read its reply, or was crowded out
        finally:
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader) -> _Request | None:
        """The connection's one request, authenticated and decoded; None (the connection is
        to be closed unanswered) for anything else."""
        try:
            async with asyncio.timeout(REQUEST_SECONDS):
                (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                if length > MAX_FRAME_BYTES:
                    raise MalformedMessageError(f"a {length}-byte frame")
                frame = await reader.readexactly(length)
            request = _REQUESTS.decode(self._sealer.open(frame))
            if len(request.nonce) != _NONCE_BYTES or request.nonce in self._seen:
                raise UnauthenticatedMessageError("a replayed request")
        except (asyncio.IncompleteReadError, TimeoutError, MalformedMessageError,
                UnauthenticatedMessageError) as exc:
            self.rejected += 1
            if worth_logging(self.rejected):
                logger.warning("rendezvous store closed a connection (%d so far): %s",
                               self.rejected, exc or type(exc).__name__)
            return None
        self._seen.add(request.nonce)
        return request

    async def _answer(self, request: _Request) -> _Reply:
        table, keys, nonce = self._table, request.keys, request.nonce
        wait = min(max(request.timeout, 0.0), self._timeout)
        try:
            if request.op == "set":
                await table.put(keys[0], request.value)
            elif request.op == "get":
                if await table.until_present(keys[:1], wait):
                    return _Reply(nonce, error=f"key {keys[0]!r} not set within {wait:.0f}s")
                return _Reply(nonce, table.values[keys[0]])
            elif request.op == "add":
                number = int(table.values.get(keys[0], b"0")) + request.amount
                await table.put(keys[0], str(number).encode())
                return _Reply(nonce, number=number)
            elif request.op == "compare_set":
                current = table.values.get(keys[0])
                if (current is None and not request.expected) or current == request.expected:
                    await table.put(keys[0], request.value)
                    return _Reply(nonce, request.value)
                return _Reply(nonce, request.expected if current is None else current)
            elif request.op in ("check", "wait"):
                missing = await table.until_present(keys, wait if request.op == "wait" else 0)
                return _Reply(nonce, missing=missing)
            elif request.op == "delete":
                return _Reply(nonce, number=int(table.pop(keys[0])))
            elif request.op == "count":
                return _Reply(nonce, number=len(table.values))
        except (IndexError, ValueError, _StoreFull) as exc:
            return _Reply(nonce, error=f"{request.op} refused: {exc}")
        return _Reply(nonce)


class SealedStore(Store):
    """A member's connection to a :class:`SealedStoreServer`: a ``torch.distributed.Store``
    whose every request is sealed with the store's key (one TCP connection per request).

    Keep a reference to it for as long as torch uses it (a ``PrefixStore`` over it, a
    process group): torch calls back into this Python object.

    Args:
        host: the server's address.
        port: the server's port.
        key: the store's key.
        timeout: how long a ``get`` or ``wait`` waits for its keys, and the bound of every
            request.
    """

    def __init__(self, host: str, port: int, key: bytes, timeout: float) -> None:
        super().__init__()
        self.host, self.port, self._key, self._timeout = host, port, key, timeout
        self._sealer = MessageSealer(key)

    # -- the c10d Store interface (names as torch's trampoline looks them up) --------------
    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``."""
        self._call("set", [key], value=_as_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, once it is set (at most ``timeout`` seconds)."""
        return self._call("get", [key], timeout=self._timeout).value

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the counter ``key``; its new value."""
        return self._call("add", [key], amount=value).number

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (or is unset and
        ``expected_value`` is empty); the value it holds afterwards."""
        return self._call("compare_set", [key], value=_as_bytes(desired_value),
                          expected=_as_bytes(expected_value)).value

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set (no waiting)."""
        return not self._call("check", list(keys)).missing

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key is set; :class:`torch.distributed.DistStoreError` after
        ``timeout`` (default: the store's)."""
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        missing = self.missing_after(list(keys), seconds)
        if missing:
            raise dist.DistStoreError(f"rendezvous keys {missing} not set within {seconds:.0f}s")

    def missing_after(self, keys: list[str], timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds until every key is set; the keys still missing
        then (one request: the answer does not depend on the server staying up)."""
        return self._call("wait", keys, timeout=timeout).missing

    def deleteKey(self, key: str) -> bool:
        """Remove ``key``; whether it was set."""
        return bool(self._call("delete", [key]).number)

    def getNumKeys(self) -> int:
        """How many keys are set."""
        return self._call("count", []).number

    def clone(self) -> SealedStore:
        """Another client of the same store."""
        return SealedStore(self.host, self.port, self._key, self._timeout)

    # -- one request ---------------------------------------------------------------------
    def _call(self, op: Operation, keys: list[str], *, value: bytes = b"",
              expected: bytes = b"", amount: int = 0, timeout: float = 0.0) -> _Reply:
        deadline = time.monotonic() + timeout + self._timeout
        attempt = 0
        while True:
            attempt += 1
            nonce = secrets.token_bytes(_NONCE_BYTES)
            request = _Request(nonce, op, keys, value, expected, amount, timeout)
            try:
                reply = self._exchange(request, deadline)
            except _ClosedUnanswered as exc:
                if time.monotonic() < deadline:
                    continue
                raise self._unanswered(op, exc, attempt) from exc
            except (OSError, MalformedMessageError, UnauthenticatedMessageError) as exc:
                raise self._unanswered(op, exc, attempt) from exc
            if reply.nonce != nonce:
                raise dist.DistStoreError("the rendezvous store answered another request")
            if reply.error:
                raise dist.DistStoreError(f"rendezvous store: {reply.error}")
            return reply

    def _exchange(self, request: _Request, deadline: float) -> _Reply:
        """One connection: send ``request``, read the reply.

        Raises:
            _ClosedUnanswered: the server closed the connection before any byte of a reply
                (it did not take the request).
        """
        with self._connect(deadline) as connection:
            try:
                connection.sendall(_frame(self._sealer.seal(_REQUESTS.encode(request))))
                header = _receive(connection, _LENGTH.size, deadline)
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise _ClosedUnanswered(str(exc)) from exc
            (length,) = _LENGTH.unpack(header)
            if length > MAX_FRAME_BYTES:
                raise MalformedMessageError(f"a {length}-byte reply")
            try:
                body = _receive(connection, length, deadline)
            except _ClosedUnanswered as exc:  # the header came: the request was taken
                raise ConnectionError("the store closed the connection mid-reply") from exc
            return _REPLIES.decode(self._sealer.open(body))

    def _connect(self, deadline: float) -> socket.socket:
        """A connection to the store, opened within :data:`CONNECT_SECONDS` (attempts that
        take longer are dropped for new ones until ``deadline``).

        Raises:
            _ClosedUnanswered: no attempt opened before ``deadline``.
            OSError: the store refused the connection (it does not listen).
        """
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _ClosedUnanswered("no connection to the store opened in time")
            try:
                return socket.create_connection((self.host, self.port),
                                                timeout=min(CONNECT_SECONDS, left))
            except TimeoutError:
                continue

    def _unanswered(self, op: Operation, exc: Exception, attempts: int) -> dist.DistStoreError:
        tries = f" ({attempts} tries)" if attempts > 1 else ""
        return dist.DistStoreError(
            f"the weight-sync rendezvous store at {self.host}:{self.port} (group rank 0) did "
            f"not answer a {op}{tries} ({type(exc).__name__}: {exc})"
        )


class _ClosedUnanswered(ConnectionError):
    """The store closed a connection before answering: it never took the request (a
    request it takes is always answered), so sending it again is safe."""


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _frame(sealed: bytes) -> bytes:
    return _LENGTH.pack(len(sealed)) + sealed


def _receive(connection: socket.socket, nbytes: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no reply in time")
        connection.settimeout(left)
        chunk = connection.recv(nbytes - len(data))
        if not chunk:
            if data:
                raise ConnectionError("the store closed the connection mid-reply")
            raise _ClosedUnanswered("the store closed the connection unanswered")
        data += chunk
    return bytes(data)
