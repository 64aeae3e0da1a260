"""A sync's session key: the fresh secret the manager hands every process of one sync, under
which every control message and group join of that sync is authenticated
(:mod:`weightsync_core.net.wire`)."""

from __future__ import annotations

import secrets

__all__ = ["SESSION_KEY_BYTES", "check_session_key", "new_session_key"]

SESSION_KEY_BYTES = 32
"""Length of the session keys the manager generates."""
_MIN_KEY_BYTES = 16


def new_session_key() -> bytes:
    """A fresh random session key (from the operating system's CSPRNG)."""
    return secrets.token_bytes(SESSION_KEY_BYTES)


def check_session_key(key: object) -> bytes:
    """``key`` if it is a usable session key, else :class:`ValueError`."""
    if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
        raise ValueError(
            f"a session key must be at least {_MIN_KEY_BYTES} random bytes "
            "(weightsync_core.new_session_key() makes one)"
        )
    return key
