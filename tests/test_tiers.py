"""Every test module has exactly one tier (tests/tiers.py), every tier is a registered marker, and the
marker reaches the module's tests (so `python -m pytest -m unit` and the others select them)."""

import subprocess
import sys
import tomllib

from .conftest import REPO_ROOT
from .tiers import TIER_OF, TIERS


def test_every_test_module_has_exactly_one_tier():
    modules = sorted(p.stem for p in (REPO_ROOT / "tests").glob("test_*.py"))
    listed = [m for ms in TIERS.values() for m in ms]
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"in more than one tier (or twice in one): {twice}"
    untiered, gone = sorted(set(modules) - set(listed)), sorted(set(listed) - set(modules))
    assert not untiered, f"no tier: add {untiered} to tests/tiers.py"
    assert not gone, f"tests/tiers.py names modules that do not exist: {gone}"
    assert set(TIERS) == {"unit", "integration", "e2e"}


def test_the_tiers_are_registered_markers():
    markers = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= set(TIERS)


def test_a_test_carries_its_module_tier_only(request):
    tiers = {m.name for m in request.node.iter_markers() if m.name in TIERS}
    assert tiers == {TIER_OF["test_tiers"]} == {"unit"}


def test_minus_m_selects_by_tier():
    """`-m e2e` over a unit module and an e2e one collects the e2e module's tests only, `-m unit` the
    unit one's: the tier is given before pytest deselects by marker."""
    def collected(tier):
        p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", tier,
                            "tests/test_tiers.py", "tests/test_smoke_real.py"], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=300)
        return {line.split("::")[0] for line in p.stdout.splitlines() if "::" in line}

    assert collected("e2e") == {"tests/test_smoke_real.py"}
    assert collected("unit") == {"tests/test_tiers.py"}
    assert collected("integration") == set()
