"""``weightsync plan``: predict a sync's time from the cluster's layout and link figures.

Each engine topology is a pipeline of per-bucket stages (:mod:`.topologies`); the planner
predicts every backend's options on a described cluster and ranks them, naming what bounds
each (:mod:`.planner`); :mod:`.probe` measures link figures between Ray nodes.
"""

from typing import TYPE_CHECKING, Any

from weightsync_core.plan.layout import Cluster, Link, Workload
from weightsync_core.plan.planner import (
    ASSUMED_GPU_COSTS,
    MEASURED_CPU_COSTS,
    RankedPrediction,
    plan,
    plan_table,
    sharded_plan,
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
    sharded_delivery,
    sharded_pull,
)

if TYPE_CHECKING:
    from weightsync_core.plan.probe import measure_cluster_links, measure_link


def __getattr__(name: str) -> Any:
    """The probe's functions, imported (with Ray) on first use."""
    if name in ("measure_cluster_links", "measure_link"):
        from weightsync_core.plan import probe

        return getattr(probe, name)
    raise AttributeError(f"module 'weightsync_core.plan' has no attribute {name!r}")


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
    "measure_cluster_links",
    "measure_link",
    "pipeline",
    "plan",
    "plan_table",
    "ring",
    "sharded_delivery",
    "sharded_plan",
    "sharded_pull",
    "topology_options",
]
