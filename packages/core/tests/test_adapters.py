"""Adapter specs and the checks of an adapter sync's tensors (before any byte moves)."""

from types import SimpleNamespace

import pytest
import torch

from weightsync_core.api.errors import AdapterMismatchError
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.orchestration.adapter_ledger import AdapterLedger
from weightsync_core.testing.weights import make_adapter

SPEC = AdapterSpec("policy", 8, 16, ("v_proj", "q_proj"))


def adapter_tensors_of(named, spec):
    """``named`` as a dict, every tensor checked against ``spec`` as a receiver checks them."""
    check = spec.tensor_check()
    tensors = {}
    for name, tensor in named:
        check.check(name, tensor)
        tensors[name] = tensor
    check.finish()
    return tensors


def test_spec_is_plain_data_and_sorted():
    assert SPEC.target_modules == ("q_proj", "v_proj")
    assert SPEC.as_dict() == {"name": "policy", "rank": 8, "alpha": 16.0,
                              "target_modules": ["q_proj", "v_proj"]}
    assert AdapterSpec.from_dict(SPEC.as_dict()) == SPEC
    assert SPEC.scaling == 2.0


@pytest.mark.parametrize(("data", "words"), [
    ({"name": "a", "rank": 0, "alpha": 1, "target_modules": ["q"]}, "rank must be"),
    ({"name": "a", "rank": True, "alpha": 1, "target_modules": ["q"]}, "rank must be"),
    ({"name": "a", "rank": 4, "alpha": float("nan"), "target_modules": ["q"]}, "alpha"),
    ({"name": "a", "rank": 4, "alpha": 1, "target_modules": []}, "target_modules"),
    ({"name": "", "rank": 4, "alpha": 1, "target_modules": ["q"]}, "non-empty name"),
    ({"name": "a", "rank": 4, "alpha": 1}, "exactly"),
    ({"name": "a", "rank": 4, "alpha": 1, "target_modules": ["q"], "code": "x"}, "exactly"),
])
def test_bad_specs_are_refused_naming_the_field(data, words):
    with pytest.raises(ValueError, match=words):
        AdapterSpec.from_dict(data)


def test_peft_config_fields_and_what_servers_cannot_apply():
    config = SimpleNamespace(r=16, lora_alpha=32, target_modules={"q_proj", "o_proj"},
                             use_rslora=False)
    assert AdapterSpec.from_peft_config("p", config) == AdapterSpec(
        "p", 16, 32.0, ("o_proj", "q_proj"))
    with pytest.raises(ValueError, match="pattern"):
        AdapterSpec.from_peft_config("p", SimpleNamespace(r=4, lora_alpha=8,
                                                          target_modules=".*proj"))
    with pytest.raises(ValueError, match="use_rslora"):
        AdapterSpec.from_peft_config("p", SimpleNamespace(**{**vars(config), "use_rslora": True}))
    as_dict = {**vars(config), "target_modules": ["q_proj", "o_proj"]}  # LoraConfig.to_dict()
    assert AdapterSpec.from_peft_config("p", as_dict) == AdapterSpec.from_peft_config("p", config)
    resolved = {**as_dict, "target_modules": {"model.layers.0.self_attn.q_proj",
                                              "model.layers.1.self_attn.q_proj", "o_proj"}}
    assert AdapterSpec.from_peft_config("p", resolved) == AdapterSpec.from_peft_config("p", config)
    with pytest.raises(ValueError, match="no lora_alpha"):
        AdapterSpec.from_peft_config("p", {"r": 4, "target_modules": ["q_proj"]})


def test_a_mismatch_names_both_sides_and_what_differs():
    other = AdapterSpec("policy", 4, 16, ("q_proj", "v_proj"))
    with pytest.raises(AdapterMismatchError) as caught:
        SPEC.check_same(other, "worker 3", "the actor")
    message = str(caught.value)
    assert "differs in rank" in message
    assert "worker 3 has rank 8" in message and "the actor has rank 4" in message
    SPEC.check_same(AdapterSpec("policy", 8, 16.0, ("q_proj", "v_proj")), "a", "b")


def test_tensors_are_checked_against_the_spec():
    tensors = make_adapter(SPEC, seed=1)
    assert len(adapter_tensors_of(tensors.items(), SPEC)) == 8
    a_name = next(iter(tensors))
    cases = [
        ({**tensors, "model.layers.0.q_proj.weight": torch.zeros(2, 2)}, "not a LoRA weight"),
        ({**tensors, "x.layers.0.k_proj.lora_A.weight": torch.zeros(8, 4)}, "not among"),
        ({**tensors, a_name: torch.zeros(4, 64)}, r"shape \[4, 64\]"),
        ({name: t for name, t in tensors.items() if name != a_name}, "lora_B only"),
        ({}, "carried no tensor"),
    ]
    for named, words in cases:
        with pytest.raises(AdapterMismatchError, match=words):
            adapter_tensors_of(named.items(), SPEC)


def test_the_ledger_keeps_the_newest_versions_per_replica():
    ledger = AdapterLedger(keep=2)
    replica = object()
    assert ledger.kept_after(replica, "p", 1) == [1]
    ledger.record(replica, "p", [1])
    ledger.record(replica, "p", ledger.kept_after(replica, "p", 2))
    assert ledger.kept_after(replica, "p", 3) == [2, 3]
    assert ledger.kept_after(replica, "p", 1) == [2, 1]  # a resync of a version held: newest
    assert ledger.status([("replica 0", replica)]) == {"replica 0": {"p": [1, 2]}}
    assert ledger.delta_ledger("p") is None
    ledger.forget(replica)
    assert ledger.held(replica, "p") == []
