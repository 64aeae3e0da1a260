"""``weightsync plan``: predict a sync's time from the cluster's layout and link figures.

Each engine topology is a pipeline of per-bucket stages (:mod:`.topologies`); the planner
predicts every backend's options on a described cluster and ranks them, naming what bounds
each (:mod:`.planner`); :mod:`.probe` measures link figures between Ray nodes.
"""

from weightsync_core.plan.layout import Cluster, Link, Workload
from weightsync_core.plan.planner import (
    ASSUMED_GPU_COSTS,
    MEASURED_CPU_COSTS,
    RankedPrediction,
    plan,
    plan_table,
    topology_options,
)
from weightsync_core.plan.topologies import (
    EngineCosts,
    Prediction,
    Stage,
    chained_broadcast,
    fan_out,
    pipeline,
    ring,
    sharded_pull,
)

__all__ = [
    "ASSUMED_GPU_COSTS",
    "MEASURED_CPU_COSTS",
    "Cluster",
    "EngineCosts",
    "Link",
    "Prediction",
    "RankedPrediction",
    "Stage",
    "Workload",
    "chained_broadcast",
    "fan_out",
    "pipeline",
    "plan",
    "plan_table",
    "ring",
    "sharded_pull",
    "topology_options",
]
