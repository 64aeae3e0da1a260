"""Building the policy and value models from a :class:`ModelConfig` (no hub download)."""

from __future__ import annotations

import torch
import transformers

from weightsync_trainer.config import ModelConfig

__all__ = ["build_policy_model", "build_value_model", "hf_config", "response_log_probs"]


def hf_config(config: ModelConfig, **extra: object) -> transformers.PretrainedConfig:
    """The transformers config of ``config`` (``extra`` adds e.g. ``num_labels``).

    Token ids for BOS/EOS/padding are left unset: responses always run to full length.
    """
    if config.path is not None:
        return transformers.AutoConfig.from_pretrained(config.path, **extra)
    if config.num_experts:
        extra = {"num_experts": config.num_experts,
                 "num_experts_per_tok": config.num_experts_per_tok,
                 "moe_intermediate_size": config.moe_intermediate_size, **extra}
    try:
        return transformers.AutoConfig.for_model(
            config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            **extra,
        )
    except ValueError as exc:
        raise ValueError(
            f"actor_rollout_ref.model.model_type={config.model_type!r}: {exc}") from exc


def build_policy_model(config: ModelConfig) -> transformers.PreTrainedModel:
    """The causal LM: loaded from ``config.path`` or randomly initialised from ``config.seed``
    (every process building it gets identical weights)."""
    if config.path is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32)
    torch.manual_seed(config.seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config(config))


def build_value_model(config: ModelConfig) -> transformers.PreTrainedModel:
    """The critic: the same architecture with a one-output token-classification head."""
    torch.manual_seed(config.seed + 1)
    if config.path is not None:
        return transformers.AutoModelForTokenClassification.from_pretrained(
            config.path, num_labels=1, dtype=torch.float32
        )
    return transformers.AutoModelForTokenClassification.from_config(
        hf_config(config, num_labels=1)
    )


def response_log_probs(
    model: torch.nn.Module, input_ids: torch.Tensor, response_length: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the last ``response_length`` tokens of each row, and the entropy of
    the sampling distribution at those positions (both ``[batch, response_length]``)."""
    logits = model(input_ids=input_ids).logits[:, -response_length - 1 : -1].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    tokens = input_ids[:, -response_length:]
    chosen = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy
