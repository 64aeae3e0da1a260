"""A transfer plan moved over a real gloo group of processes of their own (2 FSDP actor
ranks, 2 replicas of TP=2 and one of TP=1): bit-exact boxes on every worker over several
syncs, with and without relays between the replicas, and the failures named: a sender killed
mid-sync, a lying sender, a relaying worker killed or lying, a plan that differs."""

import os
import secrets
import traceback

import torch

from weightsync_core.api.checksums import host_checksum
from weightsync_core.api.errors import TransferError, VerificationError
from weightsync_core.data.delta import PATCH_HEADER_BYTES, DeltaPlan, DeltaReceiver, DeltaSender
from weightsync_core.data.shards import (
    Layout,
    PlanExchange,
    SliceDecoder,
    SliceEncoder,
    TransferPlan,
    decoder_tensor_parallel_layout,
    fsdp_layout,
)
from weightsync_core.net.process_group import (
    create_store,
    listen_on_free_port,
    new_gloo_group,
    rendezvous,
)
from weightsync_core.net.wire import MessageSealer
from weightsync_core.testing.weights import DECODER, make_weights

# the test weights' small Qwen2: a vocabulary of 100 rows, norms of 33 rows (17 and 16 on the
# two FSDP ranks)
MODEL = DECODER
SHAPES = {name: tuple(tensor.shape) for name, tensor in make_weights(0, 1 << 20, "decoder").items()}
DTYPES = {name: torch.bfloat16 for name in SHAPES}
ACTORS = 2
HELD = [fsdp_layout(SHAPES, ACTORS, rank) for rank in range(ACTORS)]
TP2 = [decoder_tensor_parallel_layout(SHAPES, MODEL, 2, rank) for rank in range(2)]
NEEDED = [*TP2, *TP2, Layout.whole(SHAPES)]
CHUNK = 1024  # bytes: the embedding's pieces travel in several chunks


def _weights(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16)
            for name, shape in SHAPES.items()}


KEY = bytes(range(32))
"""The sync's key, as the manager hands it to every process (each process imports this module
afresh, so it is no random one)."""


def _exchange(group, needed=NEEDED, timeout=20.0, relay=False) -> PlanExchange:
    plan = TransferPlan.build(SHAPES, HELD, needed, relay=relay)
    return PlanExchange(group, plan, SHAPES, DTYPES, ACTORS, MessageSealer(KEY),
                        chunk_bytes=CHUNK, timeout=timeout)


def _shards(rank: int, step: int):
    full = _weights(step)
    return [(name, box.cut(full[name])) for name, box in HELD[rank].boxes.items()]


