"""verl's own Mooncake engine on weightsync, with only its import line changed (see
:mod:`weightsync_verl.verl_engines`): ``custom_backend_module=weightsync_verl.verl_mooncake``
makes it backend ``verl_mooncake`` in every process (and ``mooncake`` where
weightsync-mooncake is not installed). verl 0.9.1's engine takes ``device`` (``"cpu"`` for
host memory), ``rollout_dtype``, ``device_name`` and ``is_master``, reads the process's rank
from ``RANK`` (set by verl's worker groups) and holds every tensor in one bucket. Where
neither vLLM nor SGLang is installed its process group is weightsync's sealed stand-in, and
without an RDMA device its Transfer Engine runs over TCP."""

from weightsync_verl.verl_engines import load_on_weightsync

__all__ = ["ENGINE_MODULE"]

ENGINE_MODULE = load_on_weightsync("mooncake_checkpoint_engine")
"""verl's ``mooncake_checkpoint_engine`` module, on weightsync's base."""
