"""Config presets, files, overrides and the error messages."""

import json

import pytest

from diffusionrl.config import ALGORITHMS, PRESETS, Config, ConfigError, get_preset, load_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_round_trips(name):
    cfg = get_preset(name)
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert cfg.preset == name


def test_reference_recipe_preset_matches_the_published_defaults():
    cfg = get_preset("sd35m-ocr")
    assert cfg.model.lora_rank == 32 and cfg.model.lora_alpha == 64
    assert cfg.sampling.resolution == 512 and cfg.sampling.num_steps == 10 and cfg.sampling.guidance_scale == 4.5
    assert cfg.algorithm.clip_range == 1e-4 and cfg.algorithm.kl_beta == 0.04 and cfg.algorithm.global_std
    assert cfg.train.learning_rate == 3e-4 and cfg.train.mixed_precision == "fp16"
    assert cfg.eval.num_steps == 40 and cfg.reward.weights == {"ocr": 1.0}


def test_unknown_keys_are_rejected_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        load_config(overrides=["train.lerning_rate=1e-3"])
    path = tmp_path / "c.yaml"
    path.write_text("sampling:\n  num_step: 8\n")
    with pytest.raises(ConfigError, match=r"c.yaml.*did you mean 'num_steps'"):
        load_config(file=path)
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("tiny-gpu")


def test_inconsistent_batch_settings_say_what_to_change():
    with pytest.raises(ConfigError, match="use micro_batch_size=6"):
        load_config(overrides=["train.prompts_per_step=3", "train.group_size=4", "train.micro_batch_size=8"])
    with pytest.raises(ConfigError, match="window_range"):
        load_config(overrides=["sampling.step_strategy=sde_window", "sampling.num_sde_steps=4",
                               "sampling.window_range=[0, 2]"])
    with pytest.raises(ConfigError, match="needs stochastic rollouts"):
        load_config(overrides=["sampling.sde_type=ode"])


def test_file_and_overrides_apply_in_order(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"preset": "tiny-cpu", "train": {"learning_rate": 0.01, "steps": 3}}))
    cfg = load_config(file=path, overrides=["train.steps=7", "sampling.window_range=[1, 4]"])
    assert cfg.train.learning_rate == 0.01 and cfg.train.steps == 7 and cfg.sampling.window_range == [1, 4]
    assert cfg.digest() != load_config().digest()
    assert load_config().digest() == load_config().digest()


def test_values_are_type_checked_and_yaml_style_floats_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 3e-4\n")
    assert load_config(file=path).train.learning_rate == 3e-4
    assert load_config(overrides=["train.learning_rate=1e-2"]).train.learning_rate == 0.01
    with pytest.raises(ConfigError, match="train.steps must be of type int"):
        load_config(overrides=["train.steps=many"])
    with pytest.raises(ConfigError, match="must be a number"):
        load_config(overrides=["algorithm.kl_beta=true"])


def test_machinery_and_presets_import_no_schema_module():
    # The schema (config.root, config.sections, config.sampling) builds on config.tree, config.objectives and
    # config.presets, never the reverse: no import statement of theirs reaches it, directly or not.
    from .test_imports import edges, modules

    mods = modules()
    schema = {"diffusionrl.config", "diffusionrl.config.root", "diffusionrl.config.sections",
              "diffusionrl.config.sampling"}
    for name in ("diffusionrl.config.tree", "diffusionrl.config.objectives", "diffusionrl.config.presets"):
        reached, todo = set(), [name]
        while todo:
            new = edges(todo[-1], mods[todo.pop()], set(mods)) - reached
            reached |= new
            todo += sorted(new)
        assert not reached & schema, (name, sorted(reached & schema))


@pytest.mark.parametrize("override, message", [
    ("algorithm.kl_beta=nan", "algorithm.kl_beta=nan must be a finite number"),
    ("algorithm.clip_range=.nan", "algorithm.clip_range=nan must be a finite number"),
    ("reward.weights={jpeg_compressibility: .nan}", "reward.weights.jpeg_compressibility=nan must be a finite number"),
    ("train.learning_rate=inf", "train.learning_rate=inf must be a finite number"),
    ("train.max_grad_norm=nan", "train.max_grad_norm=nan must be a finite number"),
    ("sampling.guidance_scale=-.inf", "sampling.guidance_scale=-inf must be a finite number"),
    ("reward.weights={jpeg_compressibility: lots}", "reward.weights.jpeg_compressibility must be a number, got 'lots'"),
    ("model.device=gpu", "model.device='gpu' is not a device: use auto, cpu, cuda or cuda:N"),
    ("train.lr_min_ratio=1.5", "train.lr_min_ratio=1.5 must be in [0, 1]"),
    ("train.lr_warmup_steps=40", "train.lr_warmup_steps=40 leaves none of the run's train.steps=40 at the full "
                                 "learning rate; use fewer"),
])
def test_nonsense_numbers_and_devices_are_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert str(err.value) == message


