"""``weightsync-train`` beside a Ray cluster that a user runs on the machine (``ray start
--head``): without ``RAY_ADDRESS`` or ``trainer.ray_address`` it starts a private instance of
its own and trains; with ``trainer.ray_address`` it trains on that cluster. Each run is a
process of its own (the test session has its own Ray)."""

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightsync_core.testing import user_ray_cluster

CONNECT_SECONDS = 10.0
"""The bound weightsync-core documents for reaching a cluster (docs/getting-started.md, "On a
Ray cluster")."""

TRAIN = [str(Path(sys.executable).parent / "weightsync-train"),
         "trainer.total_training_steps=2", "trainer.n_gpus_per_node=1",
         "actor_rollout_ref.rollout.num_replicas=1"]
"""The default experiment (GRPO, weights synced with gloo every step), small: one actor
rank, one replica, two steps."""
JOB_NUMBER = ("import sys, ray; from weightsync_core import ensure_ray; "
              "ensure_ray(address=sys.argv[1]); "
              "print(int.from_bytes(bytes.fromhex(ray.get_runtime_context().get_job_id()), "
              "'little'))")
"""Connects a driver to the cluster at ``argv[1]`` and prints its job number: one more than
the drivers that connected to that cluster before it."""


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def _drivers_so_far(address: str) -> int:
    """Drivers that have connected to the cluster at ``address`` (this count's own not
    included)."""
    probe = _run([sys.executable, "-c", JOB_NUMBER, address])
    assert probe.returncode == 0, probe.stderr[-2000:]
    return int(probe.stdout.split()[-1]) - 1


@pytest.fixture(scope="module")
def user_cluster() -> Iterator[str]:
    """A one-CPU ``ray start --head`` on loopback; its GCS address."""
    with user_ray_cluster(num_cpus=1) as address:
        yield address


def _steps(output: Path) -> list[int]:
    return [json.loads(line)["step"]
            for line in (output / "metrics.jsonl").read_text().splitlines()]


def test_train_beside_a_users_cluster_starts_its_own_ray(user_cluster, tmp_path):
    before = _drivers_so_far(user_cluster)
    train = _run([*TRAIN, f"trainer.output_dir={tmp_path}", "ray_kwargs.ray_init.num_cpus=2"])
    assert train.returncode == 0, train.stderr[-2000:]
    assert _steps(tmp_path) == [1, 2]
    assert _drivers_so_far(user_cluster) == before + 1  # only the count's own driver


def test_train_with_ray_address_trains_on_the_users_cluster(user_cluster, tmp_path):
    before = _drivers_so_far(user_cluster)
    train = _run([*TRAIN, f"trainer.output_dir={tmp_path}",
                  f"trainer.ray_address={user_cluster}"])
    assert train.returncode == 0, train.stderr[-2000:]
    assert _steps(tmp_path) == [1, 2]
    assert _drivers_so_far(user_cluster) == before + 2  # the count's driver, and the run's


def test_train_with_an_unreachable_ray_address_fails_in_seconds_with_one_line(tmp_path):
    with socket.socket() as held:  # bound, not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{held.getsockname()[1]}"
        start = time.monotonic()
        train = _run([*TRAIN, f"trainer.output_dir={tmp_path}",
                      f"trainer.ray_address={closed}"])
        seconds = time.monotonic() - start
    assert train.returncode == 1, train.stderr[-2000:]
    assert seconds < CONNECT_SECONDS + 30, seconds  # interpreter, torch and model included
    assert "Traceback" not in train.stderr
    assert train.stderr.strip().splitlines()[-1] == (
        f"weightsync-train: no Ray cluster answers at {closed}: Connection refused "
        f"(waited at most {CONNECT_SECONDS:.0f} s)")
