"""An FSDP2 actor's full weights gathered in groups (``full_parameters``): the same tensors as
gathering each parameter alone, in one ``all_gather`` per group of consecutive row-sharded
parameters of one dtype instead of a collective per parameter. Two real ranks over gloo."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from weightsync_trainer.workers.training import full_parameters

WORLD = 2


def _model() -> torch.nn.Module:
    """Parameters of several shapes (one with fewer rows than ranks, a vector) and two
    dtypes, in an order that alternates them."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Parameter(torch.randn(9, 6))
    model.row = torch.nn.Parameter(torch.randn(1, 5))  # fewer rows than ranks
    model.bias = torch.nn.Parameter(torch.randn(7))
    model.scale = torch.nn.Parameter(torch.randn(4, 3).to(torch.bfloat16))
    model.head = torch.nn.Parameter(torch.randn(6, 9))
    return model


def _rank(rank: int, port: int, results: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        model = fully_shard(_model())
        assert all(isinstance(param, DTensor) for param in model.parameters())
        alone = {name: param.full_tensor().detach() for name, param in model.named_parameters()}
        gathers = 0
        all_gather = dist.all_gather

        def counted(*args, **kwargs):
            nonlocal gathers
            gathers += 1
            return all_gather(*args, **kwargs)

        dist.all_gather = counted
        try:
            outcome = {}
            for group_bytes in (1 << 20, 16):  # every same-dtype run in one; each alone
                gathers = 0
                grouped = list(full_parameters(model, group_bytes=group_bytes))
                outcome[group_bytes] = {
                    "names": [name for name, _ in grouped],
                    "equal": all(torch.equal(tensor, alone[name]) and
                                 tensor.dtype == alone[name].dtype for name, tensor in grouped),
                    "gathers": gathers,
                }
        finally:
            dist.all_gather = all_gather
        results.put((rank, outcome))
    except Exception as error:  # reported to the test, not left to its timeout
        results.put((rank, {"error": repr(error)}))
    finally:
        dist.destroy_process_group()


def test_grouped_gathers_give_each_parameter_whole_in_fewer_collectives(monkeypatch,
                                                                         pytestconfig):
    # the children import this module as packages.trainer.tests.<module>, from the root
    monkeypatch.syspath_prepend(str(pytestconfig.rootpath))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, port, results)) for rank in range(WORLD)]
    for process in ranks:
        process.start()
    outcomes = dict(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(60)
        assert process.exitcode == 0
    names = [name for name, _ in _model().named_parameters()]
    for outcome in outcomes.values():
        assert "error" not in outcome, outcome
        for group_bytes, found in outcome.items():
            assert found["names"] == names, (group_bytes, found)  # the model's order
            assert found["equal"], (group_bytes, found)
        # float32 embed, row, bias | bfloat16 scale | float32 head: three groups
        assert outcome[1 << 20]["gathers"] == 3, outcome
        # 16 bytes: each parameter (all larger) its own group
        assert outcome[16]["gathers"] == len(names), outcome
