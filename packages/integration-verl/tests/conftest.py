"""One Ray instance and one small model for the whole test session."""

from __future__ import annotations

import pytest
import ray

from weightsync_verl.scenario import save_tiny_model


@pytest.fixture(scope="session")
def ray_cluster():
    # 8 worker processes per scenario: logical CPUs for verl's placement groups, not cores
    ray.init(num_cpus=16, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> str:
    # a 2 MiB embedding: larger than the 1 MiB bucket, so tensors are chunked and merged
    return save_tiny_model(tmp_path_factory.mktemp("model"), hidden_size=64, vocab_size=8192)
