"""User errors, and the I/O failures that are user errors.

A user error is something the person running a command can fix: bad data, a bad setting, a missing
or damaged file, a head made for another target. Its class derives from `UserError` (and keeps its
ValueError/OSError ancestry), and its message names what is wrong, where (file, record, setting)
and the fix. The entry-point wrapper (`runtime.cli_main`) prints such an error as one line and exits
with status 2.

An I/O failure is a user error whatever library raises it: an OSError, safetensors' SafetensorError
("I/O error: No space left on device (os error 28)"), torch's RuntimeError from `torch.save`
("[enforce fail at inline_container.cc] ... file write failed"), found also through `__cause__` /
`__context__`. `io_failure` recognises them; `writing(path, what)` turns one into a `WriteError`
naming the path, the cause (no space left, read-only, permission denied, is a file) and the fix.

`load_safetensors` and `read_json` read the files a command is handed (checkpoints, exports,
state files) and turn a cut-off or corrupted file into a `CorruptFileError` naming it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path


class UserError(Exception):
    """An error the user can fix; the message names what, where and the fix. Exit status 2."""


class ConfigError(UserError, ValueError):
    """A setting that is missing, out of range or inconsistent with another (names the key)."""


class CorruptFileError(UserError, ValueError):
    """A file that exists but cannot be read as what it should be (cut off, altered, missing a key)."""


class ExportError(UserError, ValueError):
    """An export directory that does not match the speculators format; the message lists every problem."""


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
