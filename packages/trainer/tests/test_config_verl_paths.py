"""The trainer's configuration through Hydra and OmegaConf: verl's key paths, Hydra's override
syntax (``+key``, ``++key``, ``~key``), ``${...}`` interpolation, a user's YAML file
(``--config-path``/``--config-name``), the old spellings of 0.6 with their deprecation note,
and a backend that is not installed refused with the configuration (exit 2, before Ray)."""

import re

import pytest
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from weightsync_trainer import ConfigError, load_config
from weightsync_trainer.cli import main

ENGINE = "actor_rollout_ref.rollout.checkpoint_engine"


def _get(config, path):
    for name in path.split("."):
        config = getattr(config, name)
    return config


def test_verl_key_paths_reach_the_dataclasses():
    config = load_config(overrides=[
        f"{ENGINE}.backend=nixl",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.actor.optim.lr=3e-3",
        "actor_rollout_ref.actor.optim.clip_grad=0.5",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.model.path=null",
        "data.train_batch_size=4",
        "data.max_response_length=6",
        "trainer.total_training_steps=3",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=2e-3",
        "critic.cliprange_value=0.3",
        "ray_kwargs.ray_init.num_cpus=2",
    ])
    engine = config.actor_rollout_ref.rollout.checkpoint_engine
    assert (engine.backend, config.actor_rollout_ref.rollout.n) == ("nixl", 4)
    assert config.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-3)
    assert config.trainer.total_training_steps == 3
    assert config.actor_world_size == 1
    assert config.uses_critic
    assert config.sequences_per_step == 16
    assert config.ppo_mini_batches("actor") == 2
    # the packaged defaults interpolate the critic's mini-batches and epochs, as verl's do
    assert (config.critic.ppo_mini_batch_size, config.critic.ppo_epochs) == (2, 2)
    assert config.critic.optim.lr == pytest.approx(2e-3)
    assert config.ray_kwargs.ray_init.num_cpus == 2


OLD_SPELLINGS = [
    ("rollout.checkpoint_engine.backend=nixl", f"{ENGINE}.backend", "nixl"),
    ("rollout.checkpoint_engine.engine_kwargs.nixl.plugin=UCX", f"{ENGINE}.engine_kwargs",
     {"nixl": {"plugin": "UCX"}}),
    ("rollout.name=vllm", "actor_rollout_ref.rollout.name", "vllm"),
    ("rollout.num_replicas=3", "actor_rollout_ref.rollout.num_replicas", 3),
    ("rollout.tensor_parallel_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size",
     2),
    ("model.hidden_size=64", "actor_rollout_ref.model.hidden_size", 64),
    ("actor.world_size=1", "trainer.n_gpus_per_node", 1),
    ("actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.lr", 1e-3),
    ("actor.optim.max_grad_norm=0.5", "actor_rollout_ref.actor.optim.clip_grad", 0.5),
    ("critic.optim.max_grad_norm=0.5", "critic.optim.clip_grad", 0.5),
    ("task.prompt_length=6", "data.max_prompt_length", 6),
    ("task.response_length=6", "data.max_response_length", 6),
    ("algorithm.name=ppo", "algorithm.adv_estimator", "gae"),
    ("algorithm.name=grpo", "algorithm.adv_estimator", "grpo"),
    ("algorithm.group_size=4", "actor_rollout_ref.rollout.n", 4),
    ("algorithm.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio", 0.1),
    ("algorithm.ppo_epochs=2", "actor_rollout_ref.actor.ppo_epochs", 2),
    # a count of mini-batches then, prompts per mini-batch now (8 prompts in 4 mini-batches)
    ("algorithm.ppo_mini_batches=4", "actor_rollout_ref.actor.ppo_mini_batch_size", 2),
    ("algorithm.value_clip=0.3", "critic.cliprange_value", 0.3),
    ("trainer.total_steps=3", "trainer.total_training_steps", 3),
    ("trainer.prompts_per_step=4", "data.train_batch_size", 4),
    ("trainer.ray_num_cpus=2", "ray_kwargs.ray_init.num_cpus", 2),
]


