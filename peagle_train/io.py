"""Atomic writes: a file or a directory appears complete under its final name, or not at all.

Every writer in the package that must survive a kill (exports, checkpoints, manifests, feature
shards, caches) goes through here. The pattern is always the same: write into a temporary sibling
(same directory, so the final rename stays on one filesystem and is atomic on POSIX), optionally
flush it to disk, then `os.replace` / rename it into place. On any exception the temporary is
removed and the previous content of the final path, if any, is left as it was.

    with atomic_path(out / "model.safetensors") as tmp:      # for writers that take a path
        save_file(tensors, str(tmp))
    atomic_write_json(out / "manifest.json", manifest)
    with atomic_dir(out / "export", overwrite=True) as tmp:  # a whole directory
        ...
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_file(path: str | Path) -> None:
    """Flush one file's content to disk (os.fsync)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (so a rename inside it survives a power loss); a no-op where the
    platform cannot open directories (Windows)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path of `path` to write; on success it replaces `path`.

    `durable`: fsync the file and its directory (a checkpoint that must survive a power loss).
    On an exception inside the block the temporary is removed and `path` is untouched; an I/O failure
    of the mkdir or the rename is raised as `errors.WriteError` naming `path` (the writer in the
    block names its own failures, see `atomic_write_text`).
    """
    from .errors import writing

    path = Path(path)
    with writing(path, "file", note="its previous content, if any, is left as it was"):
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        with writing(path, "file", note="its previous content, if any, is left as it was"):
            if durable:
                fsync_file(tmp)
            os.replace(tmp, path)
            if durable:
                fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_text(path: str | Path, text: str, *, durable: bool = False) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns `path`. Raises `errors.WriteError` naming
    `path` and the cause when it cannot be written (full disk, read-only, a file in the way)."""
    from .errors import writing

    with atomic_path(path, durable=durable) as tmp:
        with writing(path, "file", note="its previous content, if any, is left as it was"):
            tmp.write_text(text, encoding="utf-8")
    return Path(path)


def atomic_write_json(path: str | Path, obj, *, indent: int | None = 2, durable: bool = False) -> Path:
    """`json.dumps(obj, indent=indent, default=str)` written to `path` atomically; returns `path`."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=str), durable=durable)


_RENAME_EXCHANGE = 2  # linux/fs.h: swap two paths atomically (renameat2, Linux >= 3.15)
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries `a` and `b` in one atomic step (Linux renameat2 RENAME_EXCHANGE).
    False where the platform or file system does not offer it (the caller falls back)."""
    if sys.platform != "linux":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _aside(path: Path) -> Path:
    return path.with_name(f".{path.name}.old-{os.getpid()}")


def replace_dir(new: Path, path: Path) -> None:
    """Make directory `new` the directory `path`, replacing an existing one, such that a reader finds
    a complete `path` (old or new) at every moment: the two are swapped atomically (renameat2
    RENAME_EXCHANGE) and the old one, now under `new`'s name, is removed. Where the swap is not
    offered, the old directory is renamed aside (`.<name>.old-<pid>`), `new` renamed in, and the old
    removed; a kill between the two renames leaves only the aside copy, which `recover_dir` (run by
    every `atomic_dir` and by the readers of heads) renames back."""
    new, path = Path(new), Path(path)
    if path.exists() and _exchange(new, path):
        shutil.rmtree(new)  # the old content, under the temporary name
        return
    if path.exists():
        old = _aside(path)
        path.rename(old)
        new.rename(path)
        shutil.rmtree(old)
        return
    new.rename(path)


def recover_dir(path: str | Path) -> Path:
    """`path`, restored from the copy a killed `replace_dir` renamed aside when `path` itself is
    missing; temporaries and aside copies left beside a complete `path` by killed processes
    (`.<name>.tmp-<pid>`, `.<name>.old-<pid>` of a pid no longer running) are removed. Returns `path`."""
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        return path
    asides = sorted(parent.glob(f".{path.name}.old-*"))
    if not path.exists() and asides:
        asides.pop().rename(path)
    for stale in [*asides, *parent.glob(f".{path.name}.tmp-*")]:
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    return path


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a temporary of this process is never in use when a new write starts
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, overwrite: bool = False, durable: bool = False,
               tmp: str | Path | None = None) -> Iterator[Path]:
    """Yield an empty temporary sibling directory; on success it becomes `path`.

    `overwrite`: an existing `path` is replaced by `replace_dir` (a reader finds the old or the new
    directory at every moment); without it an existing `path` raises FileExistsError, before anything
    is written or, when another process created `path` meanwhile, at the end (its `path` is kept and
    this temporary removed). `durable`: fsync every file and the directories before and after the rename.
    `tmp`: the temporary's name when a caller must recognise it later (checkpoints clean up
    `.tmp-step_N`); default `.<name>.tmp-<pid>`. A stale temporary of that name, and those of killed
    processes (`recover_dir`), are removed first.

    Raises:
        FileExistsError: `path` exists (or appears) and overwrite is False.
    """
    path = recover_dir(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists. Fix: choose another path or allow overwriting it.")
    tmp = Path(tmp) if tmp is not None else _tmp_sibling(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if durable:
            for f in tmp.rglob("*"):
                if f.is_file():
                    fsync_file(f)
            fsync_dir(tmp)
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} appeared while it was being written (another process?); kept as it is.")
        replace_dir(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
