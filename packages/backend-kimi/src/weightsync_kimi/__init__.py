"""weightsync-kimi: the ``kimi`` checkpoint-engine backend (alias ``kimi_ckpt_engine``).

Every actor rank serves its share of the weights from host memory registered with Mooncake
Transfer Engine; one leader per rollout replica pulls the buckets peer-to-peer and relays them
to the replica's other workers over a collective broadcast. The shares stay on the actor
hosts until the next update, so a replica added later loads them without the actor ranks
sending again (``CheckpointEngineManager.update_replicas_from_cache``).
"""

from weightsync_kimi.engine import KimiCheckpointEngine
from weightsync_kimi.shares import ShareAssigner, ShareManifest

__all__ = ["KimiCheckpointEngine", "ShareAssigner", "ShareManifest"]
