"""A vLLM model's switch to a staged version, prepared while vLLM serves.

vLLM loads a version in two steps that cost most of a sync on CPU: ``load_weights`` (names
mapped, q/k/v and gate/up fused, tensor-parallel shards cut) and the processing of every
layer into its kernels' form (vLLM-CPU packs each linear layer's weight for oneDNN). A
staged commit that ran both under the pause stalled generation for as long as a
stop-the-world sync. Here both run in phase 1, on a *shadow* of the model: every module
copied shallowly (its own ``__dict__``), with its own copies of the model's tensors, so that
vLLM's layerwise reload (the same code as a reload of the live model) writes only into the
shadow's tensors and sets only the shadow's attributes, while vLLM generates on the live
model. Under the pause, :meth:`PreparedVLLMSwitch.apply` puts the shadow's processed tensors in
the live model's place (on the host their storages are exchanged; on a device the values are
copied into the live tensors, as vLLM's reload ends, so the addresses CUDA graphs hold stay
valid) and hands the live modules what processing built besides (a CPU layer's packed
weight, held by its ``cpu_linear``).

Memory, besides the model: the shadow's tensors (K, the model's tensors as the kernels hold
them: on vLLM-CPU the packed linear weights live outside them, so K is the embeddings, norms
and biases; 2K on a device, with the copy of the live values to undo with) and what
processing builds (P, vLLM-CPU's packed weights: the size of the linear layers), from the
end of phase 1 to the commit; after the commit, the replaced tensors (K) and the replaced
packed weights (P) until the replica's commit is known.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MethodType
from typing import Any, cast

import torch
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.model_loader.reload.layerwise import (
    LAYERWISE_INFO,
    get_layerwise_info,
)
from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

from weightsync_core import WeightSyncError

__all__ = ["PreparedVLLMSwitch", "ShadowModel"]

_STRUCTURE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
"""A module's own containers, which the shadow has copies of (not attributes handed over)."""

_RELOAD_WRAPPER = "online_process_loader"
"""The name of the weight loaders vLLM's layerwise reload wraps a layer's loaders in."""

_ABSENT = object()
"""An attribute a module does not have."""


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _attributes(tensor: torch.Tensor) -> dict[str, Any]:
    """``tensor``'s own attributes (vLLM hangs weight loaders and layouts on them)."""
    return cast(dict[str, Any], tensor.__dict__)


def _rebound(tensor: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module) -> None:
    """Point ``tensor``'s attributes that are methods of ``live`` (a weight loader) at
    ``shadow``, and unwrap its weight loader from the wrappers of a reload of ``live``
    (vLLM leaves them on its record of the checkpoint's tensors after a reload: a shadow
    loading through them would hand its weights to ``live``'s reload, which drops them)."""
    loader = getattr(tensor, "weight_loader", None)  # some vLLM parameters: a property
    if getattr(loader, "__name__", None) == _RELOAD_WRAPPER:
        while getattr(loader, "__name__", None) == _RELOAD_WRAPPER:
            loader = loader.__wrapped__  # pyright: ignore[reportOptionalMemberAccess]
        tensor.weight_loader = loader  # pyright: ignore[reportAttributeAccessIssue]
    attributes = _attributes(tensor)
    for key, value in attributes.items():
        if isinstance(value, MethodType) and value.__self__ is live:
            attributes[key] = value.__func__.__get__(shadow)


