"""The wire format of everything a network peer can send to an engine.

Control messages (the ring's bucket announcements and credits, the broadcast engines' bucket
metadata, kimi's shares) are instances of fixed ``msgspec`` schemas, encoded as MessagePack
and sealed with an HMAC-SHA256 tag under the sync's *session key*: a fresh random secret the
manager hands every process of a sync through Ray (:meth:`CheckpointEngine.set_session_key
<weightsync_core.api.engine.CheckpointEngine.set_session_key>`). A receiver checks the tag before
it decodes a single byte, and decodes only into the declared types (numbers, strings, bytes,
lists, the schema's own classes and ``torch.dtype`` names from a fixed table), so nothing a
peer sends can run code, and nothing from outside the sync is even parsed.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Generic, TypeVar

import msgspec

from weightsync_core.api.dtypes import decode_hook, encode_hook
from weightsync_core.api.errors import MalformedMessageError, UnauthenticatedMessageError
from weightsync_core.api.session_key import check_session_key

__all__ = [
    "MessageCodec",
    "MessageSealer",
    "worth_logging",
]

_TAG_BYTES = hashlib.sha256().digest_size
_KEY_ID_BYTES = 8

M = TypeVar("M")


class MessageSealer:
    """Seals and opens frames with HMAC-SHA256 under one session key.

    A frame is ``key id || tag || body``: the key id (public, derived from the key) lets a
    receiver tell a late message of an earlier sync from a forged one without trying keys.

    Args:
        key: the session key (at least 16 bytes).
    """

    def __init__(self, key: bytes) -> None:
        self._key = check_session_key(key)
        self.key_id = hmac.digest(self._key, b"key id", "sha256")[:_KEY_ID_BYTES]

    @staticmethod
    def key_id_of(frame: bytes) -> bytes:
        """The key id a frame claims (unverified)."""
        return frame[:_KEY_ID_BYTES]

    def seal(self, body: bytes) -> bytes:
        """``key id || tag || body``."""
        return self.key_id + hmac.digest(self._key, body, "sha256") + body

    def open(self, frame: bytes) -> bytes:
        """The body of a frame sealed under this key.

        Raises:
            UnauthenticatedMessageError: the frame is too short or its tag does not match.
        """
        tag = frame[_KEY_ID_BYTES : _KEY_ID_BYTES + _TAG_BYTES]
        body = frame[_KEY_ID_BYTES + _TAG_BYTES :]
        expected = hmac.digest(self._key, body, "sha256")
        if len(tag) != _TAG_BYTES or not hmac.compare_digest(tag, expected):
            raise UnauthenticatedMessageError(
                f"a {len(frame)}-byte message does not carry this sync's authentication tag"
            )
        return body

    def derive_key(self, label: str) -> bytes:
        """A key derived from this one for ``label`` (e.g. the rendezvous store's), so that
        what is sealed for one use is refused by another."""
        return hmac.digest(self._key, label.encode(), "sha256")


class MessageCodec(Generic[M]):
    """Encodes and validates messages of one schema (a ``msgspec`` type, usually a union of
    tagged ``msgspec.Struct`` classes) as MessagePack.

    Args:
        schema: the type every decoded message must have.
    """

    def __init__(self, schema: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)
        self._decoder = msgspec.msgpack.Decoder(schema, dec_hook=decode_hook)

    def encode(self, message: M) -> bytes:
        """The message's bytes."""
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> M:
        """The message in ``data``.

        Raises:
            MalformedMessageError: ``data`` is not a valid message of the schema.
        """
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessageError(f"malformed control message: {exc}") from exc


def worth_logging(count: int) -> bool:
    """Whether the ``count``-th frame dropped by a listener is worth a log line: the 1st,
    10th, 100th, ... (visible, but no log flood)."""
    while count % 10 == 0:
        count //= 10
    return count == 1
