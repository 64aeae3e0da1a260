"""Where a Hugging Face generation, running on its own thread, stops between two tokens
while a replica switches weights: :class:`GenerationGate`."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Literal

__all__ = ["GenerationAborted", "GenerationGate", "PauseMode"]

PauseMode = Literal["keep", "drain", "abort"]
_POLL_SECONDS = 0.001


class GenerationAborted(RuntimeError):
    """A request in flight was ended by a pause in ``abort`` mode; send it again."""


class GenerationGate:
    """Admits generations and parks them at token boundaries during a pause.

    Generation threads call :meth:`enter` before their first token, :meth:`at_token` after
    each (it returns True where the request must end: an ``abort`` pause) and :meth:`leave`
    at the end. The server's event loop calls :meth:`pause` and :meth:`resume`:

    - ``keep``: every generation in flight parks at its next token boundary (its KV cache
      stays), and :meth:`pause` returns once all are parked; after :meth:`resume` they
      continue, on whatever weights the server then holds.
    - ``drain``: generations in flight finish; new ones wait until :meth:`resume`.
    - ``abort``: generations in flight end at their next token (:class:`GenerationAborted`
      for their callers); new ones wait until :meth:`resume`.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._mode: PauseMode | None = None
        self._active = 0
        self._parked = 0
        self.pauses = 0
        """Pauses so far (a generation that saw one may span two weight versions)."""

    @property
    def paused(self) -> bool:
        """Whether a pause is on."""
        return self._mode is not None

    def enter(self) -> None:
        """A generation starts (on its thread): wait out a pause, then count it."""
        with self._condition:
            while self._mode is not None:
                self._condition.wait()
            self._active += 1

    def leave(self) -> None:
        """A generation ended (on its thread)."""
        with self._condition:
            self._active -= 1
            self._condition.notify_all()

    def at_token(self) -> bool:
        """Between two tokens (on the generation's thread): park while a ``keep`` pause is
        on; True where an ``abort`` pause ends the generation."""
        with self._condition:
            if self._mode == "abort":
                return True
            if self._mode == "keep":
                self._parked += 1
                self._condition.notify_all()
                while self._mode == "keep":
                    self._condition.wait()
                self._parked -= 1
            return False

    def _settled(self) -> bool:
        with self._condition:
            if self._mode == "keep":
                return self._parked == self._active
            return self._active == 0

    async def pause(self, mode: PauseMode, timeout_seconds: float | None = None) -> float:
        """Pause as ``mode`` says; return once every generation in flight is parked
        (``keep``) or ended (``drain``, ``abort``). Returns the seconds it waited.

        Raises:
            ValueError: an unknown mode.
            TimeoutError: not settled within ``timeout_seconds`` (the pause stays on).
        """
        if mode not in ("keep", "drain", "abort"):
            raise ValueError(f"pause mode must be 'keep', 'drain' or 'abort', got {mode!r}")
        start = time.monotonic()
        with self._condition:
            self._mode = mode
            self.pauses += 1
            self._condition.notify_all()
        while not self._settled():
            if timeout_seconds is not None and time.monotonic() - start > timeout_seconds:
                raise TimeoutError(f"generations did not settle for a {mode!r} pause within "
                                   f"{timeout_seconds:.0f}s")
            await asyncio.sleep(_POLL_SECONDS)
        return time.monotonic() - start

    def resume(self) -> None:
        """End the pause: parked generations continue, waiting ones start."""
        with self._condition:
            self._mode = None
            self._condition.notify_all()
