"""Preemption and lost peers of a multi-process run (training/preemption.py), with 2 real processes
of the real `peagle train` over gloo: SIGTERM to the launcher alone (Kubernetes, SageMaker) or to
the workers (Slurm) stops every rank after the same step, writes that step's checkpoint, and every
rank says so in one line with exit status 143; the run then resumes from it. The signal-to-exit time
is bounded. A rank killed mid-run leaves the other with one line naming the loss, the newest
checkpoint and the resume, and no traceback of ours."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ..conftest import REPO_ROOT
from .test_engines import _free_port
from .test_gpu_semantics import CPU_ONLY, LAUNCH, _launch, tiny_recipe  # noqa: F401 - tiny_recipe is a fixture
from .test_io_faults import AS_FOREGROUND

# timed against timeouts, signals or step limits: alone under -n 2 (conftest.py)
pytestmark = pytest.mark.serial

STOP_BOUND_S = 30  # signal to the last process's exit: the step in progress, one checkpoint, the exit


def _start(recipe, out, *overrides):
    root, cmd = recipe
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PEAGLE_DATA_CACHE": str(root / "c"),
           "PEAGLE_TEST_STEP_SLEEP_S": "0.3", **CPU_ONLY}
    env.pop("HYDRA_FULL_ERROR", None)
    log = open(root / f"{out.name}.log", "w")
    p = subprocess.Popen([*cmd, "--main_process_port", _free_port(), LAUNCH, "recipe=tiny",
                          f"hydra.searchpath=[file://{root / 'conf'}]", f"output_dir={out}", *overrides],
                         cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return p, root / f"{out.name}.log"


def _steps_logged(out) -> int:
    f = out / "train_log.jsonl"
    return sum(1 for x in f.read_text().splitlines() if '"loss"' in x) if f.is_file() else 0


@pytest.mark.parametrize("to", ["launcher", "workers", "ctrl-c"])
def test_sigterm_stops_every_rank_after_one_step_with_its_checkpoint(tiny_recipe, to):  # noqa: F811
    """SIGTERM to the launcher alone, or to each worker, or Ctrl-C (SIGINT to the whole process group,
    as a terminal sends it; the launcher passes it on again within the same second): both ranks stop
    after the same step, its checkpoint is complete, each says so in one line, all within the bound."""
    out = tiny_recipe[0] / f"preempt-{to}"
    settings = ("training.epochs=20", "training.max_steps=30", "training.save_every=null", "eval.enabled=false",
                "export.enabled=false")
    p, log_path = _start(tiny_recipe, out, *settings)
    try:
        deadline = time.monotonic() + 180
        while _steps_logged(out) < 3:
            assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        t0 = time.monotonic()
        if to == "launcher":
            os.kill(p.pid, signal.SIGTERM)
        elif to == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
        else:
            workers = [c for c in psutil.Process(p.pid).children(recursive=True) if "gpu_semantics_launch" in " ".join(c.cmdline())]
            assert len(workers) == 2, workers
            for w in workers:
                os.kill(w.pid, signal.SIGTERM)
        p.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log_path.read_text()
    steps = _steps_logged(out)
    name = "SIGINT" if to == "ctrl-c" else "SIGTERM"
    lines = re.findall(rf"stopped by {name} after step (\d+) of \d+: checkpoint (\S+) written\. Fix: resume with "
                       r"training\.resume=true", text)
    assert len(lines) == 2 and {int(n) for n, _ in lines} == {steps}, text[-3000:]  # one line from each rank
    ckpt = out / "checkpoints" / f"step_{steps:06d}"
    assert lines[0][1] == str(ckpt) and (ckpt / "model.safetensors").is_file() and (ckpt / "state.pt").is_file()
    assert {f.name for f in ckpt.glob("rng_rank*.pt")} == {"rng_rank0.pt", "rng_rank1.pt"}
    assert p.returncode != 0 and took < STOP_BOUND_S, (p.returncode, took)
    if to == "workers":  # the workers' status, as the launcher reports it (signalled itself, it says nothing)
        assert re.search(r"exitcode\s*:\s*143", text), text[-2000:]
    assert "Traceback" not in text.split("stopped by")[0], text[-3000:]  # nothing before the lines
    if to != "launcher":
        return
    # the same command with training.resume=true continues from that checkpoint to the end
    r = _launch(tiny_recipe, out, {"PEAGLE_TEST_STEP_SLEEP_S": "0"}, *settings, "training.resume=true")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert json.loads((out / "summary.json").read_text())["training"]["steps"] == 30 > steps
    assert f"resuming from {ckpt}" in r.stdout + r.stderr


def _worker(launcher: int, rank: int):
    for c in psutil.Process(launcher).children(recursive=True):
        if "gpu_semantics_launch" in " ".join(c.cmdline()) and c.environ().get("RANK") == str(rank):
            return c
    raise AssertionError(f"no worker of rank {rank}")


def test_a_killed_rank_leaves_the_other_with_one_line(tiny_recipe):  # noqa: F811
    """Rank 1 SIGKILLed after its 3rd step, checkpoints every 2 steps: rank 0's collective fails and
    it ends with one line naming the loss, the newest checkpoint and training.resume=true, and
    prints no traceback from peagle_train (the launcher's own summary follows)."""
    out = tiny_recipe[0] / "lost-peer"
    p, log_path = _start(tiny_recipe, out, "training.epochs=20", "training.max_steps=30", "training.save_every=2",
                         "eval.enabled=false", "export.enabled=false")
    try:
        deadline = time.monotonic() + 180
        while _steps_logged(out) < 3:
            assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(_worker(p.pid, 1).pid, signal.SIGKILL)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log_path.read_text()
    lines = re.findall(r"process 0 of 2: another process of the run was lost during step (\d+) at [0-9: -]+ \((.+?)\); "
                       r"the newest complete checkpoint is (\S+)\. Fix: read the first error line of the other "
                       r"processes \(the launcher's summary names the first that failed\), then resume with "
                       r"training\.resume=true \(the same command\)\.", text)
    assert len(lines) == 1, text[-3000:]
    step, cause, ckpt = lines[0]
    assert int(step) >= 3 and ckpt == str(sorted((out / "checkpoints").glob("step_*"))[-1])
    assert not re.search(r'File ".*peagle_train/', text), text[-3000:]  # no traceback through our code


# Run in a child set up as a terminal's foreground job (SIGINT unblocked, Python's handler): the test
# process itself may have inherited SIGINT ignored or blocked, or a library may have put SIG_DFL
# under Python's view of the handler, where a SIGINT to itself would end the whole test run.
SECOND_CTRL_C_APP = textwrap.dedent(AS_FOREGROUND + """
    import os, time
    from peagle_train.training.preemption import REPEAT_WINDOW_S, StopSignals
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the same keypress, relayed
        time.sleep(0.05)
        print("after two:", signal.Signals(stop.requested).name, flush=True)
        time.sleep(REPEAT_WINDOW_S + 0.1)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
            print("third: no KeyboardInterrupt", flush=True)
        except KeyboardInterrupt:
            print("third: KeyboardInterrupt", flush=True)
    print("restored:", signal.getsignal(signal.SIGINT) is before, flush=True)
    with StopSignals() as stop:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        print("sigterm:", signal.Signals(stop.requested).name, flush=True)
    print("restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
""")


def test_a_second_ctrl_c_stops_at_once():
    """In one process: the first SIGINT is recorded, a repeat within REPEAT_WINDOW_S (the launcher
    passing the same keypress on) is ignored, one after it raises KeyboardInterrupt; SIGTERM is
    recorded once and never escalates; the handlers are restored on leaving."""
    p = subprocess.run([sys.executable, "-c", SECOND_CTRL_C_APP], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["after two: SIGINT", "third: KeyboardInterrupt", "restored: True",
                                     "sigterm: SIGTERM", "restored: True"], p.stdout + p.stderr[-3000:]


def test_a_frozen_rank_past_the_timeout_leaves_the_other_with_one_line(tiny_recipe):  # noqa: F811
    """Rank 1 frozen (SIGSTOP) after its 3rd step, a 12 s process-group timeout: rank 0's collective
    times out and it ends with the one line; rank 1, let go again, ends with it too (its peer is
    gone), neither with a traceback through our code."""
    out = tiny_recipe[0] / "frozen-peer"
    p, log_path = _start(tiny_recipe, out, "training.epochs=20", "training.max_steps=30", "training.save_every=2",
                         "eval.enabled=false", "export.enabled=false", "distributed.timeout_minutes=0.2")
    try:
        deadline = time.monotonic() + 180
        while _steps_logged(out) < 3:
            assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        frozen = _worker(p.pid, 1)
        frozen.suspend()
        while "process 0 of 2: another process" not in log_path.read_text():
            assert p.poll() is None and time.monotonic() < deadline + 60, log_path.read_text()[-3000:]
            time.sleep(0.5)
        frozen.resume()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log_path.read_text()
    causes = dict(re.findall(r"process (\d) of 2: another process of the run was lost during step \d+ at [0-9: -]+ "
                             r"\((.+?)\); the newest complete checkpoint is ", text))
    assert "Timed out" in causes.get("0", ""), text[-3000:]
    assert not re.search(r'File ".*peagle_train/', text), text[-3000:]


def test_a_full_disk_on_rank_0_during_a_save_gives_each_process_one_line(tiny_recipe):  # noqa: F811
    """Rank 0's first checkpoint (step 2) fails on a full disk: rank 0 says which save failed and how
    to resume, rank 1 (waiting for it) that its peer was lost; no traceback through our code."""
    out = tiny_recipe[0] / "full-disk"
    p = _launch(tiny_recipe, out, {"PEAGLE_TEST_RANK0_FULL_DISK": "1"}, "training.max_steps=6", "training.save_every=2",
                "eval.enabled=false", "export.enabled=false")
    text = p.stdout + p.stderr
    ckpt = out / "checkpoints" / "step_000002"
    assert p.returncode != 0
    assert (f"gpu_semantics_launch.py: error: saving checkpoint {ckpt} failed (No space left on device); no earlier "
            f"checkpoint exists. Fix: free disk space in {out / 'checkpoints'} (or lower training.keep_last) and resume "
            "with training.resume=true.") in text, text[-3000:]
    assert re.search(r"process 1 of 2: another process of the run was lost during step 2 at [0-9: -]+ \(.+?\); no "
                     r"checkpoint was written yet\. Fix: ", text), text[-3000:]
    assert not re.search(r'File ".*peagle_train/', text), text[-3000:]
