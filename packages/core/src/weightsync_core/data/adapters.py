"""What a LoRA adapter sync carries: PEFT's ``lora_A``/``lora_B`` tensors of each target
module, described by an :class:`AdapterSpec` (name, rank, alpha, target modules) that both
ends check before any byte moves, and every tensor checked against it as it arrives."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightsync_core.api.errors import AdapterMismatchError

__all__ = ["AdapterSpec", "AdapterTensorCheck"]

_LORA_TENSOR = re.compile(r"^(?P<path>.+\.(?P<module>[^.]+))\.lora_(?P<side>[AB])\.weight$")
"""A PEFT adapter tensor's name as ``get_peft_model_state_dict`` writes it
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter as both ends of an adapter sync describe it.

    Attributes:
        name: the adapter's name (a replica keeps versions of each name apart).
        rank: LoRA's ``r``: ``lora_A`` is ``[rank, in_features]``, ``lora_B``
            ``[out_features, rank]``.
        alpha: LoRA's ``alpha`` (the update is scaled by ``alpha / rank``).
        target_modules: the names of the modules the adapter changes (``q_proj``,
            ``v_proj``, ...), sorted.
    """

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"an adapter needs a non-empty name, got {self.name!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"adapter {self.name!r}: rank must be an integer >= 1, "
                             f"got {self.rank!r}")
        if not isinstance(self.alpha, int | float) or not math.isfinite(self.alpha):
            raise ValueError(f"adapter {self.name!r}: alpha must be a finite number, "
                             f"got {self.alpha!r}")
        targets = self.target_modules
        if isinstance(targets, str) or not targets or not all(
                isinstance(target, str) and target for target in targets):
            raise ValueError(f"adapter {self.name!r}: target_modules must be a non-empty list "
                             f"of module names (q_proj, v_proj, ...), got {targets!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "target_modules", tuple(sorted(set(targets))))

    @classmethod
    def from_peft_config(cls, name: str, config: Any) -> AdapterSpec:
        """The spec of a PEFT ``LoraConfig``, or of its ``to_dict()`` (read by attribute or
        key: ``r``, ``lora_alpha``, ``target_modules``; core does not import PEFT). A target
        PEFT resolved to a module's path (``all-linear`` becomes
        ``model.layers.0.self_attn.q_proj``, ...) counts by its last name (``q_proj``).

        Raises:
            ValueError: a key is missing, the config's targets are a regular expression
                (name them as a list) or it scales by ``alpha / sqrt(rank)``
                (``use_rslora``), which servers such as vLLM do not apply.
        """
        fields = config if isinstance(config, Mapping) else vars(config)
        missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in fields]
        if missing:
            raise ValueError(f"adapter {name!r}: the PEFT config has no {', '.join(missing)}")
        targets = fields["target_modules"]
        if isinstance(targets, str):
            raise ValueError(f"adapter {name!r}: target_modules is the pattern {targets!r}; "
                             "name the target modules as a list for an adapter sync")
        if fields.get("use_rslora", False):
            raise ValueError(f"adapter {name!r}: use_rslora scales by alpha/sqrt(r), which "
                             "the receiving servers do not apply; set use_rslora=False")
        return cls(name, int(fields["r"]), float(fields["lora_alpha"]),
                   tuple(str(target).rsplit(".", 1)[-1] for target in targets))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdapterSpec:
        """The spec :meth:`as_dict` wrote (as it crossed a process boundary).

        Raises:
            ValueError: a key is missing or unknown, or a value does not fit its field.
        """
        keys = {"name", "rank", "alpha", "target_modules"}
        if not isinstance(data, Mapping) or set(data) != keys:
            raise ValueError(f"an adapter spec is a mapping of exactly {sorted(keys)}, got "
                             f"{data!r}")
        return cls(data["name"], data["rank"], data["alpha"], tuple(data["target_modules"]))

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for Ray, MessagePack or JSON)."""
        return {"name": self.name, "rank": self.rank, "alpha": self.alpha,
                "target_modules": list(self.target_modules)}

    @property
    def scaling(self) -> float:
        """``alpha / rank``: what the adapter's update ``B @ A`` is multiplied by."""
        return self.alpha / self.rank

    def describe(self) -> str:
        """``rank 16, alpha 32, targets [q_proj, v_proj]``, for messages."""
        return (f"rank {self.rank}, alpha {self.alpha:g}, targets "
                f"[{', '.join(self.target_modules)}]")

    def check_same(self, other: AdapterSpec, mine: str, theirs: str) -> None:
        """Refuse ``other`` where it describes this adapter differently.

        Raises:
            AdapterMismatchError: naming both sides (``mine``, ``theirs``: who holds each)
                and what differs.
        """
        differs = [field for field in ("name", "rank", "alpha", "target_modules")
                   if getattr(self, field) != getattr(other, field)]
        if differs:
            raise AdapterMismatchError(
                f"adapter {self.name!r} differs in {', '.join(differs)}: {mine} has "
                f"{self.describe()}, {theirs} has {other.describe()}"
                + ("" if other.name == self.name else f" (named {other.name!r})")
                + "; make both ends use the same LoRA config (a replica takes a changed "
                "adapter only in a sync with allow_manifest_change=True)")

    def tensor_check(self) -> AdapterTensorCheck:
        """A check of one sync's tensors against this spec."""
        return AdapterTensorCheck(self)


