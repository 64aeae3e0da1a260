"""Which LoRA adapter versions a vLLM rollout actor's requests may name, and which requests
in flight use each, so that vLLM never gets a request for an adapter it does not hold (vLLM
would load it from the request's path, fail, and its engine would die) and never lets go of
one a running request uses."""

from __future__ import annotations

from collections import Counter
from typing import Any

from weightsync_core import WeightSyncError

__all__ = ["ServedAdapters"]

_IN_MEMORY_PATH = "/weightsync-in-memory-lora"
"""The ``lora_path`` of weightsync's requests: vLLM needs one, and never reads it, since
weightsync adds every adapter a request names before the request can; absolute, so that vLLM
would not look it up on the Hugging Face Hub if it did."""


class ServedAdapters:
    """The adapter versions every vLLM worker of one engine holds, under the LoRA int id each
    got (:meth:`take`, from the workers' :class:`~weightsync_vllm.lora_store.LoRAStore`
    status), and the requests in flight on each id."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int], int] = {}
        self._retired: set[int] = set()
        self._in_flight: Counter[int] = Counter()
        self._last_id = 0

    def new_id(self) -> int:
        """A LoRA int id no version had (each adapter sync's version gets one)."""
        self._last_id += 1
        return self._last_id

    def take(self, statuses: list[dict[str, Any]]) -> None:
        """What the workers hold (each one's ``LoRAStore.status()``): a version is served
        where every worker holds it under the same id."""
        served: dict[tuple[str, int], int] | None = None
        for status in statuses:
            held = {(entry["name"], entry["version"]): entry["lora_id"]
                    for entry in status["held"]}
            served = held if served is None else {
                key: lora_id for key, lora_id in served.items() if held.get(key) == lora_id}
        self._ids = served or {}
        self._retired = {lora_id for status in statuses for lora_id in status["retired"]}

    def still_retired(self, remaining: list[list[int]]) -> None:
        """The retired ids each worker still holds after a release."""
        self._retired = {lora_id for ids in remaining for lora_id in ids}

    def versions(self) -> dict[str, list[int]]:
        """Per adapter name, the versions requests may name, oldest first."""
        served: dict[str, list[int]] = {}
        for name, version in sorted(self._ids):
            served.setdefault(name, []).append(version)
        return served

    def request(self, adapter: tuple[str, int] | list[Any] | None) -> Any:
        """vLLM's ``LoRARequest`` for ``adapter`` (``(name, version)``; None: the base
        model, no request), counted in flight until :meth:`finished`.

        Raises:
            WeightSyncError: the engine does not serve that version (naming those it does).
        """
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        name, version = adapter
        lora_id = self._ids.get((name, version))
        if lora_id is None:
            raise WeightSyncError(
                f"this vLLM replica serves no version {version!r} of LoRA adapter {name!r} "
                f"(it serves {self.versions() or 'no adapter'}); name one it serves, or sync "
                "that version first (CheckpointEngineManager.update_adapter)")
        self._in_flight[lora_id] += 1
        return LoRARequest(lora_name=f"{name}@{version}#{lora_id}", lora_int_id=lora_id,
                           lora_path=_IN_MEMORY_PATH)

    def finished(self, lora_request: Any) -> None:
        """A request made with ``lora_request`` (None: none) ended."""
        if lora_request is None:
            return
        lora_id = lora_request.lora_int_id
        self._in_flight[lora_id] -= 1
        if self._in_flight[lora_id] <= 0:
            del self._in_flight[lora_id]

    def releasable(self) -> list[int]:
        """The retired ids no request in flight uses (those vLLM may let go of now)."""
        return sorted(self._retired - set(self._in_flight))
