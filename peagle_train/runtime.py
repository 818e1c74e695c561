"""The process runtime of every entry point: the wrapper that turns user errors into one line, and
Ctrl-C handling.

`cli_main` prints a user error (`errors.UserError`, an I/O failure, a YAML or Hydra config error;
see `user_error_message`) as one line (or a short block) on stderr and exits with status 2, without
a traceback; any other exception is an internal error and keeps its traceback. `PEAGLE_TRACEBACK=1`
(or Hydra's own `HYDRA_FULL_ERROR=1`) shows the traceback of a user error too. The wrapper adds how
to continue (`cli_main(resume=...)`: one of the `RESUME_*` lines). Ctrl-C prints one line
(`interrupted; ...`) and exits 130, without tracebacks from the main process or its worker
processes; a watchdog ends the process when unwinding hangs (`PEAGLE_INTERRUPT_GRACE_S`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys
from pathlib import Path

from .errors import UserError, WriteError, io_cause, io_failure


def exit_at_once(status: int):
    """End this process with `status` now: the atexit functions run, logging and the standard streams
    are flushed, then os._exit skips the interpreter's finalization. For a process that took part in a
    multi-process group: with the group destroyed but its gloo backend still referenced (FSDP2's
    device mesh holds it), the backend's worker threads can meet an interpreter being torn down and
    abort the process ("terminate called without an active exception", SIGABRT) after a run that
    succeeded. Never returns."""
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def usable_cores() -> list[int]:
    """The ids of the CPUs this process may run on, sorted: its affinity mask (taskset, a cgroup's
    cpuset, a test worker's core), which its children inherit; 0..os.cpu_count()-1 where the
    platform has no affinity call."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
RERUN = "run the same command again"
# how each command continues after Ctrl-C or a failed write (the end of its one line)
RESUME_TRAIN = "rerun with training.resume=true to continue from the last checkpoint (training.save_every)"
RESUME_PREPARE = "rerun the same command: the tables already tokenised are reused from data.cache_dir"
RESUME_FEATURES = "rerun the same command: it keeps the finished shards and continues"
RESUME_EVALUATE = "rerun the same command into the same output_dir: it continues from eval/results.jsonl"
RESUME_REGENERATE = "rerun the same command: it continues the output file"
_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"  # the user's own setting, before any wrapper ran


def user_error_message(e: BaseException, resume: str = RERUN) -> str | None:
    """The message to print for a user error, or None when `e` is an internal error.

    User errors: `UserError` subclasses; a missing file or one in the way (FileNotFoundError,
    FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError); an I/O failure of any
    library (`io_failure`: a full disk, a read-only file system, a file where a directory should be),
    which ends with `resume` (how to continue); a YAML file that does not parse (file, line, column);
    Hydra's and OmegaConf's errors while the config is composed (before the job starts).
    """
    if isinstance(e, WriteError) and e.then:
        return f"{e.args[0].rstrip('.')}, then {RERUN if e.err in _PLACE_ERRNOS else resume}."
    if isinstance(e, UserError):
        return str(e)
    if (yaml_msg := _yaml_error_message(e)) is not None:
        return yaml_msg
    if isinstance(e, OSError) and e.errno is None and isinstance(e, (FileNotFoundError, FileExistsError,
                                                                     NotADirectoryError, IsADirectoryError,
                                                                     PermissionError)):
        return str(e)  # raised by the project with its own message
    if isinstance(e, FileNotFoundError):
        return str(e)  # "[Errno 2] No such file or directory: '<path>'"
    found = io_failure(e)
    if found is not None:
        err, path = found
        path = path or getattr(e, "filename", None)
        cause, fix = io_cause(err, path)
        blocker = _file_in_the_way(path) if err in (errno.EEXIST, errno.ENOTDIR) and path else None
        if blocker is not None:
            cause = "is a file, not a directory" if blocker == Path(path) else f"{blocker} is a file, not a directory"
            fix = "remove that file or choose another output_dir"
        # a place that cannot be written is chosen anew: the run starts again; a full disk is resumed
        then = RERUN if err in _PLACE_ERRNOS else resume
        return f"{path or 'writing'}: {cause}. Fix: {fix}, then {then}."
    if _is_config_composition_error(e):
        cause = e.__cause__
        extra = f"\n  {cause}".replace("\n", "\n  ") if cause is not None and str(cause) not in str(e) else ""
        return f"config: {e}{extra}"
    return None


_PLACE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)


