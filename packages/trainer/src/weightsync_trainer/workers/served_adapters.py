"""The LoRA adapter versions a Hugging Face rollout model serves, through PEFT: each version
injected into the model in place (``inject_adapter_in_model``) under a PEFT adapter name of
its own, and a request served on the version it names (or on the base weights)."""

from __future__ import annotations

import itertools
import warnings
from typing import Any, cast

import torch

from weightsync_core import AdapterSpec, WeightSyncError

__all__ = ["ServedAdapters"]

_PEFT_PREFIX = "base_model.model."


class ServedAdapters:
    """Versions of LoRA adapters of one model, each a PEFT adapter injected into it.

    A dropped version's PEFT adapter is kept as the spare of its spec (one per spec), and
    the next version of that spec is copied into it: after the first syncs, a load is a copy
    of the adapter's bytes, not PEFT's injection (new layers built and initialised).

    Not thread-safe: the server calls every method on the one thread that runs its requests,
    so that a load or a drop never changes the model under a request.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._served: dict[tuple[str, int], str] = {}
        """``(adapter name, version)`` -> the PEFT adapter holding it."""
        self._specs: dict[str, AdapterSpec] = {}
        """Each PEFT adapter's spec."""
        self._spare: dict[AdapterSpec, str] = {}
        """Per spec, a PEFT adapter that serves no version, to copy the next one into."""
        self._loads = itertools.count()

    def check(self, spec: AdapterSpec) -> None:
        """Refuse an adapter whose target modules this model lacks.

        Raises:
            ValueError: naming the missing modules.
        """
        names = {name.rsplit(".", 1)[-1] for name, _ in self.model.named_modules()}
        missing = sorted(set(spec.target_modules) - names)
        if missing:
            raise ValueError(f"the rollout model has no module named {', '.join(missing)}")

    def held(self) -> dict[str, list[int]]:
        """The versions of each adapter it serves, oldest first."""
        held: dict[str, list[int]] = {}
        for name, version in sorted(self._served):
            held.setdefault(name, []).append(version)
        return held

    def load(self, spec: AdapterSpec, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Add ``version`` of adapter ``spec.name`` (``tensors`` by PEFT's state-dict
        names), replacing that version where it is held; all or nothing.

        Raises:
            ValueError: a tensor does not fit the model's adapter layers (nothing changed).
        """
        state = {name.removeprefix(_PEFT_PREFIX): tensor for name, tensor in tensors.items()}
        spare = self._spare.get(spec)
        if spare is not None:
            self._fill(spare, state, spec, version)  # raises before copying anything
            del self._spare[spec]
            self._serve(spec, version, spare)
            return
        self._serve(spec, version, self._inject(spec, version, state))

    def _inject(self, spec: AdapterSpec, version: int, state: dict[str, torch.Tensor]) -> str:
        """A new PEFT adapter of ``spec`` holding ``state``; its name.

        Raises:
            ValueError: ``state`` does not fit (the adapter is removed again).
        """
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

        key = f"{spec.name}-v{version}-{next(self._loads)}"
        # PEFT types lora_alpha an int; a float scales by alpha / r all the same
        config = LoraConfig(r=spec.rank, lora_alpha=cast(Any, spec.alpha),
                            target_modules=list(spec.target_modules), lora_dropout=0.0)
        try:
            with warnings.catch_warnings():  # each version is one more adapter, on purpose
                warnings.filterwarnings("ignore", "Already found a `peft_config`")
                inject_adapter_in_model(config, self.model, adapter_name=key)
            result = set_peft_model_state_dict(self.model, state, adapter_name=key)
            missing = [name for name in result.missing_keys if f".{key}." in name]
            if result.unexpected_keys or missing:
                raise ValueError(
                    f"version {version} of adapter {spec.name!r} does not fit the rollout "
                    f"model: unexpected {list(result.unexpected_keys)[:3]}, missing "
                    f"{missing[:3]}")
        except BaseException:
            self._delete(key)
            raise
        self._specs[key] = spec
        return key

    def _fill(self, key: str, state: dict[str, torch.Tensor], spec: AdapterSpec,
              version: int) -> None:
        """Copy ``state`` into PEFT adapter ``key``, every tensor checked first.

        Raises:
            ValueError: ``state`` does not fit the adapter (nothing copied).
        """
        slot = self._parameters(key)
        unfit = sorted(set(slot) ^ set(state)) or sorted(
            name for name, tensor in state.items() if tensor.shape != slot[name].shape)
        if unfit:
            raise ValueError(f"version {version} of adapter {spec.name!r} does not fit the "
                             f"rollout model: {unfit[:3]}")
        with torch.no_grad():
            for name, tensor in state.items():
                slot[name].copy_(tensor)

    def _parameters(self, key: str) -> dict[str, torch.nn.Parameter]:
        """PEFT adapter ``key``'s ``lora_A``/``lora_B`` weights, by state-dict name."""
        from peft.tuners.lora import LoraLayer

        return {f"{path}.lora_{side}.weight": getattr(module, f"lora_{side}")[key].weight
                for path, module in self.model.named_modules()
                if isinstance(module, LoraLayer) and key in module.lora_A for side in "AB"}

    def _serve(self, spec: AdapterSpec, version: int, key: str) -> None:
        """Serve ``version`` of ``spec`` from PEFT adapter ``key`` (the one that served it
        before, if any, retired)."""
        replaced = self._served.get((spec.name, version))
        self._served[(spec.name, version)] = key
        if replaced is not None:
            self._retire(replaced)

    def drop(self, name: str, version: int) -> None:
        """Stop serving ``version`` of adapter ``name`` (nothing where it is not held)."""
        key = self._served.pop((name, version), None)
        if key is not None:
            self._retire(key)

    def _retire(self, key: str) -> None:
        """PEFT adapter ``key`` serves no version: the spare of its spec, or removed."""
        spec = self._specs[key]
        if spec in self._spare:
            self._delete(key)
        else:
            self._spare[spec] = key

    def tensors(self, name: str, version: int) -> dict[str, torch.Tensor]:
        """``version`` of adapter ``name`` as it serves it, under PEFT's state-dict names
        (its ``lora_A``/``lora_B`` weights only: PEFT adds the base weight of an adapted
        ``lm_head``).

        Raises:
            KeyError: it does not hold that version.
        """
        from peft import get_peft_model_state_dict

        key = self._served[(name, version)]
        state = get_peft_model_state_dict(self.model, adapter_name=key)
        return {f"{_PEFT_PREFIX}{tensor_name}": tensor for tensor_name, tensor in state.items()
                if tensor_name.endswith((".lora_A.weight", ".lora_B.weight"))}

    def activate(self, adapter: tuple[str, int] | None) -> None:
        """Serve the next request on ``adapter`` (``(name, version)``; None: the base
        weights).

        Raises:
            WeightSyncError: the version is not held, naming those that are.
        """
        if adapter is None:
            self._activate(None)
            return
        key = self._served.get((adapter[0], adapter[1]))
        if key is None:
            held = sorted(v for n, v in self._served if n == adapter[0])
            raise WeightSyncError(
                f"this replica serves no version {adapter[1]} of adapter {adapter[0]!r} (it "
                f"holds {held}); name one of those, or sync it first")
        self._activate(key)

    def _layers(self) -> list[Any]:
        from peft.tuners.lora import LoraLayer

        return [module for module in self.model.modules() if isinstance(module, LoraLayer)]

    def _activate(self, key: str | None) -> None:
        """Make ``key`` the only adapter the model applies (None: none)."""
        for layer in self._layers():
            layer.enable_adapters(key is not None)
            if key is not None:
                layer.set_adapter(key)

    def _delete(self, key: str) -> None:
        """Remove PEFT adapter ``key`` from every layer (where it was injected)."""
        self._specs.pop(key, None)
        for layer in self._layers():
            if key in layer.lora_A:
                with warnings.catch_warnings():  # every request activates its own version
                    warnings.filterwarnings("ignore", r"Adapter .* was active which is now")
                    layer.delete_adapter(key)
        configs = getattr(self.model, "peft_config", None)
        if isinstance(configs, dict):
            configs.pop(key, None)
