"""YAML defaults, dotted overrides and validation errors (verl's key paths; the old spellings
are in test_config_verl_paths.py)."""

import pytest

from weightsync_trainer import ConfigError, ExperimentConfig, load_config
from weightsync_trainer.cli import main
from weightsync_trainer.config_loader import config_to_dict, default_config_dict


def test_defaults_build_and_match_the_packaged_yaml():
    config = load_config()
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor_rollout_ref.rollout.checkpoint_engine.backend == "gloo"
    assert config.actor_rollout_ref.rollout.checkpoint_manager_class is None
    assert (config_to_dict(config)["actor_rollout_ref"]["actor"]
            == default_config_dict()["actor_rollout_ref"]["actor"])


def test_dataclass_defaults_equal_the_yaml_defaults():
    assert config_to_dict(ExperimentConfig()) == config_to_dict(load_config())


def test_dotted_overrides_reach_nested_dataclasses():
    config = load_config(overrides=[
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nixl",
        "trainer.total_training_steps=20",
        "actor_rollout_ref.actor.optim.lr=1e-3",  # a float (YAML 1.1 would read a string)
        "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nixl.device=cpu",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module="
        "[trainer_test_plugins.backend]",
        "trainer.output_dir=null",
    ])
    engine = config.actor_rollout_ref.rollout.checkpoint_engine
    assert engine.backend == "nixl"
    assert config.trainer.total_training_steps == 20
    assert config.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-3)
    assert engine.engine_kwargs == {"nixl": {"device": "cpu"}}
    assert engine.custom_backend_module == ["trainer_test_plugins.backend"]
    assert config.trainer.output_dir is None


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("algorithm:\n  adv_estimator: gae\ntrainer:\n  total_training_steps: 7\n")
    config = load_config(path, ["trainer.total_training_steps=9"])
    assert config.algorithm.adv_estimator == "gae"
    assert config.trainer.total_training_steps == 9


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.total_training_step=5", r"unknown configuration key "
     r"'trainer.total_training_step'\. Did you mean trainer.total_training_steps\?"),
    ("actor_rollout_ref.rollout.checkpoint_engine.backnd=gloo",
     r"Did you mean actor_rollout_ref\.rollout\.checkpoint_engine\.backend\?"),
    ("trainr.total_training_steps=5", "Did you mean trainer"),
    ("trainer.total_training_steps=many",
     r"trainer.total_training_steps must be an integer, got 'many' \(str\)"),
    ("trainer.total_training_steps=2.5",
     r"trainer.total_training_steps must be an integer, got 2\.5 \(float\)"),
    ("actor_rollout_ref.rollout.checkpoint_engine.verify=maybe",
     r"actor_rollout_ref\.rollout\.checkpoint_engine\.verify must be True or False"),
    ("trainer.total_training_steps=0", r"trainer.total_training_steps must be > 0, got 0"),
    ("algorithm.adv_estimator=dpo", "algorithm.adv_estimator must be one of gae, grpo"),
    ("algorithm.lam=1.5", r"algorithm.lam must be in \[0, 1\]"),
    ("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=0",
     "update_weights_bucket_megabytes must be a positive integer"),
    ("task.target_token=99", r"task.target_token \(99\) must be < "
                             r"actor_rollout_ref.model.vocab_size"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3",
     r"data.train_batch_size \(8\) must be a multiple of "
     r"actor_rollout_ref.actor.ppo_mini_batch_size \(3\)"),
    ("trainer.n_gpus_per_node=3", r"must split evenly over the 3 ranks of trainer.nnodes"),
    ("trainer.total_training_steps.x=1",
     r"trainer.total_training_steps is a value \(30\), not a section"),
    ("trainer.total_training_steps", r"not in Hydra's override syntax \(key=value"),
    ("++actor_rollout_ref.model=3", "actor_rollout_ref.model must be a mapping of keys"),
])
def test_bad_overrides_are_explained(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_prints_config_and_reports_errors(capsys):
    assert main(["--print-config", "trainer.total_training_steps=3"]) == 0
    assert "total_training_steps: 3" in capsys.readouterr().out
    assert main(["trainer.total_trainig_steps=3"]) == 2
    assert "Did you mean trainer.total_training_steps" in capsys.readouterr().err


def test_documented_engine_options_are_options():
    from pathlib import Path

    from weightsync_core.testing.docs import check_documented_options

    # the docs site's trainer pages (the tests run from a repository checkout)
    pages = sorted((Path(__file__).parents[3] / "docs" / "trainer").glob("*.md"))
    backends = [where.split()[-1] for page in pages for where in check_documented_options(page)]
    assert "nixl" in backends


def test_a_misspelt_engine_option_fails_before_any_worker_starts():
    with pytest.raises(ConfigError, match="Did you mean 'plugin'"):
        load_config(overrides=[
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nixl",
            "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nixl.backend_plugin=UCX",
        ])
