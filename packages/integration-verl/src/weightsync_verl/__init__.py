"""verl on weightsync.

Importing this package (verl does, given ``custom_backend_module=weightsync_verl``) registers
every installed weightsync backend in verl's ``CheckpointEngineRegistry`` as
``weightsync_<name>``; :class:`CheckpointEngineManager` is weightsync's manager for verl's
``checkpoint_manager_class``, and :class:`StagingCheckpointEngineWorker` verl's rollout
worker that takes its staged syncs (``weightsync_verl.fully_async``: verl's fully-async
trainer with both). It also makes verl's LoRA policies sync their adapter through weightsync
backends, in both ways (:mod:`weightsync_verl.lora`: verl #7495).
"""

from weightsync_verl.engines import (
    PREFIX,
    WeightsyncCheckpointEngine,
    register_backends,
    verl_backend_name,
    weightsync_backend_name,
)
from weightsync_verl.groups import VerlWorkerGroup, role_prefix
from weightsync_verl.lora import install as install_lora_delivery
from weightsync_verl.manager import CheckpointEngineManager, weightsync_config
from weightsync_verl.staging import (
    StagingCheckpointEngineWorker,
    staging_replica_class,
    use_staging_replicas,
)

__all__ = [
    "PREFIX",
    "CheckpointEngineManager",
    "StagingCheckpointEngineWorker",
    "VerlWorkerGroup",
    "WeightsyncCheckpointEngine",
    "install_lora_delivery",
    "register_backends",
    "role_prefix",
    "staging_replica_class",
    "use_staging_replicas",
    "verl_backend_name",
    "weightsync_backend_name",
    "weightsync_config",
]

REGISTERED_BACKENDS: list[str] = register_backends()
"""verl's names of the weightsync backends this import registered."""
install_lora_delivery()
