"""Colocated mode (``naive``: the rollout runs inside each actor rank) through the command
line: metrics JSONL, plot, safetensors weights loadable with from_pretrained."""

import contextlib
import io
import json

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from weightsync_trainer.cli import main

STEPS = 10


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("run")
    printed = io.StringIO()  # what a log file or a pipe gets: no terminal
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        status = main([
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
            "trainer.n_gpus_per_node=2",
            f"trainer.total_training_steps={STEPS}",
            f"trainer.output_dir={output}",
        ])
    return status, output, printed.getvalue()


def test_colocated_run_learns(cli_run):
    status, output, _ = cli_run
    assert status == 0
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    summary = json.loads((output / "summary.json").read_text())
    assert summary["reward_last"] > summary["reward_first"] + 0.3
    assert (output / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_saved_weights_load_into_transformers(cli_run):
    _, output, _ = cli_run
    tensors = load_file(output / "weights" / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(output / "weights")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), tensors[name]), name
    # the trained policy now prefers the target token
    target = yaml.safe_load((output / "config.yaml").read_text())["task"]["target_token"]
    prompts = torch.randint(0, 16, (16, 4), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=prompts).logits[:, -1]
    assert (logits.argmax(-1) == target).float().mean() > 0.5


def test_off_a_terminal_the_output_is_step_lines_without_a_progress_bar(cli_run):
    _, _, printed = cli_run
    assert "\r" not in printed  # no progress bar redrawn between the lines
    assert "training:" not in printed and "step/s" not in printed
    steps = [line for line in printed.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [f"{n}/{STEPS}" for n in range(1, STEPS + 1)]
