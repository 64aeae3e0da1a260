"""A delta sender spread over two real gloo ranks (processes of their own): each keeps and diffs
only its slice, the patches are those of one sender keeping the whole copy, and a rank that
cannot diff makes both raise instead of leaving the other waiting."""

import asyncio
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from weightsync_core.api.errors import ManifestChangedError
from weightsync_core.data.delta import (
    DeltaBaselineError,
    DeltaPlan,
    DeltaReceiver,
    DeltaSender,
    SpreadDeltaSender,
)
from weightsync_core.testing.weights import ONE_ELEMENT, sparse_updates

RANKS = 2
_GROUP_TIMEOUT = timedelta(seconds=60)


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(40_003, generator=generator),  # rows do not split evenly
        "matrix": torch.randn(300, 70, generator=generator).t(),  # not contiguous
        "tiny": torch.randn(3, generator=generator),  # all on the last rank
        "scalar": torch.randn((), generator=generator),
        "counts": torch.randint(0, 100, (1000,), generator=generator),
        "mask": torch.rand(517, generator=generator) > 0.5,
    }


async def _collect(stream):
    return [(name, tensor.clone()) async for name, tensor in stream]


async def _aiter(items):
    for item in items:
        yield item


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _sync(sender, weights, plan, sending):
    return asyncio.run(_collect(sender.stream(_aiter(weights.items()), plan, torch.bfloat16,
                                              sending)))


def _syncs_in_step(rank: int, results) -> None:
    """Six syncs (full, then patches of 2%, 30%, one element, nothing, everything); rank 0 sends
    and checks every patch against a whole-copy sender's and every rebuilt tensor."""
    spread = SpreadDeltaSender()
    whole, receiver = DeltaSender(), DeltaReceiver()
    weights = _weights()
    plan = DeltaPlan(version="v0")
    kinds = []
    for step, fraction in enumerate([None, 0.02, 0.3, ONE_ELEMENT, 0.0, 1.0]):
        if fraction is not None:
            weights = sparse_updates(weights, [(step, fraction)])
            plan = DeltaPlan(version=f"v{step}", base=plan.version)
        sent = _sync(spread, weights, plan, sending=rank == 0)
        assert spread.version == plan.version
        if rank != 0:  # drains: the tensors go on as they are
            assert [name for name, _ in sent] == list(weights)
            continue
        expected = _sync(whole, weights, plan, sending=True)
        for (name, patch), (_, reference) in zip(sent, expected, strict=True):
            assert torch.equal(patch, reference), f"sync {step}: {name}'s patch differs"
        kinds.append(sorted({int(patch[4]) for _, patch in sent if patch.dtype == torch.uint8}))
        rebuilt = asyncio.run(_collect(receiver.decode(_aiter(sent), plan)))
        for name, tensor in rebuilt:
            wanted = weights[name].to(torch.bfloat16) if weights[name].is_floating_point() \
                else weights[name]
            assert torch.equal(_bytes(tensor), _bytes(wanted)), f"sync {step}: {name}"
    results.put((rank, {"kept": spread.kept_bytes, "model": sum(
        t.to(torch.bfloat16).numel() * t.to(torch.bfloat16).element_size()
        if t.is_floating_point() else t.numel() * t.element_size()
        for t in weights.values()), "kinds": kinds, "deltas": spread.deltas_since_full}))


def _troubled_rank_stops_both(rank: int, results) -> None:
    """Rank 1 lost its copy (a restart): both ranks raise, naming it; then a layout change
    raises on both too."""
    spread = SpreadDeltaSender()
    weights = _weights()
    _sync(spread, weights, DeltaPlan(version="v0"), sending=rank == 0)
    if rank == 1:
        spread.forget()
    errors = []
    try:
        _sync(spread, sparse_updates(weights, [(1, 0.02)]), DeltaPlan("v1", "v0"),
              sending=rank == 0)
    except DeltaBaselineError as exc:
        errors.append(str(exc))
    assert spread.version is None and not spread.baselines
    _sync(spread, weights, DeltaPlan(version="v2"), sending=rank == 0)
    try:
        _sync(spread, {**weights, "tiny": torch.zeros(4)}, DeltaPlan("v3", "v2"),
              sending=rank == 0)
    except ManifestChangedError as exc:
        errors.append(str(exc))
    results.put((rank, {"errors": errors}))


def _rank_main(body, rank: int, init_file: str, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=RANKS, timeout=_GROUP_TIMEOUT)
        torch.set_num_threads(1)
        body(rank, results)
    except BaseException:  # reported to the test, which fails on it
        results.put((rank, {"failed": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_ranks(context, body, tmp_path) -> dict[int, dict]:
    results = context.Queue()
    processes = [context.Process(target=_rank_main,
                                 args=(body, rank, str(tmp_path / "group"), results))
                 for rank in range(RANKS)]
    for process in processes:
        process.start()
    reports = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=30)
    failed = {rank: report["failed"] for rank, report in reports.items() if "failed" in report}
    assert not failed, failed
    return reports


def test_each_rank_keeps_its_slice_and_the_patches_are_the_whole_copys(clean_processes,
                                                                       tmp_path):
    reports = _run_ranks(clean_processes, _syncs_in_step, tmp_path)
    model = reports[0]["model"]
    for rank in range(RANKS):
        # each rank keeps about half (slices start on 8 elements), none the whole model
        assert reports[rank]["kept"] < model / RANKS + 64, reports[rank]
        assert reports[rank]["deltas"] == 5
    assert reports[0]["kept"] + reports[1]["kept"] == model
    # positions, bitmasks, whole tensors and unchanged ones all went through the spread diff
    assert {kind for kinds in reports[0]["kinds"] for kind in kinds} == {0, 1, 2, 3}


def test_a_rank_that_cannot_diff_makes_every_rank_raise(clean_processes, tmp_path):
    reports = _run_ranks(clean_processes, _troubled_rank_stops_both, tmp_path)
    for rank in range(RANKS):
        version_error, layout_error = reports[rank]["errors"]
        assert "actor rank(s) [1] of the 2 that keep the last version do not hold version " \
            "v0" in version_error
        assert "tensor 'tiny' changed from [3] torch.bfloat16 to [4] torch.bfloat16" in layout_error


@pytest.fixture(autouse=True)
def _no_stray_group():
    yield
    assert not dist.is_initialized()
