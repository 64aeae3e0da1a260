"""The synthetic tensor-parallel rollout worker, in one process: each of 2 ranks keeps only
its slices of the weights it receives (pieces or whole tensors), the whole model is assembled
from the peers' slices, and a peer on another weights version, a piece of the wrong shape or
a model that cannot be split is refused, naming what is wrong."""

import asyncio

import pytest
import torch

from weightsync_trainer.config import ModelConfig, RolloutConfig
from weightsync_trainer.errors import ConfigError
from weightsync_trainer.workers.generation import HFGenerationServer
from weightsync_trainer.workers.tensor_parallel import TensorParallelGenerationServer


class _Peer:
    """A peer in this process, called as its Ray handle is (``peer.method.remote()``)."""

    def __init__(self, server):
        self.tensor_parallel_slices = self
        self.server = server

    async def remote(self):
        return self.server.tensor_parallel_slices()


def _reference(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = HFGenerationServer(ModelConfig(seed=seed), 1.0).model
    return {name: param.detach().clone() for name, param in model.named_parameters()}


async def _stream(tensors):
    for name, tensor in tensors.items():
        yield name, tensor


def _pair() -> list[TensorParallelGenerationServer]:
    servers = [TensorParallelGenerationServer(ModelConfig(seed=1), 1.0, None, 2, rank)
               for rank in range(2)]
    for server in servers:
        server.set_peers([_Peer(other) for other in servers if other is not server])
    return servers


def test_each_rank_keeps_its_slices_and_the_model_is_assembled_from_its_peers():
    weights = _reference(7)
    servers = _pair()
    whole = HFGenerationServer(ModelConfig(seed=1), 1.0)
    asyncio.run(whole.update_weights(_stream(weights), 3))
    # rank 0 gets whole tensors (a whole-tensor backend), rank 1 only its pieces
    asyncio.run(servers[0].update_weights(_stream(weights), 3))
    pieces = {name: box.cut(weights[name]) for name, box in servers[1].layout.boxes.items()}
    assert any(piece.shape != weights[name].shape for name, piece in pieces.items())
    asyncio.run(servers[1].update_weights(_stream(pieces), 3))
    before = servers[1].weights_checksum()
    for server in servers:
        asyncio.run(server.make_whole())
        assert server.weights_checksum() == whole.weights_checksum()
    assert before != whole.weights_checksum()  # rank 1 held only its slices


def test_a_peer_on_another_weights_version_is_refused():
    weights = _reference(7)
    servers = _pair()
    asyncio.run(servers[0].update_weights(_stream(weights), 3))
    asyncio.run(servers[1].update_weights(_stream(weights), 4))
    with pytest.raises(RuntimeError, match="peer 0 of its replica holds weights version 4, "
                       "this worker 3; the replica is not served half-updated"):
        asyncio.run(servers[0].make_whole())


def test_a_piece_of_another_shape_is_refused_naming_the_tensor():
    weights = _reference(7)
    server = _pair()[1]
    name = "model.layers.0.mlp.down_proj.weight"
    bad = {**weights, name: weights[name][:, :5]}
    with pytest.raises(ValueError, match=rf"weight '{name}': received shape \(32, 5\); "
                       r"tensor-parallel rank 1 needs its slice \[0:32, 32:64\]"):
        asyncio.run(server.update_weights(_stream(bad), 3))


def test_a_model_that_cannot_be_split_is_refused():
    with pytest.raises(ConfigError, match="num_attention_heads 2 does not divide into 4"):
        TensorParallelGenerationServer(ModelConfig(), 1.0, None, 4, 0)
    with pytest.raises(ConfigError, match="tensor-parallel replica's workers split one model"):
        RolloutConfig(tensor_model_parallel_size=2, workers_per_replica=2)


MOE = ModelConfig(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=16, seed=1)


def test_moe_ranks_keep_their_experts_slices_and_the_model_is_assembled():
    """A mixture of experts (transformers 5 holds its experts fused): each rank keeps every
    expert's half (per-expert names, as syncs carry them, written into views of its fused
    parameters); assembled from its peer's, each rank's model is the whole one."""
    torch.manual_seed(9)
    source = HFGenerationServer(MOE, 1.0)
    weights = {name: tensor.detach().clone()
               for name, tensor in source.checkpoint_tensors().items()}
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in weights
    servers = [TensorParallelGenerationServer(MOE, 1.0, None, 2, rank) for rank in range(2)]
    for server in servers:
        server.set_peers([_Peer(other) for other in servers if other is not server])
    box = servers[1].layout.boxes["model.layers.0.mlp.experts.2.down_proj.weight"]
    assert box.shape == (32, 8)  # columns of the expert's width 16, halved
    whole = HFGenerationServer(MOE, 1.0)
    asyncio.run(whole.update_weights(_stream(weights), 5))
    assert whole.weights_checksum() == source.weights_checksum()
    for server in servers:
        pieces = {name: box.cut(weights[name]) for name, box in server.layout.boxes.items()}
        asyncio.run(server.update_weights(_stream(pieces), 5))
    for server in servers:
        asyncio.run(server.make_whole())
        assert server.weights_checksum() == source.weights_checksum()


def test_a_staged_moe_version_is_swapped_in_and_back_whole():
    """Swapping a staged version into a fused-experts model copies each expert into its
    fused parameter; swapping back what it returned restores the version it served."""
    server = HFGenerationServer(MOE, 1.0)
    served = server.weights_checksum()
    torch.manual_seed(10)
    staged = {name: tensor.detach().clone() for name, tensor in
              HFGenerationServer(ModelConfig(**{**vars(MOE), "seed": 2}), 1.0)
              .checkpoint_tensors().items()}
    previous = server.swap_weights(staged, 6)
    assert server.weights_checksum() != served
    server.swap_weights(previous, 5)
    assert server.weights_checksum() == served