def test_inf_only_where_a_key_allows_it_and_direct_trees_are_checked_too():
    assert load_config(overrides=["tracking.max_artifact_mb=.inf"]).tracking.max_artifact_mb == float("inf")
    assert load_config(overrides=["model.device=cuda:1"]).model.device == "cuda:1"
    from diffusionrl.config import AlgorithmConfig, TrainConfig

    with pytest.raises(ConfigError, match=r"^algorithm.kl_beta=nan must be a finite number$"):
        Config(algorithm=AlgorithmConfig(kl_beta=float("nan")))
    with pytest.raises(ConfigError, match=r"^train.learning_rate=inf must be a finite number$"):
        Config(train=TrainConfig(learning_rate=float("inf")))


@pytest.mark.parametrize("override, message", [
    ("model.lora_rank=0", "model.lora_rank=0 must be > 0"),
    ("eval.num_prompts=-1", "eval.num_prompts=-1 must be >= 0"),
    ("tracking.max_artifact_mb=-.inf", "tracking.max_artifact_mb=-inf must be >= 0"),  # inf allowed, the bound holds
    ("train.mixed_precision=fp8", "train.mixed_precision='fp8' is not one of ['no', 'fp16', 'bf16']"),
    ("algorithm.dpo_pairs=some", "algorithm.dpo_pairs='some' is not one of ['best_worst', 'all']"),  # an objective's
    ("algorithm.dppo_kl_threshold=-0.5", "algorithm.dppo_kl_threshold=-0.5 must be >= 0"),
    ("model.lora_init=true", "model.lora_init must be of type str, got True"),  # YAML's true is no 'true'
    ("train.steps=2.5", "train.steps must be of type int, got 2.5"),
    ("train.lr_schedule=linear", "train.lr_schedule='linear' is not one of ['constant', 'cosine']"),
])
def test_choices_and_bounds_in_the_type_hints_are_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert str(err.value) == message


def test_a_tree_built_in_python_is_held_to_its_type_hints():
    import math

    from diffusionrl.config import AlgorithmConfig, DataConfig, ModelConfig, TrainConfig

    cases = [
        (lambda: ModelConfig(lora_rank=0), "model.lora_rank=0 must be > 0"),
        (lambda: AlgorithmConfig(dppo_kl_space="y"), "algorithm.dppo_kl_space='y' is not one of ['x', 'v']"),
        (lambda: AlgorithmConfig(name="ppo"), "algorithm.name='ppo' is not one of " + str(list(ALGORITHMS))),
        (lambda: TrainConfig(steps=2.5), "train.steps must be of type int, got 2.5"),
        (lambda: Config(data=DataConfig(seed=math.nan)), "data.seed=nan must be a finite number"),
    ]
    for build, message in cases:
        with pytest.raises(ConfigError) as err:
            build()
        assert str(err.value) == message


def test_a_partial_tree_is_laid_over_its_preset_not_over_bare_defaults():
    cfg = Config.from_dict({"train": {"steps": 3}})  # no preset key: tiny-cpu, the field's default
    assert cfg.train.learning_rate == get_preset("tiny-cpu").train.learning_rate != Config().train.learning_rate
    assert cfg.train.steps == 3 and cfg.preset == "tiny-cpu"
    nft = Config.from_dict({"preset": "tiny-cpu-nft", "train": {"steps": 3}})
    assert nft.algorithm.name == "nft" and nft == load_config("tiny-cpu-nft", overrides=["train.steps=3"])
    unset = len(Config().flat()) - 2  # every key but `preset` and the one given
    expected = rf"^config leaves {unset} keys unset \(model.name, .*unknown preset 'tiny-cpx'"
    with pytest.raises(ConfigError, match=expected):
        Config.from_dict({"preset": "tiny-cpx", "train": {"steps": 3}})
    full = {**get_preset("sd35m-ocr").to_dict(), "preset": "my-recipe"}  # a full tree needs no preset
    assert Config.from_dict(full).preset == "my-recipe"


def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    from diffusionrl.config.cli import main as config_main
    from diffusionrl.train import main as train_main

    assert train_main(["--set", "train.lerning_rate=1", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "config error: unknown key 'lerning_rate' in override 'train.lerning_rate' " \
                                      "(train); did you mean 'learning_rate'?\n"
    assert train_main(["--set", f"data.source={tmp_path / 'none.txt'}", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == f"prompt data error: no such file or folder: {tmp_path / 'none.txt'}\n"
    assert not (tmp_path / "run").exists()  # nothing was started
    assert config_main(["--set", "model.device=gpu"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
