"""verl's own NIXL engine on weightsync, with only its import line changed (see
:mod:`weightsync_verl.verl_engines`): ``custom_backend_module=weightsync_verl.verl_nixl``
makes it backend ``verl_nixl`` in every process (and ``nixl`` where weightsync-nixl is not
installed). verl 0.9.1's engine takes ``device`` (``"cpu"`` for host memory),
``rollout_dtype`` and ``is_master``; UCX's transports come from the ``UCX_*`` environment."""

from weightsync_verl.verl_engines import load_on_weightsync

__all__ = ["ENGINE_MODULE"]

ENGINE_MODULE = load_on_weightsync("nixl_checkpoint_engine")
"""verl's ``nixl_checkpoint_engine`` module, on weightsync's base."""
