"""What the planner needs of a mixture-of-experts model: its bytes, and how many of them the
busiest rollout worker of a replica needs under tensor or expert parallelism (the layout,
not the activated parameters, sets the bytes); the published models' geometries; and the
share of the bytes a delta sync sends when a fraction of the elements changed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightsync_core.data.delta.patch import PATCH_HEADER_BYTES, patch_payload_bytes

__all__ = ["MOE_MODELS", "MoEModelSize", "delta_wire_fraction"]


@dataclass(frozen=True)
class MoEModelSize:
    """A mixture-of-experts decoder's parameter counts, as vLLM splits them.

    Args:
        name: what to call it.
        hidden_size: ``H``.
        num_layers: decoder layers.
        vocab_size: the embedding's rows (and the LM head's, unless ``tied``).
        attention_params: parameters of one layer's attention (q/k/v/o, or MLA's
            projections); split evenly over the tensor-parallel workers (approximation: KV
            heads replicated where the workers outnumber them, and MLA's small replicated
            projections, are counted as split).
        num_experts: routed experts per MoE layer; each ``3 x I x H`` parameters.
        moe_intermediate_size: ``I``.
        dense_layers: leading layers with a dense MLP instead (``3 x dense_intermediate_size
            x H``, split like attention).
        dense_intermediate_size: their width.
        shared_intermediate_size: the shared experts' total width per MoE layer (split like
            a dense MLP; 0: none).
        bytes_per_param: 2 for BF16, 1 for FP8 (the scales not counted).
        tied: the LM head is the embedding.
    """

    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    attention_params: int
    num_experts: int
    moe_intermediate_size: int
    dense_layers: int = 0
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    bytes_per_param: float = 2.0
    tied: bool = False

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts."""
        return self.num_layers - self.dense_layers

    def _split_params(self) -> int:
        """Parameters every tensor-parallel split divides evenly: attention, dense MLPs,
        shared experts, the embedding and LM head (vocabulary-parallel)."""
        hidden = self.hidden_size
        return (self.num_layers * self.attention_params
                + self.dense_layers * 3 * self.dense_intermediate_size * hidden
                + self.moe_layers * 3 * self.shared_intermediate_size * hidden
                + (1 if self.tied else 2) * self.vocab_size * hidden)

    def _expert_params(self) -> int:
        """Every routed expert's parameters."""
        return self.moe_layers * self.num_experts * 3 * self.moe_intermediate_size \
            * self.hidden_size

    def _replicated_params(self) -> int:
        """Parameters every worker holds whole: the norms and the routers."""
        hidden = self.hidden_size
        return self.num_layers * 2 * hidden + hidden + self.moe_layers * self.num_experts * hidden

    @property
    def params(self) -> int:
        """Parameters in all."""
        return self._split_params() + self._expert_params() + self._replicated_params()

    @property
    def model_bytes(self) -> int:
        """Bytes of the whole model."""
        return math.ceil(self.params * self.bytes_per_param)

    def worker_bytes(self, workers: int, expert_parallel: bool = False) -> int:
        """Bytes the busiest of a replica's ``workers`` needs: its share of everything
        split, plus everything replicated; routed experts split by tensor (each expert's
        ``1/workers``) or, ``expert_parallel``, by expert (``ceil(E / workers)`` whole
        experts on the busiest worker, as vLLM places them)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        experts = self._expert_params()
        share = (experts * math.ceil(self.num_experts / workers) / self.num_experts
                 if expert_parallel else experts / workers)
        params = self._split_params() / workers + share + self._replicated_params()
        return math.ceil(params * self.bytes_per_param)

    def replicated_fraction(self, workers: int, expert_parallel: bool = False) -> float:
        """The planner's ``replicated_fraction`` (:func:`~.topologies.sharded_delivery`)
        that gives :meth:`worker_bytes`: ``per_worker = model x ((1 - f) / workers + f)``."""
        if workers == 1:
            return 0.0
        per_worker = self.worker_bytes(workers, expert_parallel) / self.model_bytes
        return min(1.0, max(0.0, (per_worker - 1 / workers) / (1 - 1 / workers)))


def delta_wire_fraction(changed_fraction: float, bytes_per_element: int = 2,
                        elements: int = 1 << 24) -> float:
    """The share of a tensor's bytes a delta sync sends for it when ``changed_fraction`` of
    its ``elements`` changed: the cheapest patch (positions and values, a bitmask and
    values, or the whole tensor; :func:`~weightsync_core.data.delta.patch.patch_payload_bytes`),
    its header included."""
    if not 0.0 <= changed_fraction <= 1.0:
        raise ValueError(f"changed_fraction must be within [0, 1], got {changed_fraction!r}")
    payload = min(patch_payload_bytes(elements, round(changed_fraction * elements),
                                      bytes_per_element).values())
    return (PATCH_HEADER_BYTES + payload) / (elements * bytes_per_element)


MOE_MODELS: dict[str, MoEModelSize] = {
    # Qwen3-235B-A22B's config: hidden 4096, 94 layers, 64 query heads and 4 KV heads of
    # 128, 128 experts of width 1536, vocabulary 151,936, untied; BF16
    "qwen3-235b-a22b": MoEModelSize(
        "Qwen3-235B-A22B", hidden_size=4096, num_layers=94, vocab_size=151936,
        attention_params=2 * 4096 * 64 * 128 + 2 * 4096 * 4 * 128, num_experts=128,
        moe_intermediate_size=1536),
    # Qwen3-30B-A3B: hidden 2048, 48 layers, 32 query heads and 4 KV heads of 128, 128
    # experts of width 768; BF16
    "qwen3-30b-a3b": MoEModelSize(
        "Qwen3-30B-A3B", hidden_size=2048, num_layers=48, vocab_size=151936,
        attention_params=2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128, num_experts=128,
        moe_intermediate_size=768),
    # Kimi-K2 (DeepSeek-V3's shape): hidden 7168, 61 layers (the first dense, width 18432),
    # MLA attention (q rank 1536, kv rank 512, 64 heads of 128 + 64 rope dims), 384 experts
    # of width 2048 and one shared expert, vocabulary 163,840; served in FP8
    "kimi-k2": MoEModelSize(
        "Kimi-K2", hidden_size=7168, num_layers=61, vocab_size=163840,
        attention_params=(7168 * 1536 + 1536 * 64 * 192 + 7168 * (512 + 64)
                          + 512 * 64 * 256 + 64 * 128 * 7168),
        num_experts=384, moe_intermediate_size=2048, dense_layers=1,
        dense_intermediate_size=18432, shared_intermediate_size=2048, bytes_per_param=1.0),
}
"""The published cases' models, from their configs (parameters: 235.1B, 30.5B, 1.03T)."""