def _three_syncs(rank: int, group, results, relay: bool = False) -> None:
    exchange = _exchange(group, relay=relay)
    exchange.agree(rank, ACTORS + len(NEEDED))
    received = 0
    for step in range(3):
        if rank < ACTORS:
            sent = exchange.send(rank, HELD[rank], _shards(rank, step))
            if step == 2:
                results.put((rank, {"sent": sent}))
            continue
        worker = rank - ACTORS
        full = _weights(step)
        for name, piece in exchange.receive(worker, NEEDED[worker]):
            assert torch.equal(piece, NEEDED[worker].boxes[name].cut(full[name])), (step, name)
            received += piece.numel() * piece.element_size()
    results.put((rank, {"received": received // 3}))


def _changed(step: int) -> dict[str, torch.Tensor]:
    """Step 0's weights with a few elements of every other tensor changed per step
    (none at step 1)."""
    weights = _weights(0)
    for later in range(2, step + 1):
        for index, tensor in enumerate(weights.values()):
            if index % 2 == later % 2:
                tensor.view(-1)[::97] += later
    return weights


VERSIONS = [DeltaPlan(f"v{step}", None if step == 0 else f"v{step - 1}") for step in range(4)]
"""A full sync, then three delta syncs (the first changes nothing)."""


def _delta_syncs(rank: int, group, results) -> None:
    exchange = _exchange(group, relay=True)
    exchange.agree(rank, ACTORS + len(NEEDED))
    sender, receiver = DeltaSender(), DeltaReceiver()
    moved = []
    for step, plan in enumerate(VERSIONS):
        full = _changed(step)
        if rank < ACTORS:
            encoder = SliceEncoder(sender, plan, f"actor rank {rank}")
            shards = [(name, box.cut(full[name])) for name, box in HELD[rank].boxes.items()]
            moved.append(exchange.send(rank, HELD[rank], shards, encoder))
            encoder.end()
            continue
        worker = rank - ACTORS
        decoder = SliceDecoder(receiver, plan, f"rollout rank {worker}")
        for name, piece in exchange.receive(worker, NEEDED[worker], decoder):
            assert torch.equal(piece, NEEDED[worker].boxes[name].cut(full[name])), (step, name)
        decoder.end()
        moved.append(decoder.stats.wire_bytes)
    results.put((rank, {"moved": moved}))


def _relayed_three_syncs(rank: int, group, results) -> None:
    _three_syncs(rank, group, results, relay=True)


def _one_sync(exchange: PlanExchange, rank: int) -> None:
    """Group rank ``rank``'s part of one sync: an actor rank sends, a worker receives."""
    if rank < ACTORS:
        exchange.send(rank, HELD[rank], _shards(rank, 0))
    else:
        list(exchange.receive(rank - ACTORS, NEEDED[rank - ACTORS]))


def _dies_before_the_sync(dying: int, relay: bool, rank: int, group, results) -> None:
    """Group rank ``dying`` exits once the plan is agreed; the others report their sync's
    ``TransferError``."""
    exchange = _exchange(group, timeout=30.0, relay=relay)
    exchange.agree(rank, ACTORS + len(NEEDED))
    if rank == dying:
        os._exit(0)
    try:
        _one_sync(exchange, rank)
        results.put((rank, {"error": None}))
    except TransferError as exc:
        results.put((rank, {"error": str(exc), "peer": exc.peer}))


def _killed_sender(rank: int, group, results) -> None:
    """Actor rank 1 dies."""
    _dies_before_the_sync(1, False, rank, group, results)


def _killed_relay(rank: int, group, results) -> None:
    """Rollout rank 0 dies, which relays its TP slices to rollout rank 2."""
    _dies_before_the_sync(ACTORS, True, rank, group, results)


def _lying_relay(rank: int, group, results) -> None:
    """Rollout rank 0 flips a bit of the first piece it relays to rollout rank 2."""
    exchange = _exchange(group, relay=True)
    index = next(i for i, t in enumerate(exchange.plan.transfers)
                 if t.relayed and t.sender == 0 and t.receiver == 2)
    if rank == ACTORS:
        exchange.group = _LyingGroup(group, exchange.first_tag(index))
    try:
        _one_sync(exchange, rank)
        results.put((rank, {"error": None}))
    except VerificationError as exc:
        results.put((rank, {"error": str(exc), "source": exc.source, "index": index}))
    except TransferError as exc:  # the worker that caught the lie left
        results.put((rank, {"error": str(exc), "peer": exc.peer}))


class _LyingGroup:
    """Actor rank 0's group, flipping a bit of the first chunk of a piece it sends; with
    ``forger``, also replacing the piece's checksum by one of the flipped bytes sealed
    under another key (as an outsider who raced the gloo connection would)."""

    def __init__(self, group, first_tag: int, forger: PlanExchange | None = None):
        self.group, self.first_tag, self.forger = group, first_tag, forger
        self.flipped = None

    def send(self, tensors, dst, tag):
        if tag == self.first_tag:
            tensors = [tensors[0].clone()]
            tensors[0][0] ^= 1
            self.flipped = tensors[0]
        elif self.forger is not None and self.flipped is not None and tensors[0].numel() < 100:
            frame = self.forger.sealed_checksum(self.index, self.flipped.numel(),
                                                host_checksum(self.flipped))
            tensors = [torch.frombuffer(bytearray(frame), dtype=torch.uint8)]
            self.flipped = None
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.group.recv(tensors, src, tag)

    def allgather(self, output, tensors):
        return self.group.allgather(output, tensors)


def _lying_sender(rank: int, group, results, forge: bool = False) -> None:
    exchange = _exchange(group)
    index = next(i for i, t in enumerate(exchange.plan.transfers)
                 if t.name == "model.norm.weight" and t.sender == 0 and t.receiver == 4)
    if rank < ACTORS:
        if rank == 0:
            forger = None
            if forge:
                forger = _exchange(group)
                forger.sealer = MessageSealer(secrets.token_bytes(32))
            exchange.group = _LyingGroup(group, exchange.first_tag(index), forger)
            exchange.group.index = index
        try:  # the worker that caught the lie stops receiving: a send to it may fail
            exchange.send(rank, HELD[rank], _shards(rank, 0))
        except TransferError as exc:
            assert exc.peer == "rollout rank 4", exc
    else:
        try:
            list(exchange.receive(rank - ACTORS, NEEDED[rank - ACTORS]))
        except VerificationError as exc:
            results.put((rank, {"error": str(exc), "source": exc.source}))
            return
        except TransferError as exc:  # its sender stopped at the worker that caught the lie
            results.put((rank, {"error": str(exc), "peer": exc.peer}))
            return
    results.put((rank, {"error": None}))


def _only_the_liars_receiver_caught_it(reports: dict[int, dict]) -> None:
    """Every other worker either received everything or failed naming the actor rank that
    stopped sending once the worker that caught the lie left (the sync fails everywhere)."""
    for worker in range(len(NEEDED)):
        report = reports[ACTORS + worker]
        if worker != 4 and report["error"] is not None:
            assert report.get("peer", "").startswith("actor rank "), report


def _forging_sender(rank: int, group, results) -> None:
    _lying_sender(rank, group, results, forge=True)


def _other_plan(rank: int, group, results) -> None:
    # rollout rank 4 thinks it is a TP=2 worker: its plan differs from everyone else's
    needed = [*NEEDED[:4], TP2[0]] if rank == ACTORS + 4 else NEEDED
    try:
        _exchange(group, needed).agree(rank, ACTORS + len(NEEDED))
        results.put((rank, {"error": None}))
    except TransferError as exc:
        results.put((rank, {"error": str(exc)}))


def _process(body, rank: int, size: int, port: int, listener, key: bytes, results) -> None:
    try:
        if rank != 0:
            listener.close()
        store = create_store("127.0.0.1", port, rank, size, 30.0, "shards", key,
                             listener if rank == 0 else None)
        rendezvous(store, rank, size, 30.0)
        group = new_gloo_group(store.store, rank, size, 30.0, "127.0.0.1")
        torch.set_num_threads(1)
        body(rank, group, results)
    except BaseException:  # reported to the test, which fails on it
        results.put((rank, {"failed": traceback.format_exc()}))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # no atexit: the store server of rank 0 may still serve the others


def _run(context, body) -> dict[int, dict]:
    size = ACTORS + len(NEEDED)
    results = context.Queue()
    listener = listen_on_free_port("127.0.0.1")
    port = listener.getsockname()[1]
    key = secrets.token_bytes(32)
    processes = [context.Process(target=_process,
                                 args=(body, rank, size, port, listener, key, results))
                 for rank in range(size)]
    for process in processes:
        process.start()
    listener.close()
    reports: dict[int, dict] = {}
    expected = size - (body in (_killed_sender, _killed_relay))
    try:
        while len(reports) < expected:
            rank, report = results.get(timeout=120)
            reports.setdefault(rank, {}).update(report)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    failed = {rank: report["failed"] for rank, report in reports.items() if "failed" in report}
    assert not failed, failed
    return reports


def test_fsdp_ranks_deliver_every_workers_boxes_bit_exact_over_three_syncs(clean_processes):
    reports = _run(clean_processes, _three_syncs)
    model = sum(torch.Size(shape).numel() for shape in SHAPES.values()) * 2
    per_worker = [reports[ACTORS + worker]["received"] for worker in range(len(NEEDED))]
    assert per_worker[4] == model  # the TP=1 worker: everything
    # each TP=2 worker: about half (norms whole, 64 of the 100 vocabulary rows on rank 0)
    assert all(0.4 * model < size < 0.6 * model for size in per_worker[:4]), per_worker


def test_relays_deliver_every_workers_boxes_bit_exact_with_each_slice_sent_once(clean_processes):
    """With relays the workers receive the same bytes, bit-exact, over three syncs, while
    the actor ranks send each distinct box once (the TP=1 worker's model and one TP=2
    replica's slices): the other replica's slices are forwarded by the first's workers."""
    reports = _run(clean_processes, _relayed_three_syncs)
    plain = _run(clean_processes, _three_syncs)
    assert [reports[ACTORS + w]["received"] for w in range(len(NEEDED))] == [
        plain[ACTORS + w]["received"] for w in range(len(NEEDED))]
    distinct = {(name, box) for layout in NEEDED for name, box in layout.boxes.items()}
    assert sum(reports[rank]["sent"] for rank in range(ACTORS)) == 2 * sum(
        box.numel for _, box in distinct)
    assert sum(reports[rank]["sent"] for rank in range(ACTORS)) < 0.75 * sum(
        plain[rank]["sent"] for rank in range(ACTORS))


def test_delta_syncs_of_slices_deliver_every_workers_boxes_bit_exact_as_patches(
        clean_processes):
    """A full sync, then three delta syncs (one changing nothing), relayed: every worker
    rebuilds its boxes bit-exact from patches of the pieces it receives, and a delta sync
    moves a small part of a full one's bytes, on every process."""
    reports = _run(clean_processes, _delta_syncs)
    for rank, report in reports.items():
        full, *deltas = report["moved"]
        assert full > 0 and all(delta < 0.2 * full for delta in deltas), (rank, report)
        plan = TransferPlan.build(SHAPES, HELD, NEEDED, relay=True)
        pieces = [t for t in plan.transfers
                  if (t.receiver == rank - ACTORS if rank >= ACTORS else
                      t.sender == rank and not t.relayed)]
        assert deltas[0] == PATCH_HEADER_BYTES * len(pieces), (rank, report)  # headers only


def test_a_killed_relaying_worker_is_named_by_the_worker_it_relays_to(clean_processes):
    reports = _run(clean_processes, _killed_relay)
    assert reports[ACTORS + 2]["peer"] == "rollout rank 0", reports[ACTORS + 2]


def test_a_relayed_piece_that_differs_from_its_checksum_is_caught_and_names_the_relay(
        clean_processes):
    reports = _run(clean_processes, _lying_relay)
    assert reports[ACTORS + 2]["source"] == "rollout rank 0", reports[ACTORS + 2]
    assert "from rollout rank 0 is corrupt: it differs from its sender's checksum" in \
        reports[ACTORS + 2]["error"]


def test_a_killed_sender_is_named_by_the_workers_waiting_for_its_rows(clean_processes):
    reports = _run(clean_processes, _killed_sender)
    for worker in range(len(NEEDED)):
        report = reports[ACTORS + worker]
        assert report["error"] is not None, f"rollout rank {worker} did not fail"
        assert report["peer"] == "actor rank 1", report


def test_a_piece_that_differs_from_its_senders_checksum_is_caught_and_named(clean_processes):
    reports = _run(clean_processes, _lying_sender)
    _only_the_liars_receiver_caught_it(reports)
    assert reports[ACTORS + 4]["source"] == "actor rank 0"
    assert "the piece [0:17] of tensor 'model.norm.weight' from actor rank 0 is corrupt: it " \
        "differs from its sender's checksum" in reports[ACTORS + 4]["error"]


def test_a_checksum_not_sealed_under_the_syncs_key_is_refused(clean_processes):
    """Other bytes with a matching checksum, sealed under another key (an outsider who
    raced a gloo connection): refused, never loaded."""
    reports = _run(clean_processes, _forging_sender)
    _only_the_liars_receiver_caught_it(reports)
    assert "the piece [0:17] of tensor 'model.norm.weight' from actor rank 0 came with a " \
        "checksum not sealed under this sync's key" in reports[ACTORS + 4]["error"]


def test_processes_whose_plans_differ_refuse_before_any_byte_moves(clean_processes):
    reports = _run(clean_processes, _other_plan)
    for rank, report in reports.items():
        assert "the transfer plan of rollout rank 4 differs" in report["error"] or (
            rank == ACTORS + 4 and "differs from this one" in report["error"]), (rank, report)
