"""A checkpoint engine written the way verl's are, to show that such an engine runs on
weightsync with only its base-class import changed (from ``verl.checkpoint_engine.base``).

Like verl's engines it sets its own attributes instead of calling ``super().__init__``, takes
verl's ``is_master`` and ``rebuild_group``, puts ``method`` in its topology (as verl's NIXL
engine does), returns nothing from ``send_weights``, iterates the weights with a plain
``for`` on the ranks that do not send, splits and merges large tensors with
``split_weight_chunks`` / ``merge_weight_chunks`` and builds its own group (a gloo broadcast
from actor rank 0 over a ``TCPStore``, which has no authentication: this is a test fixture,
not a weightsync backend). Registered as ``verl_style_gloo``.
"""

import datetime
import json
import socket

import ray
import torch
import torch.distributed as dist

from weightsync_core.verl_compat import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)


@CheckpointEngineRegistry.register("verl_style_gloo")
class VerlStyleGlooEngine(CheckpointEngine):
    def __init__(self, bucket_size: int, is_master: bool = False, rebuild_group: bool = False):
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rebuild_group = rebuild_group
        self.rank = None
        self.group = None
        self.listener = None

    def prepare(self):
        # the port stays bound until the store takes it over (verl probes a free port and
        # closes it: another process may take it meanwhile, which failed a CI run once)
        host = ray.util.get_node_ip_address()
        self._close_listener()
        self.listener = socket.create_server((host, 0))
        return {"host": host, "port": self.listener.getsockname()[1]}

    def _close_listener(self):
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    @classmethod
    def build_topology(cls, actor_wg_world_size, rollout_world_size, metadata):
        world_size = rollout_world_size + 1
        master = metadata[0]
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1),
                 "world_size": [world_size] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world_size)),
                   "world_size": [world_size] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        # as verl's NIXL engine: the method's name is part of the arguments
        actor["method"] = ["init_process_group"] * actor_wg_world_size
        rollout["method"] = ["init_process_group"] * rollout_world_size
        return actor, rollout

    def init_process_group(self, rank, world_size, master):
        self.rank = rank
        listen_fd = self.listener.detach() if rank == 0 else None
        self._close_listener()
        if rank < 0:
            return
        store = dist.TCPStore(master["host"], master["port"], world_size, rank == 0,
                              timeout=datetime.timedelta(seconds=60),
                              master_listen_fd=listen_fd)
        self.group = dist.ProcessGroupGloo(store, rank, world_size,
                                           datetime.timedelta(seconds=60))

    def finalize(self):
        if self.rebuild_group:
            self.group = None

    def _broadcast(self, tensor):
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def _send_bucket(self, metas, chunks, last):
        header = json.dumps({"last": last, "metas": metas}).encode()
        self._broadcast(torch.tensor([len(header)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        data = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64))
        if data.numel():
            self._broadcast(data)

    async def send_weights(self, weights, global_steps=None):
        if self.rank != 0:
            for _ in weights:  # as verl's engines: drive the trainer's gathers, send nothing
                pass
            return
        metas, chunks, used = [], [], 0
        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            if used + meta.chunk_size > self.bucket_size and chunks:
                self._send_bucket(metas, chunks, last=False)
                metas, chunks, used = [], [], 0
            metas.append({"name": meta.name, "shape": list(meta.shape),
                          "dtype": str(meta.dtype).removeprefix("torch."),
                          "chunk_offset": meta.chunk_offset, "chunk_size": meta.chunk_size,
                          "offset": used})
            chunks.append(chunk)
            used += meta.chunk_size
        self._send_bucket(metas, chunks, last=True)

    async def _chunks(self):
        while True:
            length = torch.empty(1, dtype=torch.int64)
            self._broadcast(length)
            header = torch.empty(int(length), dtype=torch.uint8)
            self._broadcast(header)
            bucket = json.loads(bytes(header.numpy()))
            size = torch.empty(1, dtype=torch.int64)
            self._broadcast(size)
            data = torch.empty(int(size), dtype=torch.uint8)
            if data.numel():
                self._broadcast(data)
            for meta in bucket["metas"]:
                start = meta["offset"]
                yield (TensorMeta(meta["name"], torch.Size(meta["shape"]),
                                  getattr(torch, meta["dtype"]), meta["chunk_offset"],
                                  meta["chunk_size"], start),
                       data[start:start + meta["chunk_size"]])
            if bucket["last"]:
                return

    async def receive_weights(self, global_steps=None):
        async for name, tensor in merge_weight_chunks(self._chunks(), self.bucket_size):
            yield name, tensor
