"""The vLLM plugin (entry point group ``vllm.general_plugins``): registers weightsync's
weight-transfer engine in every vLLM process that loads plugins, and makes vLLM's
multiprocess executor read every worker's reply to a failed call of a weightsync engine
(:mod:`weightsync_vllm.executor_replies`)."""

from __future__ import annotations

import contextlib

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "weightsync"
"""``WeightTransferConfig(backend=...)`` that selects weightsync."""


def register() -> None:
    """Register :class:`~weightsync_vllm.transfer_engine.WeightsyncTransferEngine` under
    :data:`BACKEND_NAME` (lazily: the module is imported when vLLM builds the engine), and
    :func:`weightsync_vllm.executor_replies.install`."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from weightsync_vllm.executor_replies import install

    install(BACKEND_NAME)

    # vLLM loads plugins once per process; a second engine in one process finds it there
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "weightsync_vllm.transfer_engine", "WeightsyncTransferEngine"
        )