class ShadowModel:
    """A shallow copy of a vLLM model, module by module, holding copies of its tensors
    (tied tensors stay tied) and of vLLM's reload metadata: what vLLM's layerwise reload
    does to it leaves the live model untouched.

    Args:
        model: the live model (vLLM recorded its reload metadata at load).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        """Each live module and its shadow."""
        self.before: dict[int, dict[str, Any]] = {}
        """Each live module's attributes when the shadow was made (by ``id``)."""
        self._modules: dict[int, torch.nn.Module] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        self.root = self._shadow(model)

    def _shadow(self, module: torch.nn.Module) -> torch.nn.Module:
        known = self._modules.get(id(module))
        if known is not None:
            return known
        shadow = module.__class__.__new__(module.__class__)
        shadow.__dict__.update(module.__dict__)
        self._modules[id(module)] = shadow
        self.pairs.append((module, shadow))
        self.before[id(module)] = dict(module.__dict__)
        shadow._parameters = {name: None if tensor is None else self._own(tensor, module, shadow)
                              for name, tensor in module._parameters.items()}
        shadow._buffers = {name: None if tensor is None else self._own(tensor, module, shadow)
                           for name, tensor in module._buffers.items()}
        shadow._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        shadow._modules = {name: None if child is None else self._shadow(child)
                           for name, child in module._modules.items()}
        self._copy_reload_metadata(module, shadow)
        return shadow

    def _own(self, tensor: torch.Tensor, live: torch.nn.Module,
             shadow: torch.nn.Module) -> Any:
        """The shadow's copy of ``tensor`` (one per tensor, however many modules hold it),
        of its class and with its attributes."""
        known = self._tensors.get(id(tensor))
        if known is None:
            known = tensor.data.clone()
            known.__class__ = tensor.__class__
            _attributes(known).update(_attributes(tensor))
            _rebound(known, live, shadow)
            self._tensors[id(tensor)] = known
        return known

    @staticmethod
    def _copy_reload_metadata(live: torch.nn.Module, shadow: torch.nn.Module) -> None:
        """Give ``shadow`` vLLM's record of ``live``'s checkpoint-format tensors, as copies
        whose weight loaders are the shadow's."""
        recorded = get_layerwise_info(live)
        info = get_layerwise_info(shadow)
        params, buffers = recorded.restore_metadata

        def copied(meta: torch.Tensor) -> torch.Tensor:
            copy = to_meta_tensor(meta)
            _rebound(copy, live, shadow)
            return restore_layer_refs(copy, shadow)

        info.restore_metadata = ({name: copied(meta) for name, meta in params.items()},
                                 {name: copied(meta) for name, meta in buffers.items()})
        info.restore_device = recorded.restore_device

    def check_loaded(self) -> None:
        """After a load into the shadow: every layer holding parameters got weights (vLLM's
        reload would quietly keep such a layer's old tensors, and the switch serve them).

        Raises:
            WeightSyncError: naming the layers that got none.
        """
        names = {id(shadow): name for name, shadow in self.root.named_modules()}
        missed = [names.get(id(shadow), type(shadow).__name__) for _, shadow in self.pairs
                  if shadow._parameters and not is_deferred_attention_layer(shadow)
                  and get_layerwise_info(shadow).can_load()
                  and get_layerwise_info(shadow).load_numel <= 0]
        if missed:
            raise WeightSyncError(f"vLLM's model took no weights for {len(missed)} of its "
                                  f"layers from this version: {missed[:5]}")

    @property
    def nbytes(self) -> int:
        """Bytes of the shadow's own tensors."""
        return _nbytes(self._tensors.values())

    def forget_reload_state(self) -> None:
        """Drop vLLM's reload records of the shadow's modules (they refer to the modules
        they are keyed by, so would keep them alive)."""
        for _, shadow in self.pairs:
            LAYERWISE_INFO.pop(shadow, None)

    def switch(self) -> PreparedVLLMSwitch:
        """What the reload left in the shadow, as the live model's switch to it.

        Raises:
            WeightSyncError: the reload changed which tensors a module holds, or their
                shapes or dtypes (the switch copies into the live model's own tensors).
        """
        return PreparedVLLMSwitch(self)


