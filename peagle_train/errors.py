"""User errors and the one wrapper every entry point runs under.

A user error is something the person running a command can fix: bad data, a bad setting, a missing
or damaged file, a head made for another target. Its class derives from `UserError` (and keeps its
ValueError/OSError ancestry), and its message names what is wrong, where (file, record, setting)
and the fix. `cli_main` prints such an error as one line (or a short block) on stderr and exits
with status 2, without a traceback; any other exception is an internal error and keeps its
traceback. `PEAGLE_TRACEBACK=1` (or Hydra's own `HYDRA_FULL_ERROR=1`) shows the traceback of a
user error too.

An I/O failure is a user error whatever library raises it: an OSError, safetensors' SafetensorError
("I/O error: No space left on device (os error 28)"), torch's RuntimeError from `torch.save`
("[enforce fail at inline_container.cc] ... file write failed"), found also through `__cause__` /
`__context__`. `io_failure` recognises them; `writing(path, what)` turns one into a `WriteError`
naming the path, the cause (no space left, read-only, permission denied, is a file) and the fix.
The wrapper adds how to continue (`cli_main(resume=...)`). Ctrl-C prints one line (`interrupted;
...`) and exits 130, without tracebacks from the main process or its worker processes.

`load_safetensors` and `read_json` read the files a command is handed (checkpoints, exports,
state files) and turn a cut-off or corrupted file into a `CorruptFileError` naming it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

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


class UserError(Exception):
    """An error the user can fix; the message names what, where and the fix. Exit status 2."""


class ConfigError(UserError, ValueError):
    """A setting that is missing, out of range or inconsistent with another (names the key)."""


class CorruptFileError(UserError, ValueError):
    """A file that exists but cannot be read as what it should be (cut off, altered, missing a key)."""


class WriteError(UserError, OSError):
    """Writing a file failed for a reason outside the program (full disk, read-only, permission):
    the message names the path, the cause and the fix; `err` is the cause's errno (None if unknown).
    `then`: the entry-point wrapper appends how to continue (False: the message already says it)."""

    def __init__(self, message: str, err: int | None = None, then: bool = True, path: str | None = None):
        super().__init__(message)
        self.err, self.then, self.path = err, then, path  # then: the wrapper ends the message with how to continue

    def __str__(self) -> str:
        return self.args[0]


# errno → (the cause in words, the fix)
_IO_CAUSES = {
    errno.ENOSPC: ("no space left on the device", "free disk space (or choose another output_dir)"),
    errno.EDQUOT: ("disk quota exceeded", "free disk space (or choose another output_dir)"),
    errno.EFBIG: ("file too large for the file system", "choose an output_dir on another file system"),
    errno.EROFS: ("read-only file system", "choose a writable output_dir"),
    errno.EACCES: ("permission denied", "choose a directory you can write to (or fix its permissions)"),
    errno.EPERM: ("operation not permitted", "choose a directory you can write to (or fix its permissions)"),
    errno.EEXIST: ("already exists", "remove it or choose another output_dir"),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", "remove that file or choose another output_dir"),
    errno.EISDIR: ("is a directory", "point at a file, or remove that directory"),
    errno.EIO: ("input/output error (a failing disk or network file system?)", "check the disk, then retry"),
}
_STRERROR = {os.strerror(n).lower(): n for n in _IO_CAUSES}
# the writers of torch.save (caffe2's PyTorchStreamWriter) and safetensors (Rust std::io) put the
# OS error in the message only
_TORCH_WRITE = ("inline_container.cc", "PytorchStreamWriter failed", "file write failed", "iostream error")


def io_failure(e: BaseException) -> tuple[int | None, str | None] | None:
    """(errno or None, path or None) when `e` is an I/O failure outside the program, else None.

    Recognised along `e` and its explicit `__cause__`s, and along `__context__` through OSError,
    RuntimeError and safetensors' errors only (a bug raised while handling one is not taken for it): an
    OSError with one of the errnos of a full disk, a read-only or forbidden place or a file in the
    way; safetensors' "I/O error: ... (os error N)"; torch.save's "[enforce fail at
    inline_container.cc] ..." / "file write failed" (errno from its "strerror: ..." when given).
    """
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        library = isinstance(e, (OSError, RuntimeError)) or type(e).__name__ == "SafetensorError"
        if isinstance(e, WriteError):  # named by an inner writer (one file of a directory being written)
            return e.err, e.path
        if isinstance(e, OSError) and not isinstance(e, UserError):
            if e.errno in _IO_CAUSES:
                return e.errno, e.filename
        elif library:
            text = str(e)
            m = re.search(r"\(os error (\d+)\)", text)
            if m and (type(e).__name__ == "SafetensorError" or "I/O error" in text):
                path = re.search(r'at path "([^"]+)"', text)
                return int(m.group(1)), path.group(1) if path else None
            if isinstance(e, RuntimeError) and any(t in text for t in _TORCH_WRITE) and "Reader" not in text:
                m = re.search(r"strerror: ([^\n.]+)", text)
                return (_STRERROR.get(m.group(1).strip().lower()) if m else None), None
        # an explicit `raise X from cause` (logging's "Unable to configure handler" for a log file that
        # cannot be opened) is followed whatever X is; an implicit context only through library errors
        e = e.__cause__ if e.__cause__ is not None or not library else e.__context__
    return None


def io_cause(err: int | None, path: str | Path | None = None) -> tuple[str, str]:
    """(cause in words, fix) for errno `err`; for an unknown one (torch's "unexpected pos"), the free
    space where `path` lies decides between a full disk and a plain write failure."""
    if err in _IO_CAUSES:
        return _IO_CAUSES[err]
    free = free_bytes(path) if path is not None else None
    if free is not None and free < (1 << 20):
        return f"no space left on the device ({free} bytes free)", _IO_CAUSES[errno.ENOSPC][1]
    return "the write failed", "check the disk (space, permissions), then retry"


def free_bytes(path: str | Path) -> int | None:
    """Free bytes of the file system holding `path` (or its nearest existing parent); None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


@contextlib.contextmanager
def writing(path: str | Path, what: str, note: str = "", fix: str = ""):
    """Turn an I/O failure (see `io_failure`) inside the block into a `WriteError`:
    "<path>: cannot write the <what> (<cause>)[; <note>]. Fix: <fix or the cause's fix>."
    Other exceptions pass unchanged."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only I/O failures are translated, the rest is re-raised
        found = io_failure(e)
        if found is None:
            raise
        cause, default_fix = io_cause(found[0], path)
        raise WriteError(f"{path}: cannot write the {what} ({cause}){'; ' + note if note else ''}. "
                         f"Fix: {fix or default_fix}.", found[0], path=str(path)) from e


def load_safetensors(path: str | Path, what: str = "weights", fix: str = "") -> dict:
    """`safetensors.torch.load_file(path)` with a cut-off or corrupted file named.

    Returns {name: tensor}. Raises FileNotFoundError (missing), CorruptFileError (unreadable:
    truncated, bad header) naming `path`, `what` it holds and `fix` (default: re-create it).
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing ({what}). Fix: {fix or 'point at a complete directory'}.")
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ValueError...
        raise CorruptFileError(f"{path}: cannot read the {what} ({_short(e)}; {path.stat().st_size} bytes): "
                               f"the file is cut off or corrupted. Fix: {fix or 're-create it'}.") from e


def read_json(path: str | Path, what: str = "config", required: tuple[str, ...] = (), fix: str = "") -> dict:
    """A JSON object from `path`, with the keys in `required` present.

    Raises FileNotFoundError (missing) or CorruptFileError (not JSON, not an object, or a required
    key absent) naming the file, the key and `fix`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing ({what}). Fix: {fix or 'point at a complete directory'}.")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: the {what} is not valid JSON ({_short(e)}): the file is cut off or "
                               f"corrupted. Fix: {fix or 're-create it'}.") from e
    if not isinstance(obj, dict):
        raise CorruptFileError(f"{path}: the {what} is not a JSON object. Fix: {fix or 're-create it'}.")
    missing = [k for k in required if k not in obj]
    if missing:
        raise CorruptFileError(f"{path}: the {what} lacks {', '.join(repr(k) for k in missing)}. "
                               f"Fix: {fix or 're-create it'}.")
    return obj


def _short(e: BaseException, limit: int = 200) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return s if len(s) <= limit else s[:limit] + "…"


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


def _exit_interrupted(resume: str) -> None:
    global _REPORTED
    with contextlib.suppress(Exception):  # a progress bar's line is ended first
        sys.stderr.write("\n")
    sys.stderr.write(f"{_prog()}: interrupted; {resume}\n")
    sys.stderr.flush()
    _REPORTED = True
    raise SystemExit(EXIT_INTERRUPTED)
