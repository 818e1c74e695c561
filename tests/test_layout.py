"""The house's import rules: nothing below the trainer imports it (or the old loop path), the
feature side imports no training code, and the trainer has no algorithm branch."""

import ast
from pathlib import Path

from .conftest import REPO_ROOT

PKG = REPO_ROOT / "peagle_train"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the peagle_train modules a file imports (relative imports resolved)."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = parts[:len(parts) - node.level] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names.add(mod)
            names |= {f"{mod}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("peagle_train")}


def test_nothing_below_the_trainer_imports_it():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel == "training/trainer.py":
            continue
        bad = {m for m in imported_modules(path) if m.startswith("peagle_train.training.trainer")}
        if rel != "dryrun.py" and not rel.startswith("cli/"):  # the dry run and the commands drive the trainer
            assert not bad, f"{rel} imports {bad}"


def test_only_the_commands_import_the_cli():
    """peagle_train/cli/ is the top of the house: no module below it imports it."""
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if not rel.startswith("cli/"):
            bad = {m for m in imported_modules(path) if m.startswith("peagle_train.cli")}
            assert not bad, f"{rel} imports {bad}"


def test_feature_side_imports_no_training_code():
    for sub in ("target", "features", "draft"):
        for path in (PKG / sub).rglob("*.py"):
            bad = {m for m in imported_modules(path) if m.startswith(("peagle_train.training", "peagle_train.algorithms"))}
            assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_trainer_has_no_algorithm_branch():
    src = (PKG / "training" / "trainer.py").read_text()
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = {getattr(x, "attr", None) for x in [node.left, *node.comparators]}
            consts = {getattr(x, "value", None) for x in [node.left, *node.comparators]}
            assert "algorithm" not in names and not consts & {"peagle", "eagle3"}, ast.unparse(node)


def test_no_sys_path_insert_and_the_package_never_uses_the_checkout():
    """Scripts and tests import the installed (or PYTHONPATH) package; the package finds its own
    files as package data and has no notion of a checkout root."""
    from .conftest import REPO_ROOT as root

    for path in [*PKG.rglob("*.py"), *(root / "scripts").glob("*.py"), *(root / "tests").glob("*.py"), root / "train.py"]:
        if path.name == "test_layout.py":
            continue
        assert "sys.path.insert" not in path.read_text(), path
    for path in PKG.rglob("*.py"):
        assert "REPO_ROOT" not in path.read_text() and "parent.parent" not in path.read_text(), path


def test_no_timings_in_docstrings():
    """Measured times live in docs/BENCHMARKS.md, not in docstrings (they go stale with the machine)."""
    import re

    timing = re.compile(r"\b\d+(\.\d+)? ?(ms|µs|s/step|tokens/s|tok/s|GB/s)\b")
    found = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                found += [f"{path.relative_to(PKG)}: {m.group(0)}" for m in timing.finditer(doc)]
    assert not found, found
