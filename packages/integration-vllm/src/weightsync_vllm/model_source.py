"""An ``actor_wg`` rank that holds a Hugging Face model's weights: the sending side of syncs
into vLLM replicas in tests, benchmarks and examples."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightsync_core import ActorCheckpointEngineMixin, CheckpointEngineConfig
from weightsync_core.data.shards import per_expert_shapes, per_expert_stream

__all__ = ["ModelWeightsSource", "perturb_", "save_qwen2", "save_qwen3_moe"]

_TIED_EMBEDDING_SCALE = 0.1


def save_qwen2(
    directory: str, *, hidden_size: int = 64, num_hidden_layers: int = 2,
    intermediate_size: int | None = None, vocab_size: int = 8192, num_attention_heads: int = 2,
    seed: int = 0, tie_word_embeddings: bool = False,
) -> str:
    """Save a randomly initialised Qwen2 causal LM (float32 safetensors and its config; no
    download) into ``directory``, which vLLM and Hugging Face can then load; one key-value
    head; with ``tie_word_embeddings`` its LM head is its input embedding (the checkpoint
    then holds no ``lm_head.weight``), initialised at a tenth of the usual scale: at the
    usual scale a small tied model's next token is the input token itself, whatever its
    layers hold, so new weights would not change its tokens. vLLM's CPU attention needs a
    head size (``hidden_size // num_attention_heads``) of 32 or more."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    if tie_word_embeddings:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(_TIED_EMBEDDING_SCALE)
    model.save_pretrained(directory)
    return directory


def save_qwen3_moe(
    directory: str, *, hidden_size: int = 64, num_hidden_layers: int = 2,
    num_experts: int = 4, num_experts_per_tok: int = 2, moe_intermediate_size: int = 64,
    vocab_size: int = 8192, num_attention_heads: int = 2, seed: int = 0,
) -> str:
    """Save a randomly initialised Qwen3-MoE causal LM (every layer a mixture of
    ``num_experts`` experts, ``num_experts_per_tok`` routed per token; float32 safetensors,
    experts one tensor per expert as transformers saves them; one key-value head; untied)
    into ``directory``, as :func:`save_qwen2`."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        intermediate_size=2 * hidden_size, moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
        num_attention_heads=num_attention_heads, num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory)
    return directory


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.5,
             fraction: float = 1.0) -> None:
    """Add seeded Gaussian noise (``scale`` times each tensor's standard deviation) to every
    floating-point parameter of ``model``, in place; with ``fraction`` < 1, only to about
    that fraction of each parameter's elements (the others keep their bits, as most do after
    an optimizer step in a rollout dtype)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            if fraction < 1.0:
                noise *= torch.rand(parameter.shape, generator=generator) < fraction
            parameter.add_(noise * scale * parameter.float().std().clamp_min(1e-3))


class ModelWeightsSource(ActorCheckpointEngineMixin):
    """Holds the model saved in ``model_path`` (float32) and sends its parameters; use as a
    Ray actor. :meth:`perturb` changes them the way :func:`perturb_` does."""

    def __init__(self, config: CheckpointEngineConfig, model_path: str) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32
        )
        self.init_checkpoint_engine(config)

    def perturb(self, seed: int, scale: float = 0.5, fraction: float = 1.0) -> None:
        """Perturb the held weights (see :func:`perturb_`)."""
        perturb_(self.model, seed, scale, fraction)

    def weights_bytes(self) -> int:
        """Bytes of the held weights."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def save_safetensors(self, directory: str) -> str:
        """Write the held weights into ``directory`` as one safetensors file (what a trainer
        does to hand weights over through a disk); returns the file's path."""
        path = Path(directory) / "model.safetensors"
        save_file({name: tensor.contiguous() for name, tensor in self.iter_weights()}, path)
        return str(path)

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor's shape and dtype, in the order :meth:`iter_weights` sends them (what
        sharded backends plan with)."""
        return per_expert_shapes({name: (tuple(p.shape), p.dtype)
                                  for name, p in self.model.named_parameters()})

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every parameter, in the model's order, under its checkpoint
        name: experts the model holds fused (transformers 5's mixtures of experts) one
        expert at a time, as views (:func:`~weightsync_core.data.shards.per_expert_stream`)."""
        yield from per_expert_stream((name, p.detach())
                                     for name, p in self.model.named_parameters())
