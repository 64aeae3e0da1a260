"""weightsync in vLLM: every weightsync backend as a vLLM weight-transfer engine
(``WeightTransferConfig(backend="weightsync")``), and vLLM rollout replicas for weightsync's
manager and trainer."""

from importlib.metadata import version

from weightsync_vllm.async_worker import AsyncVLLMRolloutWorker
from weightsync_vllm.model_source import ModelWeightsSource, perturb_, save_qwen2
from weightsync_vllm.plugin import BACKEND_NAME
from weightsync_vllm.staged_worker import StagedAsyncVLLMRolloutWorker
from weightsync_vllm.tensor_parallel import StagedVLLMReplica, VLLMReplica
from weightsync_vllm.worker import VLLMRolloutWorker, default_engine_args

__version__ = version("weightsync-vllm")

__all__ = [
    "BACKEND_NAME",
    "AsyncVLLMRolloutWorker",
    "ModelWeightsSource",
    "StagedAsyncVLLMRolloutWorker",
    "StagedVLLMReplica",
    "VLLMReplica",
    "VLLMRolloutWorker",
    "__version__",
    "default_engine_args",
    "perturb_",
    "save_qwen2",
]