@pytest.mark.parametrize(("override", "path", "value"), OLD_SPELLINGS)
def test_old_spellings_still_work_with_a_deprecation_note(override, path, value):
    old = override.partition("=")[0]
    new = re.escape(f"{old} is now ") + r"\S+ \(verl's key path\); the old spelling works "
    with pytest.warns(FutureWarning, match=new + r"until weightsync-trainer 0\.8"):
        config = load_config(overrides=[override])
    assert _get(config, path) == (pytest.approx(value) if isinstance(value, float) else value)


def test_every_old_key_is_tested():
    from weightsync_trainer.legacy_keys import LEGACY_KEYS

    tested = {override.partition("=")[0] for override, _, _ in OLD_SPELLINGS}
    for rule in LEGACY_KEYS:
        assert any(key == rule.old or key.startswith(rule.old + ".") for key in tested), rule


def test_old_mini_batch_count_must_split_the_prompts():
    with pytest.warns(FutureWarning), pytest.raises(
            ConfigError, match=r"algorithm.ppo_mini_batches=3 .* must split "
                               r"data.train_batch_size \(8\) evenly"):
        load_config(overrides=["algorithm.ppo_mini_batches=3"])


def test_old_spellings_in_a_yaml_file(tmp_path):
    (tmp_path / "old.yaml").write_text(
        "algorithm:\n  name: ppo\n  ppo_mini_batches: 4\n"
        "trainer:\n  total_steps: 7\n  prompts_per_step: 8\n"
        "rollout:\n  checkpoint_engine:\n    backend: naive\n"
        "actor:\n  world_size: 1\n  optim: {lr: 1e-3, max_grad_norm: 0.5}\n")
    with pytest.warns(FutureWarning) as notes:
        config = load_config(tmp_path / "old.yaml", ["trainer.total_training_steps=9"])
    assert any(str(note.message).startswith(
        "rollout.checkpoint_engine.backend is now actor_rollout_ref.rollout.checkpoint_engine."
        "backend (verl's key path)") for note in notes)
    assert config.algorithm.adv_estimator == "gae"
    assert config.trainer.total_training_steps == 9  # the override comes after the file
    assert config.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"
    assert config.actor_world_size == 1
    assert config.actor_rollout_ref.actor.optim.clip_grad == 0.5
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 2


def test_cli_prints_each_deprecation_note_once(capsys):
    assert main(["--print-config", "trainer.total_steps=3", "trainer.total_steps=4",
                 "rollout.checkpoint_engine.backend=naive"]) == 0
    out, err = capsys.readouterr()
    assert "total_training_steps: 4" in out
    assert "backend: naive" in out
    note = ("weightsync-train: note: trainer.total_steps is now trainer.total_training_steps "
            "(verl's key path)")
    assert err.count(note) == 1
    assert err.count("rollout.checkpoint_engine.backend is now "
                     "actor_rollout_ref.rollout.checkpoint_engine.backend") == 1


def test_plus_adds_a_key_and_refuses_an_existing_one():
    config = load_config(overrides=[f"+{ENGINE}.engine_kwargs.nixl.plugin=UCX",
                                    f"{ENGINE}.backend=nixl"])
    assert config.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs == {
        "nixl": {"plugin": "UCX"}}
    with pytest.raises(ConfigError, match=r"An item is already at 'trainer.seed'.*"
                                          r"'\+\+trainer.seed=3'"):
        load_config(overrides=["+trainer.seed=3"])
    # key=value changes a key that is there; where one is added it says to use +
    with pytest.raises(ConfigError, match=rf"add it with \+{ENGINE}\.engine_kwargs\.nixl\."
                                          r"plugin=UCX"):
        load_config(overrides=[f"{ENGINE}.engine_kwargs.nixl.plugin=UCX"])
    # a key the configuration does not have is refused, however it is added
    with pytest.raises(ConfigError, match=r"unknown configuration key 'trainer.sed'\. "
                                          r"Did you mean trainer.seed\?"):
        load_config(overrides=["+trainer.sed=3"])


