"""The `peagle` command: every subcommand reaches its own entry point through `python -m
peagle_train.cli` (the console script `peagle` calls the same `peagle_train.cli:main`; the
installed executable itself is run by scripts/check_install.sh, see test_install_check), and a
dry run of the demo recipe runs through it from an empty directory."""

import json
import os
import re
import subprocess
import sys

import pytest

from peagle_train.cli import COMMANDS, main

from .conftest import REPO_ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
for _k in ("HYDRA_FULL_ERROR", "PEAGLE_TRACEBACK"):
    ENV.pop(_k, None)


def peagle(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "peagle_train.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_pyproject_declares_the_console_script():
    import tomllib

    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"] == {"peagle": "peagle_train.cli:main"}


def test_bare_command_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == ["prepare", "regenerate", "features", "convert-features", "train", "evaluate", "export", "recommend-k",
                      "plan", "sweep"]
    assert main([]) == 2 and "usage: peagle <command>" in capsys.readouterr().out
    assert main(["trian"]) == 2
    assert "peagle: error: unknown command 'trian'. Did you mean train?" in capsys.readouterr().err


# subcommand → (first line of its --help, a key its --help lists with a comment)
HELP = {
    "prepare": ("Prepare training data once", "  data.pack_length "),
    "regenerate": ("Regenerate the assistant turns", "  regenerate.backend "),
    "features": ("Write offline target features", "  features.storage "),
    "convert-features": ("Re-store an offline features directory", "Keys: features.dir, output_dir, storage, int8_scale"),
    "train": ("`peagle train`: prepare data", "  training.lr "),
    "evaluate": ("Measure acceptance length", "  baseline_head "),
    "export": ("Export a training checkpoint", "  head "),
    "recommend-k": ("Recommend K (num_speculative_tokens)", "  recommend.batch_sizes "),
    "plan": ("Plan a GPU run before renting the GPUs", "  gpu_memory_gb "),
    "sweep": ("`peagle sweep`: rewrite the table", "Keys: output_dir, jobs"),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_subcommand_help_reaches_its_entry_point(name, tmp_path):
    p = peagle(name, "--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    first, key = HELP[name]
    assert p.stdout.startswith(first), p.stdout[:300]
    assert key in p.stdout, p.stdout[-2000:]
    if name not in ("sweep", "convert-features"):  # Hydra commands: the schema's keys with type, default and help; the recipes
        assert re.search(r"\n  seed +int = 0\n +seed of data shuffling", p.stdout) and "smollm2-135m-demo" in p.stdout
    assert list(tmp_path.iterdir()) == []  # --help writes nothing (no Hydra run dir, no outputs/)


# an invalid call per subcommand: the message only that entry point gives, as `peagle <name>: error:`
INVALID = {
    "prepare": (["traning.lr=1"], "unknown config key 'traning.lr'"),
    "regenerate": (["regenerate.backend=foo"], "peagle regenerate: error: regenerate.backend='foo' must be hf, vllm or endpoint"),
    "features": ([], "peagle features: error: Give the output directory: features.dir="),
    "convert-features": ([], "peagle convert-features: error: give features.dir=..., storage=..."),
    "train": (["training.lr=abc"], "peagle train: error: config: Error merging override training.lr=abc"),
    "evaluate": ([], "peagle evaluate: error: Give the head to evaluate: head="),
    "export": ([], "peagle export: error: Give head=runs/<run>/checkpoint"),
    "recommend-k": ([], "peagle recommend-k: error: recommend_k: Nothing to measure with: give head="),
    "plan": (["world_size=0"], "peagle plan: error: world_size=0 is out of range: it must be an integer ≥ 1"),
    "sweep": (["jbos=[a]"], "peagle sweep: error: unknown key 'jbos' on the command line. Did you mean jobs?"),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_invalid_call_reaches_its_entry_point(name, tmp_path):
    args, needle = INVALID[name]
    out = tmp_path / "out"
    p = peagle(name, *args, *([] if name in ("prepare", "sweep") else [f"output_dir={out}"]), cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert sorted(x.name for x in tmp_path.iterdir()) in ([], ["out"])  # nothing in the working directory


def test_train_dry_run_through_the_command_from_an_empty_directory(tmp_path):
    """`peagle train recipe=smollm2-135m-demo dry_run=true`: the packaged recipe composes under the
    schema, Hydra's run dir is output_dir (its .hydra/ and train.log there), nothing lands in the
    working directory."""
    cwd, out = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    p = peagle("train", "recipe=smollm2-135m-demo", "dry_run=true", f"output_dir={out}", cwd=cwd, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["dry_run"]["steps"] == 2 and s["dry_run"]["num_depths"] == 8 and s["dry_run"]["family"] == "llama"
    assert (out / ".hydra" / "config.yaml").is_file() and (out / "train.log").is_file()
    assert (out / "export" / "config.json").is_file()
    assert list(cwd.iterdir()) == []


@pytest.mark.skipif(os.environ.get("PEAGLE_INSTALL_CHECK") != "1",
                    reason="PEAGLE_INSTALL_CHECK=1 runs scripts/check_install.sh (a fresh venv, a few minutes)")
def test_install_check(tmp_path):
    """The non-editable install in a fresh venv runs the shrunk demo with the installed `peagle`."""
    p = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "check_install.sh"), str(tmp_path / "venv")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "install check passed" in p.stdout and "export valid" in p.stdout, p.stdout[-2000:]