class AdapterTensorCheck:
    """Checks an adapter sync's tensors as they arrive (or leave): each named as PEFT names
    them, of a target module, of the spec's rank; at the end, every module's ``lora_A``
    with its ``lora_B``, in agreeing shapes.

    Args:
        spec: the adapter the sync carries.
    """

    def __init__(self, spec: AdapterSpec) -> None:
        self.spec = spec
        self._shapes: dict[tuple[str, str], tuple[int, ...]] = {}

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse ``name`` unless it is a ``lora_A``/``lora_B`` weight of a target module
        with the spec's rank.

        Raises:
            AdapterMismatchError: naming the tensor and what is wrong with it.
        """
        spec = self.spec
        match = _LORA_TENSOR.match(name)
        if match is None:
            raise AdapterMismatchError(
                f"adapter {spec.name!r}: tensor {name!r} is not a LoRA weight (PEFT names "
                "them '<module path>.lora_A.weight' and '<module path>.lora_B.weight', as "
                "get_peft_model_state_dict returns them)")
        module, side = match["module"], match["side"]
        if module not in spec.target_modules:
            raise AdapterMismatchError(
                f"adapter {spec.name!r}: tensor {name!r} belongs to module {module!r}, which "
                f"is not among its targets [{', '.join(spec.target_modules)}]")
        if tensor.dim() != 2 or tensor.shape[0 if side == "A" else 1] != spec.rank:
            where = "[rank, in_features]" if side == "A" else "[out_features, rank]"
            raise AdapterMismatchError(
                f"adapter {spec.name!r}: tensor {name!r} has shape {list(tensor.shape)}, "
                f"but lora_{side} of rank {spec.rank} is {where}")
        key = (match["path"], side)
        if key in self._shapes:
            raise AdapterMismatchError(f"adapter {spec.name!r}: tensor {name!r} came twice")
        self._shapes[key] = tuple(tensor.shape)

    def finish(self) -> None:
        """Refuse a sync that carried no tensor, or a module's ``lora_A`` without its
        ``lora_B`` (or the reverse).

        Raises:
            AdapterMismatchError: naming the module.
        """
        if not self._shapes:
            raise AdapterMismatchError(f"adapter {self.spec.name!r}: the sync carried no "
                                       "tensor; an empty adapter sync is refused")
        for path in sorted({path for path, _ in self._shapes}):
            if not all((path, side) in self._shapes for side in "AB"):
                have = "A" if (path, "A") in self._shapes else "B"
                raise AdapterMismatchError(
                    f"adapter {self.spec.name!r}: module {path!r} came with lora_{have} "
                    f"only; each target module needs both lora_A and lora_B")