def test_double_plus_adds_or_changes():
    config = load_config(overrides=["++trainer.seed=5", f"++{ENGINE}.engine_kwargs.gloo.host="
                                    "127.0.0.1"])
    assert config.trainer.seed == 5
    assert config.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs == {
        "gloo": {"host": "127.0.0.1"}}


def test_tilde_deletes_a_key(tmp_path):
    (tmp_path / "exp.yaml").write_text(
        "trainer:\n  output_dir: /tmp/somewhere\n"
        "actor_rollout_ref:\n  rollout:\n    checkpoint_engine:\n"
        "      engine_kwargs: {gloo: {host: 127.0.0.1}}\n")
    kept = load_config(config_name="exp", config_path=tmp_path)
    assert kept.trainer.output_dir == "/tmp/somewhere"
    config = load_config(config_name="exp", config_path=tmp_path, overrides=[
        "~trainer.output_dir", f"~{ENGINE}.engine_kwargs.gloo"])
    assert config.trainer.output_dir is None  # the key's default
    assert config.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs == {}
    with pytest.raises(ConfigError, match=r"cannot delete unknown configuration key "
                                          r"'trainer.outptu_dir'. Did you mean "
                                          r"trainer.output_dir\?"):
        load_config(overrides=["~trainer.outptu_dir"])


def test_interpolation(tmp_path):
    config = load_config(overrides=[
        "trainer.output_dir=/tmp/runs/${actor_rollout_ref.rollout.checkpoint_engine.backend}"
        "-seed${trainer.seed}",
        "trainer.seed=4",
    ])
    assert config.trainer.output_dir == "/tmp/runs/gloo-seed4"
    (tmp_path / "exp.yaml").write_text(
        "data:\n  train_batch_size: 4\n"
        "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: ${data.train_batch_size}\n")
    config = load_config(config_name="exp.yaml", config_path=tmp_path)
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 4
    assert config.critic.ppo_mini_batch_size == 4  # the packaged ${...} follows it
    with pytest.raises(ConfigError, match=r"trainer.output_dir: Interpolation key 'nope' "
                                          r"not found"):
        load_config(overrides=["trainer.output_dir=${nope}"])


def test_config_name_merges_a_user_yaml_over_the_defaults(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_experiment.yaml").write_text(
        "algorithm:\n  adv_estimator: gae\n"
        "actor_rollout_ref:\n  rollout:\n    checkpoint_engine:\n      backend: naive\n")
    config = load_config(config_name="my_experiment", config_path=tmp_path,
                         overrides=["critic.world_size=2"])
    assert config.algorithm.adv_estimator == "gae"
    assert config.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"
    assert config.critic.world_size == 2
    assert config.trainer.total_training_steps == 30  # the packaged default
    # the command line; --config-path defaults to the current directory
    monkeypatch.chdir(tmp_path)
    assert main(["--config-name", "my_experiment", "--print-config", "trainer.seed=9"]) == 0
    out = capsys.readouterr().out
    assert "adv_estimator: gae" in out and "seed: 9" in out and "backend: naive" in out
    assert main(["-cp", str(tmp_path), "-cn", "nope"]) == 2
    assert f"config 'nope' not found: no nope.yaml in {str(tmp_path)!r}" in (
        capsys.readouterr().err)


def test_config_name_with_verl_defaults_list(tmp_path):
    """A file written as verl's recipes are: its defaults list names ppo_trainer."""
    (tmp_path / "base.yaml").write_text("trainer:\n  seed: 11\n")
    (tmp_path / "recipe.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - base\n  - _self_\n"
        "trainer:\n  total_training_steps: 5\n")
    config = load_config(config_name="recipe", config_path=tmp_path)
    assert (config.trainer.total_training_steps, config.trainer.seed) == (5, 11)
    assert config.actor_rollout_ref.rollout.checkpoint_engine.backend == "gloo"