class _ModuleSwitch:
    """One live module's switch: the tensors to copy into its own, and the attributes to
    hand it (with the values they had, to undo)."""

    def __init__(self, live: torch.nn.Module, shadow: torch.nn.Module,
                 before: dict[str, Any]) -> None:
        self.live = live
        self.before = before
        self.tensors = self._paired_tensors(live, shadow)
        keys = (set(before) | set(shadow.__dict__)) - _STRUCTURE
        self.attributes = {key: shadow.__dict__.get(key, _ABSENT) for key in keys
                           if shadow.__dict__.get(key, _ABSENT) is not before.get(key, _ABSENT)}

    @staticmethod
    def _paired_tensors(live: torch.nn.Module, shadow: torch.nn.Module
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = []
        for kind in ("_parameters", "_buffers"):
            mine, theirs = getattr(live, kind), getattr(shadow, kind)
            if set(mine) != set(theirs):
                raise WeightSyncError(
                    f"vLLM's reload of {type(live).__name__} left {sorted(theirs)} in "
                    f"{kind[1:]}, where the model holds {sorted(mine)}")
            for name, tensor in mine.items():
                other = theirs[name]
                if tensor is None or other is None:
                    continue
                if (tensor.shape, tensor.dtype) != (other.shape, other.dtype):
                    raise WeightSyncError(
                        f"vLLM's reload of {type(live).__name__}.{name} made a "
                        f"{list(other.shape)} {other.dtype} tensor, where the model holds "
                        f"{list(tensor.shape)} {tensor.dtype}")
                pairs.append((tensor, other))
        return pairs

    def unchanged(self) -> bool:
        """Whether the live module still has the attributes it had when prepared."""
        return all(self.live.__dict__.get(key, _ABSENT) is self.before.get(key, _ABSENT)
                   for key in self.attributes)

    def hand_over(self, attributes: dict[str, Any]) -> None:
        for key, value in attributes.items():
            if value is _ABSENT:
                self.live.__dict__.pop(key, None)
            else:
                self.live.__dict__[key] = value


class _TensorExchange:
    """One live tensor and the shadow's: on the host their storages are exchanged (nothing
    copied, and the live tensor's old storage is kept for :meth:`undo`); on a device, where
    CUDA graphs hold the live tensor's address, the shadow's values are copied in, with a
    copy of the old values (taken while preparing: vLLM only reads them) for :meth:`undo`."""

    def __init__(self, live: torch.Tensor, new: torch.Tensor) -> None:
        self.live, self.new = live, new
        self.old = None if live.device.type == "cpu" else live.detach().clone()

    @property
    def nbytes(self) -> int:
        return _nbytes([self.new] if self.old is None else [self.new, self.old])

    def apply(self) -> None:
        if self.old is None:
            self._exchange()
        else:
            self.live.copy_(self.new)
            self.new = self.old  # the new values are the live tensor's now

    def undo(self) -> None:
        if self.old is None:
            self._exchange()
        else:
            self.live.copy_(self.old)

    def _exchange(self) -> None:
        self.live.data, self.new.data = self.new.data, self.live.data


class PreparedVLLMSwitch:
    """A :class:`~weightsync_core.api.protocols.PreparedSwitch` of a vLLM model: made from a
    :class:`ShadowModel` that vLLM's layerwise reload loaded and processed; :meth:`apply`
    puts its tensors in the live model's place (:class:`_TensorExchange`) and hands over the
    attributes processing set; :meth:`undo` puts back what it replaced."""

    def __init__(self, shadow: ShadowModel) -> None:
        modules = [_ModuleSwitch(live, copy, shadow.before[id(live)])
                   for live, copy in shadow.pairs]
        self._modules = [module for module in modules if module.tensors or module.attributes]
        seen: set[int] = set()
        self._tensors: list[_TensorExchange] = []
        for module in self._modules:
            for live, new in module.tensors:
                if id(live) not in seen:  # a tied tensor is exchanged once
                    seen.add(id(live))
                    self._tensors.append(_TensorExchange(live, new))
        self._replaced_attributes: list[dict[str, Any]] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it holds besides the model's (the packed weights that
        processing built, held by the attributes, not counted)."""
        return sum(tensor.nbytes for tensor in self._tensors)

    def apply(self) -> None:
        """Serve the prepared version: its tensors in the live model's place, its attributes
        handed over; the replaced ones kept for :meth:`undo`.

        Raises:
            WeightSyncError: the live model changed since the switch was prepared (another
                reload ran): nothing is applied.
        """
        changed = [type(module.live).__name__ for module in self._modules
                   if not module.unchanged()]
        if changed:
            raise WeightSyncError(f"vLLM's model changed since this version was prepared "
                                  f"(in {changed[:3]}): the switch was not applied")
        self._replaced_attributes = [{key: module.live.__dict__.get(key, _ABSENT)
                                      for key in module.attributes}
                                     for module in self._modules]
        with torch.no_grad():
            for tensor in self._tensors:
                tensor.apply()
        for module in self._modules:
            module.hand_over(module.attributes)

    def undo(self) -> None:
        """Serve the version :meth:`apply` replaced again."""
        if self._replaced_attributes is None:
            raise WeightSyncError("this switch was not applied, or its undo was released")
        with torch.no_grad():
            for tensor in self._tensors:
                tensor.undo()
        for module, attributes in zip(self._modules, self._replaced_attributes, strict=True):
            module.hand_over(attributes)

    def release(self) -> None:
        """Drop the prepared version, or after :meth:`apply` the replaced one."""
        self._modules, self._tensors = [], []
        self._replaced_attributes = None
