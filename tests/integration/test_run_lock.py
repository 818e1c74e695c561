"""One run per output_dir (training/run_lock.py): the lock file of a live run refuses a second run in one
line naming it; a dead run's lock (this host: its pid gone or reused; another host: not refreshed for
STALE_AFTER_S) is taken over; in a multi-process run rank 0 decides for every process; and two real
`peagle train` runs on one output_dir: the second exits 2 naming the first, which finishes as if alone."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from peagle_train.errors import ConfigError
from peagle_train.training import run_lock
from peagle_train.training.run_lock import (LOCK_NAME, RunLock, check_not_locked, claim_output_dir, machine_identity,
                                           read_lock)

from ..conftest import REPO_ROOT
from .test_gpu_semantics import LAUNCH, tiny_recipe  # noqa: F401 - the fixture

# timed against timeouts, signals or step limits: alone under -n 2 (conftest.py)
pytestmark = pytest.mark.serial

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _proc_start(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])


def _write_lock(out, pid: int, token: str = "theirs", age_s: float = 0.0, **fields) -> dict:
    """A lock file of a run `pid` of this machine (unless `fields` say another host), `age_s` seconds old."""
    out.mkdir(parents=True, exist_ok=True)
    info = {"command": "peagle train", **machine_identity(), "pid": pid, "started": "2031-01-02T03:04:05+00:00",
            "token": token, **fields}
    path = out / LOCK_NAME
    path.write_text(json.dumps(info))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return info


@pytest.fixture
def sleeper():
    p = subprocess.Popen(SLEEPER)
    yield p
    p.kill()
    p.wait()


def test_a_live_run_on_this_host_refuses_in_one_line(tmp_path, sleeper):
    out = tmp_path / "run"
    _write_lock(out, sleeper.pid, pid_start=_proc_start(sleeper.pid), age_s=3000)  # old mtime: the pid decides here
    with pytest.raises(ConfigError) as e:
        RunLock(out).acquire()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"{out}: another run is using this output_dir (peagle train on host {machine_identity()['host']}, "
                   f"pid {sleeper.pid}, since 2031-01-02T03:04:05+00:00, "
                   f"refreshed {msg.split('refreshed ')[1].split()[0]} s ago). Fix: wait for it to finish, or "
                   f"choose another output_dir, or, if that run is dead, remove {out / LOCK_NAME}.")
    assert 2990 <= int(msg.split("refreshed ")[1].split()[0]) <= 3100
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written, the holder's file untouched
    assert read_lock(out / LOCK_NAME)[0]["token"] == "theirs"
    with pytest.raises(ConfigError, match=f"pid {sleeper.pid}, since"):  # a dry run takes no lock, but is refused
        check_not_locked(out)


def test_a_dead_or_reused_pid_on_this_host_is_taken_over(tmp_path, caplog):
    out = tmp_path / "run"
    dead = subprocess.Popen(SLEEPER)
    dead.kill()
    dead.wait()
    _write_lock(out, dead.pid)  # fresh mtime: on this host the pid decides
    with caplog.at_level(logging.WARNING, logger="peagle_train"):
        lock = RunLock(out).acquire()
    try:
        info = read_lock(out / LOCK_NAME)[0]
        assert info["pid"] == os.getpid() and info["token"] == lock.token and info["host"] == machine_identity()["host"]
        assert info["pid_start"] == _proc_start(os.getpid()) and info["started_unix"] <= time.time()
        assert "taking over the lock of a dead run" in caplog.text
        assert f"pid {dead.pid} is no longer running" in caplog.text
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # no aside copy or temporary left
    finally:
        lock.release()
    assert not (out / LOCK_NAME).exists()
    # a live pid that started at another time than the lock's holder: the holder's pid was reused
    _write_lock(out, os.getppid(), pid_start=_proc_start(os.getppid()) + 1)
    with RunLock(out).acquire() as again:
        assert read_lock(out / LOCK_NAME)[0]["token"] == again.token


def test_another_hosts_lock_is_stale_only_when_not_refreshed(tmp_path, caplog):
    out = tmp_path / "run"
    bound = run_lock.STALE_AFTER_S
    _write_lock(out, 1, host="gpu-node-7", run_id="job-42", age_s=bound - 60)  # pid 1 runs here: not looked at
    with pytest.raises(ConfigError) as e:
        RunLock(out).acquire()
    holder = "(peagle train on host gpu-node-7, pid 1, run id job-42, since 2031-01-02T03:04:05+00:00, refreshed"
    assert holder in str(e.value)
    assert read_lock(out / LOCK_NAME)[0]["token"] == "theirs"
    _write_lock(out, 1, host="gpu-node-7", age_s=bound + 60)
    with caplog.at_level(logging.WARNING, logger="peagle_train"):
        with RunLock(out).acquire() as lock:
            assert read_lock(out / LOCK_NAME)[0]["token"] == lock.token
    assert "written on gpu-node-7 and not refreshed for 11 min" in caplog.text
    assert not (out / LOCK_NAME).exists()
    # this host name after a reboot (another boot id): judged by its age as another machine's
    _write_lock(out, os.getpid(), boot_id="0000-before-reboot", age_s=60)
    with pytest.raises(ConfigError, match="another run is using this output_dir"):
        RunLock(out).acquire()


def test_the_holder_refreshes_its_lock_and_releases_only_its_own(tmp_path):
    out = tmp_path / "run"
    lock = RunLock(out, heartbeat_s=0.05).acquire()
    old = time.time() - 1000
    os.utime(out / LOCK_NAME, (old, old))
    deadline = time.time() + 10
    while (out / LOCK_NAME).stat().st_mtime < old + 500 and time.time() < deadline:
        time.sleep(0.05)
    assert (out / LOCK_NAME).stat().st_mtime > time.time() - 60  # the heartbeat
    _write_lock(out, 1, host="gpu-node-7")  # taken over by another run meanwhile (its lock was removed by hand)
    lock.release()
    assert read_lock(out / LOCK_NAME)[0]["token"] == "theirs"  # not removed: it is not this run's


def _claim(rank, world, store, busy, free, result_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    got = []
    for out in (free, busy):
        try:
            lock = claim_output_dir(out)
            got.append(f"held {os.getpid()}" if lock is not None else "none")
        except ConfigError as e:
            got.append(str(e))
    got.append(dist.is_initialized())  # a refusal destroys the process group (a clean exit 2 on every process)
    with open(f"{result_dir}/rank{rank}.json", "w") as f:
        json.dump(got, f)


def test_rank0_decides_for_every_process(tmp_path, sleeper):
    """2 gloo processes: on a free output_dir rank 0 holds the lock and rank 1 holds none (the lock is gone
    when rank 0 exits); with a live run's lock in output_dir both refuse with rank 0's line and leave
    the process group."""
    import torch.multiprocessing as mp

    busy, free = tmp_path / "busy", tmp_path / "free"
    _write_lock(busy, sleeper.pid)
    mp.spawn(_claim, args=(2, str(tmp_path / "store"), str(busy), str(free), str(tmp_path)), nprocs=2, join=True)
    (held, refused0, group0), (none, refused1, group1) = [json.loads((tmp_path / f"rank{r}.json").read_text())
                                                          for r in range(2)]
    assert refused0 == refused1 and group0 is group1 is False and refused0.startswith(f"{busy}: another run is using this output_dir (")
    assert f"pid {sleeper.pid}, since" in refused0
    assert held.startswith("held ") and none == "none"
    assert not (free / LOCK_NAME).exists()  # released when rank 0 exited (atexit)


def test_two_train_runs_on_one_output_dir(tiny_recipe, tmp_path):  # noqa: F811
    """`peagle train` holding output_dir in training (its third step waits on a hold file, checkpoints of
    step 2 written) and a resume of it started meanwhile: the second exits 2 with one line naming the
    first's pid, having written nothing; the first then finishes alone (steps 1-4, its checkpoints and
    summary.json, its own .hydra/, no lock or stray files). A run that fails after taking the lock
    releases it."""
    root, _ = tiny_recipe
    out, hold = root / "run", root / "hold"
    hold.write_text("")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PEAGLE_DATA_CACHE": str(root / "c")}
    env.pop("HYDRA_FULL_ERROR", None)
    args = [sys.executable, LAUNCH, "recipe=tiny", f"hydra.searchpath=[file://{root / 'conf'}]", f"output_dir={out}",
            "training.max_steps=4", "training.save_every=2", "eval.enabled=false", "export.enabled=false"]
    first = subprocess.Popen(args, cwd=root, env={**env, "PEAGLE_TEST_HOLD_FILE": str(hold)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while not (out / "checkpoints" / "step_000002").is_dir() and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert (out / "checkpoints" / "step_000002").is_dir() and first.poll() is None
        before = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.name != LOCK_NAME}
        second = subprocess.run([*args, "training.resume=true"], cwd=root, env=env, capture_output=True, text=True,
                                timeout=240)
        assert first.poll() is None  # still training while the second ran
        assert second.returncode == 2, (second.stdout + second.stderr)[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"gpu_semantics_launch.py: error: {out}: another run is "), lines
        assert f"pid {first.pid}, since " in lines[0] and "Fix: wait for it to finish" in lines[0]
        after = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.name != LOCK_NAME}
        assert after == before and (out / LOCK_NAME).is_file()  # the second wrote nothing (not even .hydra/)
    finally:
        hold.unlink()
    log, _ = first.communicate(timeout=240)
    assert first.returncode == 0, log[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        ".hydra", "checkpoint", "checkpoints", "config.yaml", "data", "run.json", "summary.json", "train.log",
        "train_log.jsonl"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["training"]["steps"] == 4
    assert "training.resume=true" not in (out / ".hydra" / "overrides.yaml").read_text()
    # a run that fails after taking the lock (a fresh run on checkpoints of another: refused by the trainer)
    # releases it on its way out
    third = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert third.returncode == 2 and "holds checkpoints of another run" in third.stderr, third.stderr[-3000:]
    assert not (out / LOCK_NAME).exists()
