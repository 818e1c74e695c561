"""scripts/gpu_check.py, the GPU check's runner, on CPU: pytest counts read from the per-test lines
(kept when a step is killed at its limit), a part that keeps each step's line when a later one dies
and stops at its time limit, and step8b freeing each row length's head before the next is measured.
The whole check on CPU is `bash scripts/gpu_check.sh --rehearse` (CI runs it)."""

import importlib.util
import json
import weakref

import pytest
import torch

from ..conftest import REPO_ROOT

# timed against timeouts, signals or step limits: alone under -n 2 (conftest.py)
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pytest_counts_read_from_the_per_test_lines(gpu_check):
    log = ("tests/integration/test_cuda.py::test_flex[flex-1] PASSED                     [ 10%]\n"
           "tests/integration/test_cuda.py::test_flex[sparse-2] FAILED                   [ 20%]\n"
           "tests/integration/test_cuda.py::test_bf16 SKIPPED (needs a CUDA GPU)         [ 30%]\n"
           "tests/integration/test_cuda.py::test_engine[deepspeed-zero3] PASSED          [ 40%]\n"
           "tests/integration/test_cuda.py::test_engine[fsdp] ERROR                      [ 50%]\n"
           "FAILED tests/integration/test_cuda.py::test_flex[sparse-2] - AssertionError\n"   # the summary's lines are not counted
           "!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!\n")
    assert gpu_check.pytest_counts(log) == {"passed": 2, "failed": 1, "skipped": 1, "error": 1, "xfailed": 0,
                                            "xpassed": 0}


def test_a_pytest_step_killed_at_its_limit_keeps_its_counts(gpu_check, tmp_path):
    """Two tests pass, the third outlives the step's 8 s limit: the step's line says timed out,
    not ok, and 2 passed (read from the per-test lines). The check runs with SIGINT ignored, as a
    shell's background job (`... &`) starts it: the limit's SIGINT still reaches pytest, which stops
    with its summary before the grace runs out (before: pytest inherited the ignored SIGINT and was
    killed KILL_GRACE_S later, without one)."""
    import signal

    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
                                           "def test_c():\n    time.sleep(120)\n")
    lines = []
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ok = gpu_check.run_step("cuda_tests", 8, "pytest", [str(tmp_path / "test_slow.py")], tmp_path, "cpu", None,
                                lines.append)
    finally:
        signal.signal(signal.SIGINT, before)
    assert not ok and len(lines) == 1
    rec = lines[0]
    assert rec["step"] == "cuda_tests" and rec["timed_out"] is True and rec["ok"] is False
    assert (rec["passed"], rec["failed"]) == (2, 0)
    assert 8 <= rec["seconds"] < 8 + gpu_check.KILL_GRACE_S
    assert "KeyboardInterrupt" in (tmp_path / "cuda_tests.log").read_text()  # pytest's own end, not SIGKILL


def test_a_part_keeps_each_steps_line_and_stops_at_its_limit(gpu_check, tmp_path, monkeypatch):
    """A part of three steps within 10 s: the first passes, the second hangs and is stopped when
    the part's time runs out, the third has no time left. The part's file holds every line as it
    came, then the summary naming the failed steps."""
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_bad.py").write_text("import time\n\ndef test_bad():\n    time.sleep(300)\n")
    monkeypatch.setitem(gpu_check.PARTS, 1, [
        ("first", 60, "pytest", [str(tmp_path / "test_ok.py")], None),
        ("second", 60, "pytest", [str(tmp_path / "test_bad.py")], None),
        ("third", 60, "pytest", [str(tmp_path / "test_ok.py")], None)])
    monkeypatch.setattr(gpu_check, "CPU_SLACK", 1.0)
    assert gpu_check.run_part(1, tmp_path / "out", device="cpu", part_limit=10) is False
    recs = [json.loads(x) for x in (tmp_path / "out" / "part1.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == ["first", "second", "third", "summary"]
    assert [r["ok"] for r in recs] == [True, False, False, False]
    assert recs[0]["passed"] == 1 and recs[1]["timed_out"] is True
    assert recs[2]["skipped"] is True and "no time left" in recs[2]["error"]
    assert recs[3]["failed_steps"] == ["second", "third"]


def test_step8b_frees_each_heads_memory_before_the_next_length_is_measured(gpu_check, tmp_path, monkeypatch):
    """step8b on CPU with a tiny target, two row lengths: when each length's measurement starts
    (`_free_for_measure`), the only head alive is the one about to train (the previous length's
    head, engine and optimizer are gone), and each length reports a line."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096).save_pretrained(str(tmp_path / "tiny"))
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "CONFIG", str(tmp_path / "tiny" / "config.json"))
    import peagle_train.jobs.builders as builders

    heads, alive_at_measure = [], []
    build = builders.build_draft

    def tracked_build(*a, **k):
        d = build(*a, **k)
        heads.append(weakref.ref(d))
        return d

    free = gpu_check._free_for_measure

    def checked_free():
        free()
        alive_at_measure.append(sum(h() is not None for h in heads))

    monkeypatch.setattr(builders, "build_draft", tracked_build)
    monkeypatch.setattr(gpu_check, "_free_for_measure", checked_free)
    torch.set_num_threads(1)
    lines = []
    monkeypatch.setattr(gpu_check, "emit", lambda step, **kw: lines.append({"step": step, **kw}))
    gpu_check.step8b([96, 128])
    assert [(r["step"], r["ok"], r["tokens"]) for r in lines] == [("step8b", True, 96), ("step8b", True, 128)], lines
    assert len(heads) == 3 and alive_at_measure == [1, 1]  # build_8b's head (its weights copied) and one per length
