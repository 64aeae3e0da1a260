"""One local Ray instance per test session; the test actors importable in Ray workers; per
module, a small Qwen2 on disk and a sender holding its weights."""

import sys
from pathlib import Path

import pytest

from weightsync_core.testing import ensure_ray
from weightsync_vllm.model_source import save_qwen2

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session", autouse=True)
def ray_session():
    """Ray on loopback (vLLM's engines start their own processes beside the actors)."""
    ensure_ray(num_cpus=4, env_vars={"PYTHONPATH": str(TESTS)})
    yield


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A 2-layer Qwen2 (hidden 64, vocab 8192: a 2 MiB embedding and head), untied."""
    return save_qwen2(str(tmp_path_factory.mktemp("model")), hidden_size=64, vocab_size=8192)


@pytest.fixture(scope="session")
def one_layer_model_path(tmp_path_factory) -> str:
    """A 1-layer Qwen2 (hidden 64, vocab 8192), untied: the model of the one-worker ``LLM``
    engine that ``test_vllm_replica`` and ``test_vllm_failure_safety`` share."""
    return save_qwen2(str(tmp_path_factory.mktemp("one-layer")), hidden_size=64,
                      num_hidden_layers=1, vocab_size=8192)


@pytest.fixture(scope="session")
def llm_rollout(one_layer_model_path):
    """A greedy one-worker ``LLM`` rollout actor serving :func:`one_layer_model_path`, started
    once for the modules that use it (each of their cases ends with a sync that succeeded)."""
    from vllm_sync_support import running_rollout

    from weightsync_vllm.worker import VLLMRolloutWorker

    with running_rollout(VLLMRolloutWorker, one_layer_model_path) as worker:
        yield worker


@pytest.fixture(scope="module")
def source(model_path):
    """The sending side (its engine rebuilt for each backend) and its Hugging Face copy."""
    from vllm_sync_support import Sender

    sender = Sender(model_path)
    yield sender
    sender.kill()
