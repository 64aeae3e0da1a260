"""The base of actor and critic ranks: an FSDP2-sharded model, its optimiser and context."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from weightsync_core import load_custom_backend_module
from weightsync_trainer.checksum import weights_digest
from weightsync_trainer.config import TrainingWorkerConfig

__all__ = ["TrainingWorker", "full_parameters", "local_parameters"]

_GROUP_TIMEOUT = timedelta(minutes=5)

LossFn = Callable[[slice], tuple[torch.Tensor, dict[str, torch.Tensor]]]


GATHER_GROUP_BYTES = 64 << 20
"""Bytes of full tensors :func:`full_parameters` gathers in one collective at most."""


def full_parameters(model: torch.nn.Module, trainable_only: bool = False,
                    group_bytes: int = GATHER_GROUP_BYTES
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for each parameter (``trainable_only``: each that requires a
    gradient, such as a LoRA adapter's), in the model's order.

    Consecutive parameters sharded by FSDP2 (``Shard(0)`` over every rank) of one dtype are
    all-gathered together, up to ``group_bytes`` of full tensors (one parameter where it is
    larger): each rank's rows of the group in one flat buffer, one ``all_gather``. A
    collective per small tensor costs more than its bytes (the main job's 86 KB model took
    one per parameter). Other parameters are gathered alone (``DTensor.full_tensor()``).
    At most one group's full tensors exist at a time. Every rank of the group must iterate
    in step (the groups depend only on the parameters' names, shapes, dtypes and
    placements, which every rank shares).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    group: list[tuple[str, torch.nn.Parameter]] = []
    grouped_bytes = 0
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        if world > 1 and _row_sharded(param, world):
            nbytes = param.numel() * param.element_size()  # a DTensor's numel is the whole
            if group and (grouped_bytes + nbytes > group_bytes
                          or group[0][1].dtype != param.dtype):
                yield from _gathered(group, world)
                group, grouped_bytes = [], 0
            group.append((name, param))
            grouped_bytes += nbytes
            continue
        yield from _gathered(group, world)
        group, grouped_bytes = [], 0
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, tensor.detach()
    yield from _gathered(group, world)


def _gathered(named: list[tuple[str, torch.nn.Parameter]], world: int
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of ``named`` (``Shard(0)`` parameters of one dtype over ``world``
    ranks), gathered in one ``all_gather``."""
    if not named:
        return
    sizes = [[_rows_of(rank, param.shape[0], world) * (param.numel() // param.shape[0])
              for _, param in named] for rank in range(world)]
    longest = max(map(sum, sizes))
    mine = torch.cat([cast(DTensor, param).to_local().detach().reshape(-1)
                      for _, param in named])
    flat = torch.zeros(longest, dtype=mine.dtype)
    flat[:mine.numel()] = mine
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    starts = [0] * world
    for index, (name, param) in enumerate(named):
        pieces = []
        for source in range(world):
            size = sizes[source][index]
            pieces.append(gathered[source][starts[source]:starts[source] + size])
            starts[source] += size
        yield name, torch.cat(pieces).reshape(param.shape)


def _row_sharded(param: torch.nn.Parameter, world: int) -> bool:
    """Whether ``param`` is FSDP2's ``Shard(0)`` of a tensor over ``world`` ranks."""
    return (isinstance(param, DTensor) and param.dim() > 0
            and param.device_mesh.size() == world
            and tuple(param.placements) == (Shard(0),))


def _rows_of(rank: int, rows: int, world: int) -> int:
    """How many of ``rows`` rows ``rank`` holds under ``Shard(0)`` (``torch.chunk``'s
    split: ceil(rows / world) per rank, the last ones short or empty)."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


def local_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's rows)`` for each parameter: the local ``Shard(0)`` piece of a
    sharded one (no collective), an unsharded one whole."""
    for name, param in model.named_parameters():
        tensor = param.to_local() if isinstance(param, DTensor) else param
        yield name, tensor.detach()


def _shard(model: torch.nn.Module) -> None:
    """FSDP2: shard each transformer block, then the root (embeddings, norm, head)."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module)
    fully_shard(model)


class TrainingWorker:
    """One rank of a training worker group (``actor_wg`` or the critic group).

    Construct it as a Ray actor with a :class:`TrainingWorkerConfig` and its rank, then call
    :meth:`init_model` on every rank at once with rank 0's :meth:`master_address`. The model is
    sharded with FSDP2 (``fully_shard``) over a gloo default process group on CPU.

    ``custom_backend_module`` is imported in this process on construction, so that a custom
    backend registers here too.
    """

    role = "training"
    model_type = ""

    def __init__(self, config: TrainingWorkerConfig, rank: int) -> None:
        if config.model_type != self.model_type:
            raise ValueError(
                f"{type(self).__name__} trains a {self.model_type!r} model, but its "
                f"TrainingWorkerConfig has model_type={config.model_type!r}"
            )
        torch.set_num_threads(config.torch_threads)
        engine = config.checkpoint_engine  # the driver's allowlist travels with it
        load_custom_backend_module(engine.custom_backend_module, engine.trusted_modules)
        self.config = config
        self.rank = rank
        self.extra_context = config.extra_context
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def _built_model(self) -> torch.nn.Module:
        """The sharded model of this rank (after :meth:`init_model`)."""
        if self.model is None:
            raise RuntimeError(
                f"{type(self).__name__} rank {self.rank} has no model yet: call init_model() "
                "first"
            )
        return self.model

    def build_model(self) -> torch.nn.Module:
        """The unsharded model of this role."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def master_address(self) -> tuple[str, int]:
        """An address and free port of this host for the group's rendezvous (ask rank 0)."""
        host = os.environ.get("WEIGHTSYNC_HOST") or socket.gethostbyname(socket.gethostname())
        with socket.socket() as sock:
            sock.bind((host, 0))
            return host, sock.getsockname()[1]

    def init_model(self, master_addr: str, master_port: int) -> None:
        """Join the group's default process group, build, shard and wrap the model."""
        dist.init_process_group(
            "gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
            world_size=self.config.world_size, timeout=_GROUP_TIMEOUT,
        )
        model = self.build_model()
        _shard(model)
        self.model = model
        optim = self.config.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay
        )

    def _optimize(self, loss_fn: LossFn, batch_size: int) -> dict[str, float]:
        """``ppo_epochs`` passes of ``ppo_mini_batches`` optimiser steps over this rank's
        shard; ``loss_fn(rows)`` returns the loss and metrics of those rows. Returns the mean
        of every metric plus the gradient norm."""
        config = self.config
        size = batch_size // config.ppo_mini_batches
        sums: dict[str, float] = {}
        count = 0
        model = self._built_model()
        if self.optimizer is None:
            raise RuntimeError(
                f"{type(self).__name__} rank {self.rank} has no optimizer yet: call "
                "init_model() first"
            )
        optimizer = self.optimizer
        model.train()
        for _ in range(config.ppo_epochs):
            for start in range(0, batch_size, size):
                loss, metrics = loss_fn(slice(start, start + size))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), config.optim.clip_grad
                )
                if isinstance(norm, DTensor):
                    norm = norm.full_tensor()
                optimizer.step()
                metrics = {**metrics, f"{self.role}/grad_norm": norm}
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
                count += 1
        return {key: value / count for key, value in sums.items()}

    def weights_checksum(self) -> str:
        """Digest of the full weights (collective: call on every rank)."""
        return weights_digest(full_parameters(self._built_model()))

    def get_extra_context(self) -> dict[str, Any]:
        """The ``extra_context`` this process received."""
        return self.extra_context

    def worker_info(self) -> dict[str, Any]:
        """Process id, role, rank and which configured custom backend modules are imported."""
        modules = self.config.checkpoint_engine.custom_backend_module or []
        modules = [modules] if isinstance(modules, str) else list(modules)
        return {
            "pid": os.getpid(),
            "role": self.role,
            "rank": self.rank,
            "custom_backend_modules_imported": [m for m in modules if m in sys.modules],
        }
