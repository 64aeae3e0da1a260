"""Actors of the vLLM tests (importable in Ray workers through PYTHONPATH)."""

from collections.abc import Iterator

import torch

from weightsync_core.testing.weights import Faults, faulty_stream
from weightsync_vllm.model_source import ModelWeightsSource


class FaultySource(ModelWeightsSource):
    """A sender that fails part-way through its weights, as ``faults`` says."""

    def __init__(self, config, model_path: str, faults: Faults) -> None:
        super().__init__(config, model_path)
        self.faults = faults

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from faulty_stream(dict(super().iter_weights()), self.faults)
