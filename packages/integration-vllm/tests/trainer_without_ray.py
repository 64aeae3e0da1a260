"""A plain PyTorch trainer process (``import ray`` fails in it) that updates a served vLLM
replica through vLLM's documented trainer-side API with ``backend="weightsync"``; run by
``test_vllm_trainer_api.py``.

Usage: ``python trainer_without_ray.py BASE_URL MODEL_PATH BACKEND SYNCS [--fail-at N]
[--receivers N]``. Each sync perturbs the trainer's weights, sends them to ``--receivers`` vLLM
workers (the served engine's ``tensor_parallel_size``), and checks that vLLM's greedy tokens
changed and now equal Hugging Face's on the trainer's weights. With ``--fail-at``, one extra
sync first fails in the trainer's weight iterator after that many tensors; it must raise,
naming the cause, vLLM must serve the tokens it served before it (no layer of the failed
version loaded), and the syncs after it must recover. Prints one line per sync; exits
non-zero on any mismatch.
"""

import argparse
import sys

sys.modules["ray"] = None  # type: ignore[assignment]  # any import of Ray fails from here on

import requests  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402

from weightsync_core import CheckpointEngineConfig  # noqa: E402
from weightsync_vllm.model_source import perturb_  # noqa: E402
from weightsync_vllm.trainer_engine import WeightsyncTrainerInitInfo  # noqa: E402

PROMPTS = torch.randint(0, 8192, (2, 6), generator=torch.Generator().manual_seed(4))
NEW_TOKENS = 8


class FailingSource(ModuleSource):
    """The module's weights, raising after ``fail_at`` of them."""

    def __init__(self, module: torch.nn.Module, fail_at: int) -> None:
        super().__init__(module)
        self.fail_at = fail_at

    def __iter__(self):
        for index, pair in enumerate(super().__iter__()):
            if index == self.fail_at:
                raise RuntimeError(f"trainer failed after {index} tensors")
            yield pair


def served_tokens(base_url: str, model_path: str) -> torch.Tensor:
    rows = []
    for prompt in PROMPTS.tolist():
        response = requests.post(f"{base_url}/v1/completions", timeout=60, json={
            "model": model_path, "prompt": prompt, "max_tokens": NEW_TOKENS,
            "min_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True,
        })
        response.raise_for_status()
        rows.append(response.json()["choices"][0]["token_ids"])
    return torch.tensor(rows)


def hf_tokens(model: torch.nn.Module) -> torch.Tensor:
    output = model.generate(PROMPTS, attention_mask=torch.ones_like(PROMPTS), do_sample=False,
                            max_new_tokens=NEW_TOKENS, pad_token_id=0)
    return output[:, PROMPTS.shape[1]:]


def main(base_url: str, model_path: str, backend: str, syncs: int, fail_at: int | None,
         receivers: int) -> int:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=1,
                                    sync_timeout_seconds=60)
    init_info = WeightsyncTrainerInitInfo(config=config, host="127.0.0.1", rank=0,
                                          num_receivers=receivers)
    client = HTTPVLLMWeightSyncClient(base_url)
    source = ModuleSource(model) if fail_at is None else FailingSource(model, fail_at)
    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
    failures = 0
    if fail_at is not None:
        served_before = served_tokens(base_url, model_path)
        perturb_(model, 999)
        try:
            engine.send_weights()
            print("the failing sync did not fail")
            failures += 1
        except Exception as error:  # reported, then recovered from
            kept = torch.equal(served_tokens(base_url, model_path), served_before)
            print(f"failed sync ({'version kept' if kept else 'TOKENS CHANGED'}): "
                  f"{type(error).__name__}: {error}")
            failures += not kept
            if "trainer failed after" not in str(error):
                failures += 1
        source.fail_at = -1  # type: ignore[attr-defined]  # well-behaved from now on
    for step in range(syncs):
        before = served_tokens(base_url, model_path)
        perturb_(model, 100 + step)
        expected = hf_tokens(model)
        engine.send_weights()
        served = served_tokens(base_url, model_path)
        ok = torch.equal(served, expected) and not torch.equal(before, expected)
        print(f"sync {step + 1}: {'hf tokens' if ok else 'MISMATCH'}")
        failures += not ok
    engine.shutdown()
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_url")
    parser.add_argument("model_path")
    parser.add_argument("backend")
    parser.add_argument("syncs", type=int)
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--receivers", type=int, default=1)
    args = parser.parse_args()
    sys.exit(main(args.base_url, args.model_path, args.backend, args.syncs, args.fail_at,
                  args.receivers))