def _file_in_the_way(path) -> Path | None:
    """`path` or its nearest ancestor that exists, when that is not a directory (else None)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p if p.exists() and not p.is_dir() else None


def _yaml_error_message(e: BaseException) -> str | None:
    """"<file>, line L, column C: YAML syntax error (<problem>). Fix: ..." for a YAML parse error in
    `e`'s chain (a recipe or config file that does not parse), else None."""
    try:
        import yaml
    except ImportError:
        return None
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, yaml.MarkedYAMLError):
            mark = e.problem_mark or e.context_mark
            where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "a YAML file"
            problem = " ".join(x for x in (e.context, e.problem) if x)
            return f"{where}: YAML syntax error ({problem}). Fix: correct that line of the file."
        e = e.__cause__ or e.__context__
    return None


def _interrupted(e: BaseException) -> bool:
    """`e` is Ctrl-C, or was raised while Ctrl-C unwound (datasets' worker pool, a DataLoader)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__cause__ or e.__context__
    return False


_MAIN_PID = None
_RESUME = RERUN            # the resume text of the innermost wrapper that ran (the watchdog's line)
_REPORTED = False          # the interrupted line was written
_WATCHDOG = None
INTERRUPT_GRACE_S = float(os.environ.get("PEAGLE_INTERRUPT_GRACE_S", "20"))


def _on_sigint(signum, frame):
    """SIGINT in the process that entered the wrapper raises KeyboardInterrupt (as Python's own
    handler does) and arms `_exit_watchdog`; in a worker forked from it (datasets' map pool,
    DataLoader workers) it is ignored: the main process stops them, and they print no traceback of
    their own."""
    if os.getpid() == _MAIN_PID:
        _arm_exit_watchdog()
        raise KeyboardInterrupt


def _child_pids() -> list[int]:
    """Processes whose parent is this one (Linux /proc; empty elsewhere)."""
    me, out = os.getpid(), []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me:
            out.append(int(d.name))
    return out


def _arm_exit_watchdog() -> None:
    """After the first Ctrl-C, a daemon thread that ends the process when unwinding hangs (a worker
    pool whose teardown deadlocks when KeyboardInterrupt lands inside it): after INTERRUPT_GRACE_S
    seconds it kills this process's children, writes the interrupted line unless it was written,
    and exits 130 at once."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        return
    import threading
    import time

    def fire():
        time.sleep(INTERRUPT_GRACE_S)
        for pid in _child_pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not _REPORTED:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"\n{_prog()}: interrupted; {_RESUME}\n")
                sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    _WATCHDOG = threading.Thread(target=fire, name="peagle-interrupt-watchdog", daemon=True)
    _WATCHDOG.start()


def _install_sigint_handler() -> None:
    global _MAIN_PID
    if _MAIN_PID is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, _on_sigint)
        except ValueError:  # not the main thread
            return
        _MAIN_PID = os.getpid()


def _is_config_composition_error(e: BaseException) -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:
        return False
    # once the job runs, HydraConfig is set: an OmegaConf error there is a bug in the job, not the config
    return isinstance(e, (HydraException, OmegaConfBaseException)) and not HydraConfig.initialized()


