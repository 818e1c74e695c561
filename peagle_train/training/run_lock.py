"""One run per output_dir: the lock file `output_dir/.peagle_run.lock` that `peagle train` holds while it runs.

Two runs writing one output_dir (started at once, or a resume started while the first still trains)
rename checkpoints over each other and leave a folder that neither run alone would. The main process
(rank 0) of a run creates the lock file before the run writes anything, holds it to the end (released
in a `finally`: also on an error or Ctrl-C) and refreshes its mtime every `HEARTBEAT_S` seconds from a
daemon thread (data preparation, steps, evaluation and export alike). A second run finds the file and
stops with one line naming the holder (host, pid, since when) and the fix.

The file is a small JSON object: command, host, pid, started (ISO 8601, local time with its offset),
started_unix, launcher_pid (the parent process: `accelerate launch`'s agent), run_id (the launcher's
TORCHELASTIC_RUN_ID, when set), boot_id and pid_ns (which machine and PID namespace the pid belongs to),
pid_start (the holder's start time in clock ticks since boot, Linux /proc: tells a reused pid apart)
and token (random: whose lock it is). It appears complete or not at all: written to a temporary
sibling and hard-linked to its name (`os.link` fails when the name exists, atomically also on NFS);
where the file system has no hard links, created with O_CREAT|O_EXCL. Not an OS lock (flock): that
does not hold on some network file systems and does not say who holds it.

A lock is stale (its run is dead) when
- it was written on this machine (same host name, boot id and PID namespace) and its pid is no longer
  running (or is a zombie, or a process started at another time: the pid was reused); or
- it was written on another machine (or on this one before a reboot) and its mtime is older than
  `STALE_AFTER_S` (ten missed heartbeats: room for clock skew between the hosts and the file server);
- it cannot be read (a kill during its creation) and is older than `STALE_AFTER_S`.
A stale lock is logged and taken over: renamed aside (of two runs taking it over at once, one wins),
then created anew.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from ..errors import ConfigError, writing

logger = logging.getLogger(__name__)

LOCK_NAME = ".peagle_run.lock"
HEARTBEAT_S = 60.0      # the holder refreshes the lock's mtime this often (seconds)
STALE_AFTER_S = 600.0   # a lock of another machine not refreshed for this long is a dead run's (seconds)
_HELD: dict[str, "RunLock"] = {}  # resolved output_dir → the lock this process holds there


def _read_line(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def machine_identity() -> dict:
    """{"host", "boot_id", "pid_ns"}: which machine (and PID namespace) a pid of this process belongs to;
    boot_id / pid_ns None where /proc does not give them."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot_id": _read_line("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns}


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of `pid` from /proc; None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_running(pid: int, started: int | None = None) -> bool:
    """`pid` names a live process of this machine (not a zombie) that, when `started` (clock ticks since
    boot, /proc/<pid>/stat) is given and readable, started then: a pid reused by a later process is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: it runs, under another user
    stat = _proc_stat(pid)
    if stat is None:
        return True
    return stat[0] != "Z" and (started is None or stat[1] == started)


def same_machine(info: dict, me: dict) -> bool:
    """The lock `info` was written on this machine, in this PID namespace, since its last boot."""
    return all(info.get(k) == me.get(k) for k in ("host", "boot_id", "pid_ns"))


def read_lock(path: str | Path) -> tuple[dict | None, float | None]:
    """(the lock's record or None when it cannot be read as one, its mtime) of the lock file `path`;
    (None, None) when there is none."""
    path = Path(path)
    try:
        mtime = path.stat().st_mtime
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None, mtime
    ok = isinstance(info, dict) and isinstance(info.get("pid"), int) and isinstance(info.get("host"), str)
    return (info if ok else None), mtime


def stale_reason(info: dict | None, mtime: float, now: float | None = None, me: dict | None = None,
                 stale_after_s: float = STALE_AFTER_S) -> str | None:
    """Why the lock (`info` as `read_lock` returns it, `mtime` in seconds since the epoch) belongs to a
    dead run, or None when its run may be alive (see the module docstring for the rules)."""
    now = time.time() if now is None else now
    me = machine_identity() if me is None else me
    age = now - mtime
    if info is None:
        return f"unreadable and not refreshed for {age:.0f} s" if age > stale_after_s else None
    if same_machine(info, me):
        if not pid_running(info["pid"], info.get("pid_start")):
            return f"pid {info['pid']} is no longer running on {me['host']}"
        return None
    if age > stale_after_s:
        return (f"written on {info['host']}{'' if info['host'] != me['host'] else ' before a reboot'} and not "
                f"refreshed for {age / 60:.0f} min (a live run refreshes it every {HEARTBEAT_S:.0f} s; stale after "
                f"{stale_after_s / 60:g} min)")
    return None


def describe_holder(info: dict | None, mtime: float, now: float | None = None) -> str:
    """"host H, pid P, since <started>, refreshed N s ago" of a lock (what the refusal names)."""
    age = (time.time() if now is None else now) - mtime
    if info is None:
        return f"a lock file being written or damaged, refreshed {age:.0f} s ago"
    run = f", run id {info['run_id']}" if info.get("run_id") else ""
    return (f"{info.get('command', 'peagle train')} on host {info['host']}, pid {info['pid']}{run}, "
            f"since {info.get('started', '?')}, refreshed {age:.0f} s ago")


def refusal(out_dir: str | Path, info: dict | None, mtime: float) -> str:
    """The one line that refuses a run on `out_dir`, held by the lock `info` (mtime `mtime`)."""
    return (f"{out_dir}: another run is using this output_dir ({describe_holder(info, mtime)}). Fix: wait for it to "
            f"finish, or choose another output_dir, or, if that run is dead, remove {Path(out_dir) / LOCK_NAME}.")


def check_not_locked(out_dir: str | Path) -> None:
    """Raise ConfigError (`refusal`) when a live run other than this process holds `out_dir`: for the
    runs that write into an output_dir without taking its lock (`dry_run=true`)."""
    info, mtime = read_lock(Path(out_dir) / LOCK_NAME)
    if mtime is not None and held_lock(out_dir) is None and stale_reason(info, mtime) is None:
        raise ConfigError(refusal(out_dir, info, mtime))


class RunLock:
    """The lock of one run on `out_dir` (see the module docstring). `acquire()` takes it or raises;
    `release()` removes it when it is still this run's; also a context manager (`with RunLock(...).acquire():`).

    command: what the lock names as its holder ("peagle train"); heartbeat_s: how often its mtime is
    refreshed (seconds); stale_after_s: the bound for another machine's lock (seconds)."""

    def __init__(self, out_dir: str | Path, command: str = "peagle train", heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self.command, self.heartbeat_s, self.stale_after_s = command, heartbeat_s, stale_after_s
        self.pid, self.token = os.getpid(), secrets.token_hex(8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self) -> dict:
        """The lock file's content for this process (the fields of the module docstring)."""
        now = datetime.datetime.now().astimezone()
        stat = _proc_stat(self.pid)
        return {"command": self.command, **machine_identity(), "pid": self.pid,
                "pid_start": stat[1] if stat else None,
                "started": now.isoformat(timespec="seconds"), "started_unix": now.timestamp(),
                "launcher_pid": os.getppid(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "token": self.token}

    def acquire(self) -> "RunLock":
        """Create the lock file, taking over a stale one (logged as a warning); start the heartbeat.
        Returns self. Raises ConfigError in one line naming the run that holds `out_dir` (host, pid,
        since when) and the fix; WriteError when `out_dir` cannot be written."""
        with writing(self.path, "run lock file"):
            self.out_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.record(), indent=1)
        for _ in range(5):  # a lock removed or taken over between the reads is looked at again
            if self._create(text):
                self._start_heartbeat()
                _HELD[str(self.out_dir.resolve())] = self
                return self
            info, mtime = read_lock(self.path)
            if mtime is None:
                continue
            reason = stale_reason(info, mtime, stale_after_s=self.stale_after_s)
            if reason is None:
                raise ConfigError(refusal(self.out_dir, info, mtime))
            logger.warning("%s: taking over the lock of a dead run (%s): %s", self.path,
                           describe_holder(info, mtime), reason)
            self._take_aside(info)
        raise ConfigError(f"{self.path}: could not take the run lock (other runs keep creating it). "
                          "Fix: start one run at a time on this output_dir.")

    def _create(self, text: str) -> bool:
        """The lock file written complete under its name unless a file of that name exists (False)."""
        tmp = self.path.with_name(f"{LOCK_NAME}.tmp-{self.pid}-{self.token}")
        with writing(self.path, "run lock file"):
            try:
                tmp.write_text(text, encoding="utf-8")
                try:
                    os.link(tmp, self.path)
                    return True
                except FileExistsError:
                    return False
                except OSError as e:  # no hard links on this file system: an exclusive create
                    if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                        raise
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                return True
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def _take_aside(self, stale: dict | None) -> None:
        """Move the stale lock `stale` out of the way; a lock that replaced it meanwhile is put back."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{self.pid}-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved, _ = read_lock(aside)
        if (moved or {}).get("token") != (stale or {}).get("token"):  # another run's fresh lock: restored
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        with contextlib.suppress(OSError):
            aside.unlink()

    def holds(self) -> bool:
        """The lock file is still this run's (not removed, not taken over)."""
        return (read_lock(self.path)[0] or {}).get("token") == self.token

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="peagle-run-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self.holds():
                info, mtime = read_lock(self.path)
                holder = describe_holder(info, mtime) if mtime is not None else "removed"
                logger.error("%s: this run's lock was removed or taken over (%s): another run may now write into %s",
                             self.path, holder, self.out_dir)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file when it is still this run's. A no-op in a process
        forked from the holder (datasets' and DataLoader's workers)."""
        if os.getpid() != self.pid:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.holds():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        with contextlib.suppress(OSError):
            if _HELD.get(str(self.out_dir.resolve())) is self:
                del _HELD[str(self.out_dir.resolve())]

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def held_lock(out_dir: str | Path) -> RunLock | None:
    """The lock this process holds on `out_dir` (taken earlier, e.g. by `ClaimOutputDir` before Hydra
    wrote anything), or None."""
    lock = _HELD.get(str(Path(out_dir).resolve()))
    return lock if lock is not None and lock.pid == os.getpid() else None


def release_lock(out_dir: str | Path) -> None:
    """Release the lock this process holds on `out_dir` (`held_lock`), if any."""
    lock = held_lock(out_dir)
    if lock is not None:
        lock.release()


def claim_output_dir(out_dir: str | Path, command: str = "peagle train") -> RunLock | None:
    """Make this run the only one on `out_dir`: the main process (rank 0) takes the lock (or keeps the
    one it holds there already, `held_lock`); under a process group of more than one process its
    decision is broadcast (a collective: every process calls this), so a refused run stops on every
    process with the same one line (the process group destroyed first, so that each exits 2). Returns the lock on rank 0 (release it at the end, in a `finally`),
    None on the other processes. Raises ConfigError naming the run that holds `out_dir` and the fix
    (`RunLock.acquire`); on the other processes a ConfigError with rank 0's message when rank 0 failed."""
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if group and dist.get_rank() != 0:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            dist.destroy_process_group()  # a process exiting with a live gloo group can abort ("terminate called")
            raise ConfigError(box[0])
        return None
    lock, failure = held_lock(out_dir), None
    try:
        if lock is None:
            lock = RunLock(out_dir, command).acquire()
    except Exception as e:  # noqa: BLE001 - told to the other processes, then raised here unchanged
        failure = e
    if group:
        dist.broadcast_object_list([None if failure is None else str(failure)], src=0)
        if failure is not None:
            dist.destroy_process_group()
    if failure is not None:
        raise failure
    return lock


def _release_all() -> None:
    for lock in list(_HELD.values()):
        with contextlib.suppress(Exception):
            lock.release()


atexit.register(_release_all)  # a lock taken before the job's `finally` could release it (Hydra failing in between)


try:
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # pragma: no cover - hydra is a dependency
    _Callback = object


_CLAIM_AT_RUN_START: str | None = None  # the command whose Hydra runs take the lock at run start (`claim_at_run_start`)


def claim_at_run_start(command: str) -> None:
    """Arm `ClaimOutputDir` for `command` (called by its entry point before Hydra starts: `peagle prepare`
    and `peagle features` share the config of `peagle train` but take no lock)."""
    global _CLAIM_AT_RUN_START
    _CLAIM_AT_RUN_START = command


class ClaimOutputDir(_Callback):
    """Hydra callback (conf/train.yaml), armed by `claim_at_run_start` (`peagle train`): a single-process
    run that is not a dry run takes the lock on `hydra.run.dir` (= output_dir) when the run starts, before
    Hydra writes .hydra/ and opens train.log there; the job (cli/train.py `claim_output_dir`) finds it held
    and keeps it. A refusal is raised as SystemExit(message) (Hydra turns a callback's exceptions into
    warnings; the entry-point wrapper prints the message as one line and exits 2). Multi-process runs
    and -m sweep jobs take the lock in the job, after the process group exists (Hydra has then written
    .hydra/ into output_dir: each process of a refused multi-process run rewrites it)."""

    def on_run_start(self, config, **kwargs) -> None:
        if _CLAIM_AT_RUN_START is None or config.get("dry_run") or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            return
        try:
            out = str(config.hydra.run.dir)
        except Exception:  # noqa: BLE001 - an output_dir resolved only inside the job: the job takes the lock
            return
        try:
            RunLock(out, _CLAIM_AT_RUN_START).acquire()
        except ConfigError as e:
            raise SystemExit(str(e)) from e
