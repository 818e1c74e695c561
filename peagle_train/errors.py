"""User errors and the one wrapper every entry point runs under.

A user error is something the person running a command can fix: bad data, a bad setting, a missing
or damaged file, a head made for another target. Its class derives from `UserError` (and keeps its
ValueError/OSError ancestry), and its message names what is wrong, where (file, record, setting)
and the fix. `cli_main` prints such an error as one line (or a short block) on stderr and exits
with status 2, without a traceback; any other exception is an internal error and keeps its
traceback. `PEAGLE_TRACEBACK=1` (or Hydra's own `HYDRA_FULL_ERROR=1`) shows the traceback of a
user error too.

`load_safetensors` and `read_json` read the files a command is handed (checkpoints, exports,
state files) and turn a cut-off or corrupted file into a `CorruptFileError` naming it.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
from pathlib import Path

EXIT_USER_ERROR = 2
_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"  # the user's own setting, before any wrapper ran


class UserError(Exception):
    """An error the user can fix; the message names what, where and the fix. Exit status 2."""


class ConfigError(UserError, ValueError):
    """A setting that is missing, out of range or inconsistent with another (names the key)."""


class CorruptFileError(UserError, ValueError):
    """A file that exists but cannot be read as what it should be (cut off, altered, missing a key)."""


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


def user_error_message(e: BaseException) -> str | None:
    """The message to print for a user error, or None when `e` is an internal error.

    User errors: `UserError` subclasses; a missing file or one in the way (FileNotFoundError,
    FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError); a full disk (OSError
    ENOSPC/EDQUOT); Hydra's and OmegaConf's errors while the config is composed (before the job starts).
    """
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)):
        return str(e)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{e}. Fix: free disk space (or choose another output directory) and run the command again."
    if _is_config_composition_error(e):
        cause = e.__cause__
        extra = f"\n  {cause}".replace("\n", "\n  ") if cause is not None and str(cause) not in str(e) else ""
        return f"config: {e}{extra}"
    return None


def _is_config_composition_error(e: BaseException) -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:
        return False
    # once the job runs, HydraConfig is set: an OmegaConf error there is a bug in the job, not the config
    return isinstance(e, (HydraException, OmegaConfBaseException)) and not HydraConfig.initialized()


def cli_main(fn=None, /, **hydra_main_kwargs):
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
    exception on instead of printing it.
    """
    if fn is not None:
        return _guarded(fn, console=True)

    def decorate(task):
        import hydra

        return _guarded(hydra.main(**hydra_main_kwargs)(_guarded(task, job=True)))

    return decorate


def _in_multirun_job() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _guarded(fn, job: bool = False, console: bool = False):
    """fn with user errors reported (see cli_main). job: fn is a Hydra task function; in a -m sweep
    its user error is passed on so that Hydra runs the other jobs before reporting the failure.
    console: fn runs outside Hydra, so its log messages get a console handler (`logs.setup_logging`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if console:
            from .logs import setup_logging

            setup_logging()
        show_tb = os.environ.get("PEAGLE_TRACEBACK") == "1" or _USER_FULL_ERROR
        old = os.environ.get("HYDRA_FULL_ERROR")
        os.environ["HYDRA_FULL_ERROR"] = "1"
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if isinstance(e.code, str):
                _exit_user_error(e.code)
            raise
        except Exception as e:  # noqa: BLE001 - sorted into user errors and internal ones below
            msg = user_error_message(e)
            if msg is None or show_tb or (job and _in_multirun_job()):
                raise
            _exit_user_error(msg)
        finally:
            if old is None:
                os.environ.pop("HYDRA_FULL_ERROR", None)
            else:
                os.environ["HYDRA_FULL_ERROR"] = old

    return wrapper


def _exit_user_error(msg: str) -> None:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "peagle"
    sys.stderr.write(f"{prog}: error: {msg}\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_USER_ERROR)
