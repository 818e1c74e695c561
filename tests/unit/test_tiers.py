"""The tier of a test is its folder (tests/unit, tests/integration, tests/e2e): no test module lies
outside them, every tier is a registered marker, and the marker reaches the module's tests (so
`python -m pytest -m unit` and the others select them)."""

import subprocess
import sys
import tomllib

from ..conftest import REPO_ROOT, TIERS


def test_every_test_module_lies_in_one_tier_folder():
    tests = REPO_ROOT / "tests"
    outside = sorted(str(p.relative_to(tests)) for p in tests.rglob("test_*.py") if p.parent.name not in TIERS
                     or p.parent.parent != tests)
    assert not outside, f"test modules outside tests/unit, tests/integration, tests/e2e: {outside}. Fix: git mv them into one"
    assert TIERS == ("unit", "integration", "e2e") and all((tests / t / "__init__.py").is_file() for t in TIERS)
    assert len(list((tests / "unit").glob("test_*.py"))) >= 30 and len(list((tests / "e2e").glob("test_*.py"))) >= 5


def test_the_tiers_are_registered_markers():
    markers = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= set(TIERS)


def test_a_test_carries_its_folders_tier_only(request):
    assert {m.name for m in request.node.iter_markers() if m.name in TIERS} == {"unit"}


def test_minus_m_selects_by_tier():
    """`-m e2e` over a unit module and an e2e one collects the e2e module's tests only, `-m unit` the
    unit one's: the tier is given before pytest deselects by marker."""
    # one process (one import of torch) collects three times, once per tier
    code = ("import pytest\n"
            "for tier in ('e2e', 'unit', 'integration'):\n"
            "    print('TIER', tier, flush=True)\n"
            "    pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', tier,\n"
            "                 'tests/unit/test_tiers.py', 'tests/e2e/test_smoke_real.py'])\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    collected, tier = {}, None
    for line in p.stdout.splitlines():
        if line.startswith("TIER "):
            tier = line.split()[1]
            collected[tier] = set()
        elif "::" in line:
            collected[tier].add(line.split("::")[0])
    assert collected == {"e2e": {"tests/e2e/test_smoke_real.py"}, "unit": {"tests/unit/test_tiers.py"},
                         "integration": set()}, p.stdout[-2000:] + p.stderr[-2000:]


def test_the_serial_modules_come_first_then_vllm_then_e2e(request):
    """The order the README's `-n 2 --dist loadfile` hands out modules in (conftest.py): the
    `serial` modules (alone, all the cores) first, then the two `vllm` modules, the longest, one on
    each worker, then the other e2e modules, integration and unit; xdist keeps
    that order (its default sorts the modules by their number of tests)."""
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/unit/test_tiers.py", "tests/integration/test_cli.py", "tests/e2e/test_smoke_real.py",
                        "tests/e2e/test_vllm_stages.py", "tests/e2e/test_vllm.py", "tests/integration/test_run_lock.py"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    order = list(dict.fromkeys(line.split("::")[0] for line in p.stdout.splitlines() if "::" in line))
    assert order == ["tests/integration/test_run_lock.py", "tests/e2e/test_vllm_stages.py", "tests/e2e/test_vllm.py",
                     "tests/e2e/test_smoke_real.py", "tests/integration/test_cli.py", "tests/unit/test_tiers.py"], \
        p.stdout[-2000:]
    if request.config.pluginmanager.hasplugin("xdist"):  # `-p no:xdist` has no such option to set
        assert request.config.option.loadscopereorder is False


def test_a_workers_first_other_test_waits_for_every_serial_test(tmp_path):
    """conftest.wait_for_serial_tests: it returns once the run's file lists every selected serial
    test (not before: a worker would otherwise start a long test that the other worker's queued
    serial tests then wait behind), and gives up when no test was added for `stall_s`."""
    import threading
    import time

    from tests.conftest import wait_for_serial_tests

    done = tmp_path / "serial-done"
    expected = {"a::t1", "b::t2"}

    def finish():
        time.sleep(0.3)
        done.write_text("a::t1\n")
        time.sleep(0.6)
        with open(done, "a") as f:
            f.write("b::t2\n")

    writer = threading.Thread(target=finish)
    start = time.monotonic()
    writer.start()
    assert wait_for_serial_tests(expected, done, poll_s=0.05, stall_s=5) is True
    waited = time.monotonic() - start
    writer.join()
    assert 0.85 <= waited < 3, waited
    assert wait_for_serial_tests(set(), tmp_path / "none", poll_s=0.05) is True  # no serial test selected
    start = time.monotonic()
    assert wait_for_serial_tests(expected | {"c::t3"}, done, poll_s=0.05, stall_s=0.5) is False
    assert 0.5 <= time.monotonic() - start < 3
