"""How a trainer without weightsync's manager (vLLM's trainer-side API) and vLLM's workers
meet for one sync: each worker sends the trainer its engine's ``prepare`` metadata, the
trainer answers with that worker's ``init_process_group`` arguments.

Both sides bind their inbox on their configured host only and seal every message with the
sync's fresh session key, which the trainer hands the workers through vLLM's own control
calls (``update_weights``); a message that is not sealed with it, or does not decode into
this schema (MessagePack, never pickle), is dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from weightsync_core import WeightSyncError
from weightsync_core.spi import ControlChannel

__all__ = ["Arguments", "Joined", "RendezvousMessage", "gather_joins"]


class Joined(msgspec.Struct, tag="joined"):
    """Worker to trainer: this worker (``rank`` among the sync's receivers) is ready;
    ``metadata`` is its engine's ``prepare()``; the trainer answers at ``reply_to``."""

    rank: int
    reply_to: str
    metadata: dict[str, Any]


class Arguments(msgspec.Struct, tag="arguments"):
    """Trainer to worker: the worker's ``init_process_group`` arguments."""

    kwargs: dict[str, Any]


RendezvousMessage = Joined | Arguments
"""Every message of the rendezvous."""


async def gather_joins(channel: ControlChannel[RendezvousMessage], receivers: int,
                       timeout: float) -> list[Joined]:
    """The ``Joined`` of receivers ``0 .. receivers - 1``, in rank order.

    Raises:
        WeightSyncError: a rank out of range or twice, or a receiver that did not join
            within ``timeout`` seconds (naming the ranks that are missing).
    """
    joined: dict[int, Joined] = {}
    deadline = asyncio.get_running_loop().time() + timeout
    while len(joined) < receivers:
        left = deadline - asyncio.get_running_loop().time()
        try:
            message = await channel.receive(max(left, 0.0))
        except TimeoutError:
            missing = sorted(set(range(receivers)) - set(joined))
            raise WeightSyncError(
                f"vLLM worker rank(s) {missing} did not join the sync within {timeout:.0f} s "
                f"({len(joined)} of {receivers} did); is num_receivers the number of vLLM "
                "workers, and did update_weights reach them?"
            ) from None
        if not isinstance(message, Joined):
            continue
        if not 0 <= message.rank < receivers or message.rank in joined:
            raise WeightSyncError(
                f"a vLLM worker joined as rank {message.rank}, which is out of range or "
                f"taken ({receivers} receivers expected)"
            )
        joined[message.rank] = message
    return [joined[rank] for rank in range(receivers)]
