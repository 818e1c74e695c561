"""The typed, strict schema: misspelled keys and unknown recipes fail with near matches; every
recipe composes under the schema."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from peagle_train import config as C
from .conftest import REPO_ROOT


def compose_train(overrides):
    C.register()
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides)


def test_misspelled_keys_list_near_matches():
    errs = C.check_command_line(["-m", "training.lrr=1", "trainig.epochs=2", "draft.num_depths=2,4,8", "+x=1",
                                 "hydra.verbose=true", "seed=3"])
    assert len(errs) == 2
    assert errs[0].startswith("unknown config key 'training.lrr' in the command line. Did you mean training.lr or ")
    assert "Keys of training: epochs, tokens_per_step," in errs[0]
    assert "Did you mean training.epochs" in errs[1]


def test_unknown_recipe_lists_existing_ones_and_recipe_typos_are_caught(tmp_path, monkeypatch):
    (err,) = C.check_command_line(["recipe=smollm2-135m-dmo"])
    assert "recipe 'smollm2-135m-dmo' does not exist" in err and "smollm2-135m-demo" in err
    monkeypatch.setattr(C, "RECIPES_DIR", tmp_path)
    (tmp_path / "bad.yaml").write_text("# @package _global_\ntraining:\n  warmup_step: 3\ndraft:\n  num_depths: 4\n")
    (err,) = C.check_command_line(["recipe=bad"])
    assert "unknown config key 'training.warmup_step' in " + str(tmp_path / "bad.yaml") in err
    assert "Did you mean training.warmup_steps" in err


def test_schema_is_strict_and_typed_in_hydra():
    cfg = compose_train(["recipe=smollm2-135m-demo", "training.save_every=8"])
    assert cfg.training.tokens_per_step == 1024 and cfg.training.save_every == 8 and cfg.training.keep_last == 3
    assert OmegaConf.get_type(cfg.training) is C.TrainingConfig
    with pytest.raises(ConfigCompositionException):
        compose_train(["training.lr=fast"])  # not a float
    with pytest.raises(ConfigCompositionException):
        compose_train(["training.lrr=1"])  # not in the schema


def test_schema_matches_config_yaml_defaults():
    """conf/config.yaml and the dataclass defaults agree, except eval.categories (yaml: MT-Bench)."""
    yaml = OmegaConf.load(REPO_ROOT / "conf" / "config.yaml")
    schema = OmegaConf.structured(C.Config)
    for key in C.schema_keys():
        if key in ("output_dir", "eval.categories") or C.schema_keys()[key] is None:
            continue
        assert OmegaConf.select(yaml, key) == OmegaConf.select(schema, key), key


def test_cpu_threads_default_is_this_process_share_of_the_cores(monkeypatch):
    from peagle_train.cli import train as train_main
    monkeypatch.setattr(train_main.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert train_main.cpu_threads(None) == 8     # one process: all cores (accelerate launch would give 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert train_main.cpu_threads(None) == 4     # two processes on this node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert train_main.cpu_threads(None) == 1
    assert train_main.cpu_threads(3) == 3        # an explicit setting wins
