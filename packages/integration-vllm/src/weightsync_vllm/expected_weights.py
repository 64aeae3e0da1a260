"""What a vLLM model loads, by checkpoint name, known before any byte of a sync lands: read
from the safetensors headers of the checkpoint vLLM started from. Each received tensor is
checked against it before vLLM loads it, and a sync that missed one of them fails."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from weightsync_core import VerificationError

__all__ = ["ExpectedWeights", "TensorSpec", "checkpoint_directory", "expected_weights_of"]

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names (its header's ``dtype`` field) as torch dtypes."""

_SHOWN = 20
"""Names listed in one error message at most."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        """``shape [8192, 64] float32``."""
        return f"shape {list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


_FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
"""Dtypes whose values mean nothing without their block scales: no cast into or out of
them keeps a weight's values."""


def _accepts(expected: TensorSpec, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be loaded where the checkpoint holds ``expected``: the same
    shape, and a floating-point dtype for a floating-point tensor (vLLM's loaders cast it to
    the model's dtype), but float8 only where the checkpoint holds float8 and there the very
    dtype (a cast into or out of float8 drops the scales); else the very dtype."""
    if tuple(tensor.shape) != expected.shape:
        return False
    if expected.dtype in _FLOAT8 or tensor.dtype in _FLOAT8:
        return tensor.dtype == expected.dtype
    if expected.dtype.is_floating_point:
        return tensor.dtype.is_floating_point
    return tensor.dtype == expected.dtype


def _quantization_hint(expected: TensorSpec, tensor: torch.Tensor) -> str:
    """What to change where a weight arrived quantized for an unquantized model, or the
    other way round ("" otherwise)."""
    if expected.dtype in _FLOAT8 and tensor.dtype not in _FLOAT8:
        return (". This model was started from a block-FP8 checkpoint: sync with "
                "rollout_quantization='fp8_block' (the weights then travel in float8 with "
                "their scales)")
    if tensor.dtype in _FLOAT8 and expected.dtype not in _FLOAT8:
        return (". This model's checkpoint is not quantized: leave rollout_quantization "
                "unset, or start the replica from a block-FP8 checkpoint")
    return ""


def _listed(names: Collection[str]) -> str:
    ordered = sorted(names)
    more = len(ordered) - _SHOWN
    return ", ".join(ordered[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class ExpectedWeights:
    """The tensors of a model's checkpoint, which a complete sync delivers.

    Attributes:
        required: every tensor of the checkpoint, by name.
        optional: tensors a sync may also send, which vLLM skips (the LM head of a model
            with tied embeddings, when the trainer sends it).
        source: where the names came from (named in error messages).
    """

    required: Mapping[str, TensorSpec]
    optional: Mapping[str, TensorSpec]
    source: str

    @classmethod
    def of_checkpoint(cls, directory: str, *, tied_head: TensorSpec | None = None
                      ) -> ExpectedWeights:
        """Read the safetensors headers in ``directory`` (only the files its index names,
        when it has one); ``tied_head`` is the shape of ``lm_head.weight`` of a model whose
        LM head is its input embedding.

        Raises:
            FileNotFoundError: ``directory`` holds no safetensors file.
        """
        required: dict[str, TensorSpec] = {}
        for path in _safetensors_files(Path(directory)):
            with safe_open(str(path), framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 (a safe_open handle, no dict)
                    entry = checkpoint.get_slice(name)
                    required[name] = TensorSpec(tuple(entry.get_shape()),
                                                _SAFETENSORS_DTYPES[entry.get_dtype()])
        optional = {}
        if tied_head is not None and "lm_head.weight" not in required:
            optional["lm_head.weight"] = tied_head
        return cls(required, optional, f"the checkpoint in {directory}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, required and optional, by name."""
        return {name: spec.shape for name, spec in {**self.optional, **self.required}.items()}

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse ``tensor`` before it is loaded if the model has no tensor ``name`` or
        holds it with another shape or dtype.

        Raises:
            VerificationError: naming the tensor and what the model holds.
        """
        expected = self.required.get(name) or self.optional.get(name)
        if expected is None:
            raise VerificationError(
                f"tensor {name!r} is not a weight of this vLLM model ({self.source} has no "
                "such tensor); refused before loading it. Send the weights under the names "
                "of the model's Hugging Face checkpoint",
                tensors=[name],
            )
        if not _accepts(expected, tensor):
            sent = TensorSpec(tuple(tensor.shape), tensor.dtype)
            raise VerificationError(
                f"tensor {name!r} arrived with {sent.describe()}, but this vLLM model holds "
                f"{expected.describe()} ({self.source}); refused before loading it"
                f"{_quantization_hint(expected, tensor)}",
                tensors=[name],
            )

    def check_complete(self, received: Collection[str]) -> None:
        """Fail a sync that did not deliver every tensor of the checkpoint.

        Raises:
            VerificationError: naming the tensors that never arrived.
        """
        missing = set(self.required) - set(received)
        if missing:
            raise VerificationError(
                f"this sync did not deliver {len(missing)} of the model's tensors "
                f"({self.source}): {_listed(missing)}; the replica holds a mix of old and "
                "new weights and is not reported complete",
                tensors=sorted(missing),
            )


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {directory}")
    return files


def checkpoint_directory(model: str, revision: str | None = None) -> str | None:
    """The local directory of the checkpoint vLLM loaded ``model`` from: ``model`` itself
    when it is a directory, else its copy in the Hugging Face cache (nothing is
    downloaded); ``None`` when there is none."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True,
                                 allow_patterns=["*.safetensors", "*.json"])
    except Exception as error:  # any failure means: no local copy
        logger.warning("no local checkpoint of %s (%s)", model, error)
        return None


def expected_weights_of(model_config: Any, load_format: str) -> ExpectedWeights | None:
    """The expected weights of the model vLLM serves with ``model_config`` (vLLM's
    ``ModelConfig``), or ``None`` (with a warning) when vLLM did not load it from a local
    safetensors checkpoint (``load_format="dummy"``, say): then a sync is checked only
    against the previous complete one."""
    directory = None
    if load_format in {"auto", "safetensors"}:
        directory = checkpoint_directory(model_config.model, model_config.revision)
    if directory is None:
        logger.warning(
            "weightsync: the model's checkpoint names are unknown (load format %r); the first "
            "sync into this replica cannot be checked for completeness", load_format,
        )
        return None
    text_config = model_config.hf_text_config
    tied_head = None
    if getattr(text_config, "tie_word_embeddings", False):
        tied_head = TensorSpec((text_config.vocab_size, text_config.hidden_size),
                               model_config.dtype)
    try:
        return ExpectedWeights.of_checkpoint(directory, tied_head=tied_head)
    except FileNotFoundError as error:
        logger.warning("weightsync: %s; syncs are checked only against the previous one",
                       error)
        return None