def cli_main(fn=None, /, *, resume: str = RERUN, **hydra_main_kwargs):
    """The entry-point wrapper: a user error ends the process with one line and status 2.

    Two uses, one line each:

        @cli_main(config_path="../conf", config_name="train", version_base="1.3")   # = @hydra.main(...)
        def main(cfg): ...

        cli_main(convert_features)(src, dst, storage)                              # any callable

    Outside Hydra (the second use) the messages of `fn` are logged to the console (`logs.setup_logging`);
    under Hydra, Hydra's job logging sends them to the console and output_dir/<job>.log.
    A user error (see `user_error_message`) is printed as `<program>: error: <message>` on stderr
    and the process exits with status 2, without a traceback; `raise SystemExit("text")` inside a
    main is a user error too. Internal errors propagate with their traceback. Under Hydra the job's
    errors are caught inside the task function (before Hydra prints "Error executing job" with a
    traceback), and a config that cannot be composed (a value of the wrong type, a bad override) is
    reported the same way: HYDRA_FULL_ERROR=1 is set while the app runs so that Hydra passes the
    exception on instead of printing it. Hydra's own start-up (creating output_dir, its log files)
    runs inside the wrapper too. `resume`: how to continue after an I/O failure or Ctrl-C (default
    "run the same command again"); Ctrl-C prints `<program>: interrupted; <resume>` and exits 130.
    """
    if fn is not None:
        return _guarded(fn, console=True, resume=resume)

    def decorate(task):
        import hydra

        return _guarded(hydra.main(**hydra_main_kwargs)(_guarded(task, job=True, resume=resume)), resume=resume)

    return decorate


def guarded(fn, resume: str = RERUN):
    """`fn` under the wrapper's error handling (user errors, I/O failures, Ctrl-C: one line), without
    setting up logging: for the work an entry point does before Hydra starts (command-line checks,
    reading recipes)."""
    return _guarded(fn, resume=resume)


def _in_multirun_job() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _guarded(fn, job: bool = False, console: bool = False, resume: str = RERUN):
    """fn with user errors reported (see cli_main). job: fn is a Hydra task function; in a -m sweep
    its user error is passed on so that Hydra runs the other jobs before reporting the failure.
    console: fn runs outside Hydra, so its log messages get a console handler (`logs.setup_logging`).
    resume: how to continue, ending the message of an I/O failure or Ctrl-C."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _RESUME
        if console:
            from .logs import setup_logging

            setup_logging()
        _install_sigint_handler()
        _RESUME = resume
        show_tb = os.environ.get("PEAGLE_TRACEBACK") == "1" or _USER_FULL_ERROR
        old = os.environ.get("HYDRA_FULL_ERROR")
        os.environ["HYDRA_FULL_ERROR"] = "1"
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if isinstance(e.code, str):
                _exit_user_error(e.code)
            raise
        except BaseException as e:  # noqa: BLE001 - sorted into Ctrl-C, user errors and internal ones below
            if _interrupted(e) and not show_tb:
                _exit_interrupted(resume)
            if not isinstance(e, Exception):
                raise
            msg = user_error_message(e, resume)
            if msg is None or show_tb or (job and _in_multirun_job()):
                raise
            if getattr(e, "exit_status", None):  # stopped on purpose (training/preemption.py): its own status
                _exit_stopped(msg, e.exit_status)
            _exit_user_error(msg)
        finally:
            if old is None:
                os.environ.pop("HYDRA_FULL_ERROR", None)
            else:
                os.environ["HYDRA_FULL_ERROR"] = old

    return wrapper


def _prog() -> str:
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "peagle"


def _exit_user_error(msg: str) -> None:
    sys.stderr.write(f"{_prog()}: error: {msg}\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_USER_ERROR)


def _exit_stopped(msg: str, status: int) -> None:
    sys.stderr.write(f"{_prog()}: {msg}\n")
    sys.stderr.flush()
    raise SystemExit(status)


def _exit_interrupted(resume: str) -> None:
    global _REPORTED
    with contextlib.suppress(Exception):  # a progress bar's line is ended first
        sys.stderr.write("\n")
    sys.stderr.write(f"{_prog()}: interrupted; {resume}\n")
    sys.stderr.flush()
    _REPORTED = True
    raise SystemExit(EXIT_INTERRUPTED)