def test_a_user_file_that_does_not_compose_is_named(tmp_path):
    (tmp_path / "recipe.yaml").write_text("defaults:\n  - ppo_trainr\n  - _self_\n")
    with pytest.raises(ConfigError, match=rf"In '{re.escape(str(tmp_path))}/recipe.yaml': "
                                          r"Could not load 'ppo_trainr'"):
        load_config(config_name="recipe", config_path=tmp_path)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a YAML mapping at top level"):
        load_config(tmp_path / "list.yaml")


def test_typos_name_the_full_key_with_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=rf"unknown configuration key '{ENGINE}\.bakend'\. "
                                          rf"Did you mean {ENGINE}\.backend\? Valid keys "
                                          rf"under {ENGINE}: adapter_versions, backend, "
                                          "commit, custom_backend_module"):
        load_config(overrides=[f"{ENGINE}.bakend=nixl"])
    # an old name misspelt suggests its new path
    with pytest.raises(ConfigError, match=r"Did you mean trainer.total_training_steps\?"):
        load_config(overrides=["trainer.total_step=3"])
    with pytest.raises(ConfigError, match=r"'rolout'. Did you mean actor_rollout_ref.rollout\?"):
        load_config(overrides=["rolout.name=hf"])
    # in a user's file too
    (tmp_path / "exp.yaml").write_text("trainer:\n  total_trainng_steps: 3\n")
    with pytest.raises(ConfigError, match=r"'trainer.total_trainng_steps'. Did you mean "
                                          r"trainer.total_training_steps\?"):
        load_config(tmp_path / "exp.yaml")


def test_wrong_types_name_the_key_and_what_it_takes():
    with pytest.raises(ConfigError, match=rf"{ENGINE}\.verify must be True or False, got "
                                          r"'maybe' \(str\)"):
        load_config(overrides=[f"{ENGINE}.verify=maybe"])
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator must be one of gae, grpo, "
                                          r"got 'ppo' \(PPO with a critic is gae, as in verl\)"):
        load_config(overrides=["algorithm.adv_estimator=ppo"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.optim.lr must be > 0"):
        load_config(overrides=["actor_rollout_ref.actor.optim.lr=0"])


def test_an_unknown_backend_is_refused_with_the_configuration():
    with pytest.raises(ConfigError, match=rf"{ENGINE}\.backend='nixll': unknown "
                                          r"checkpoint-engine backend 'nixll'\. Did you mean "
                                          r"'nixl'\? Backends available here: .*gloo"):
        load_config(overrides=[f"{ENGINE}.backend=nixll"])
    with pytest.raises(ConfigError, match=rf"{ENGINE}\.custom_backend_module: .*"
                                          "no_such_package"):
        load_config(overrides=[f"{ENGINE}.custom_backend_module=no_such_package.backend"])


def test_cli_refuses_an_unknown_backend_with_exit_2_before_the_banner_and_ray(
        monkeypatch, capsys):
    def no_ray(config):
        raise AssertionError("Ray was started for a configuration that names no backend")

    monkeypatch.setattr("weightsync_trainer.cli._start_ray", no_ray)
    assert main([f"{ENGINE}.backend=nixll", "trainer.total_training_steps=3"]) == 2
    out, err = capsys.readouterr()
    assert "weightsync-train:" not in out  # no run banner
    assert err.startswith("weightsync-train: configuration error: "
                          f"{ENGINE}.backend='nixll'")
    assert "Did you mean 'nixl'?" in err and "Backends available here:" in err


def test_loads_inside_a_hydra_application():
    """A Hydra application of the user's keeps its own Hydra state."""
    with initialize_config_module("weightsync_trainer.conf", version_base="1.3"):
        outer = GlobalHydra.instance().hydra
        config = load_config(overrides=["trainer.total_training_steps=2"])
        assert config.trainer.total_training_steps == 2
        assert GlobalHydra.instance().hydra is outer
