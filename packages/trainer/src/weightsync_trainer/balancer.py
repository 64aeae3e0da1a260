"""Request routing across rollout replicas (kept free of heavy imports: it runs as a small
Ray actor)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["GlobalRequestLoadBalancer"]


class GlobalRequestLoadBalancer:
    """Least-in-flight routing with sticky sessions.

    :meth:`acquire` returns the server with the fewest requests in flight (ties: the one that
    has served fewest, then the first listed); a ``request_id`` seen before goes back to the
    server it went to (multi-turn requests reuse that server's state). Call :meth:`release`
    when the request finishes. :class:`~weightsync_trainer.LLMServerManager` runs it as a Ray
    actor shared by every client.

    Args:
        server_ids: the servers (replica names) to route to.
        max_sessions: sticky entries kept (least recently used are forgotten first).
    """

    def __init__(self, server_ids: Sequence[str], max_sessions: int = 100_000) -> None:
        if not server_ids:
            raise ValueError("GlobalRequestLoadBalancer needs at least one server id")
        if len(set(server_ids)) != len(server_ids):
            raise ValueError(f"server ids must be unique, got {list(server_ids)}")
        self._in_flight = dict.fromkeys(server_ids, 0)
        self._served = dict.fromkeys(server_ids, 0)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions

    def acquire(self, request_id: str | None = None) -> str:
        """Pick the server for one request and count it in flight."""
        server = self._sessions.get(request_id) if request_id is not None else None
        if server is None:
            server = min(self._in_flight,
                         key=lambda s: (self._in_flight[s], self._served[s]))
        if request_id is not None:
            self._sessions[request_id] = server
            self._sessions.move_to_end(request_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        self._in_flight[server] += 1
        self._served[server] += 1
        return server

    def release(self, server_id: str) -> None:
        """Mark one request on ``server_id`` finished."""
        if self._in_flight.get(server_id, 0) <= 0:
            raise ValueError(f"release({server_id!r}) without a matching acquire")
        self._in_flight[server_id] -= 1

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per server."""
        return dict(self._in_flight)
