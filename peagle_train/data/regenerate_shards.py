"""Regeneration by several engines at once (data parallel): the conversations split into shards by
id, one backend per shard (one vLLM engine per GPU or GPU group), merged into one output.

Conversation `id` belongs to shard `shard_of(id, n)` (sha256 of the id mod n): every conversation to
exactly one shard, the same shard whatever else the input holds, so a rerun finds each one where it
was. Shard k of n is an ordinary resumable regeneration (data/regenerate.py `regenerate`, run in a
thread of its own: the engines are processes of their own, the thread only renders prompts and
writes) into <output>.shards/k-of-n.jsonl with its own manifest and .dropped sidecar.

Once every shard has finished, the merge appends their conversations to the output in the input's
order, drops (and counts) a conversation equal to one already in the output, and writes the
output's manifest with the counts of the whole output, the shards (their devices, conversations
and status) and `data_parallel`; then the shard folder is removed. Each conversation's turn draws
with its own seed (`turn_seed`), so the merged output is, byte for byte, what one engine writes
from the same input (up to floating-point differences between engines and batches).

A shard that fails (its engine dies, a kill) leaves the others running to their end; the output's
manifest then names the failed shards (devices, error) and says "not finished", and the error
names them and the command that continues: a rerun keeps every finished shard (its conversations
are not asked again) and redoes the failed ones from their complete lines. A rerun with another
number of shards while shards are unmerged is refused (`check_shards`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError, CorruptFileError, UserError
from ..io import atomic_write_json
from .regenerate import (DUPLICATE, RegenerateStats, _check_resumable, _finish, _Seen, done_ids, dropped_path,
                         read_dropped, regenerate)

logger = logging.getLogger(__name__)

MERGE_CHUNK = 4096  # conversations appended to the output between two fsyncs of the merge
SUMMED = ("turns_generated", "cut_at_max_new_tokens", "stopped_at_empty_answer", "prompts_over_context",
          "turns_cut_by_max_turns", "torn_lines_dropped")  # the shards' counts that add up to the run's


class ShardError(UserError, RuntimeError):
    """One or more shards of a data-parallel regeneration failed; names them, their devices and the
    command that redoes them only."""


def shard_of(cid: str, n: int) -> int:
    """The shard (0..n-1) of conversation id `cid` among `n`: the first 8 bytes of sha256(id) mod n."""
    return int.from_bytes(hashlib.sha256(str(cid).encode()).digest()[:8], "big") % n


def shards_dir(out_path: str | Path) -> Path:
    """The folder of a regeneration output's unmerged shards: <output>.shards beside it."""
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".shards")


def shard_path(out_path: str | Path, k: int, n: int) -> Path:
    """Shard k of n of `out_path`: <output>.shards/k-of-n.jsonl."""
    return shards_dir(out_path) / f"{k}-of-{n}.jsonl"


def check_shards(out_path: str | Path, n: int) -> None:
    """Refuse to continue `out_path` with `n` engines while its shard folder holds the unmerged shards
    of a run with another number of engines (their conversations would be asked again).

    Raises:
        ConfigError: naming the folder, the run's number of engines and the fix."""
    d = shards_dir(out_path)
    counts = {int(m.group(1)) for f in (d.iterdir() if d.is_dir() else ())
              if (m := re.fullmatch(r"\d+-of-(\d+)\.jsonl", f.name))}
    other = sorted(counts - {n})
    if other:
        raise ConfigError(f"regenerate.data_parallel={n}, but {d} holds the unmerged shards of a run with "
                          f"regenerate.data_parallel={other[0]}. Fix: rerun with regenerate.data_parallel={other[0]} "
                          f"to finish them, or remove {d} to regenerate their conversations again.")


def _shard_done(path: Path, ids: list[str], settings: dict | None) -> bool:
    """Whether shard file `path` finished with `settings` and holds (or dropped) every id of `ids`."""
    from .manifest import read_regenerated_manifest

    m = read_regenerated_manifest(path)
    if not m or not m["complete"] or m.get("settings") != settings or not path.is_file() \
            or path.stat().st_size != m["bytes"]:
        return False
    have = done_ids(path) | set(read_dropped(path))
    return all(i in have for i in ids)


def regenerate_sharded(conversations, make_backend: Callable[[int], object], out_path: str | Path, *,
                       devices: list[str | None], batch_size: int = 16, extra: dict | None = None,
                       max_turns: int | None = None, settings: dict | None = None, command: str | None = None,
                       seed: int = 0, drop_cut: bool = True) -> tuple[RegenerateStats, list[dict]]:
    """Regenerate `conversations` into `out_path` with len(devices) engines (module docstring).

    conversations: iterable of (id, messages), as `regenerate` takes them; their order is the
    output's. make_backend(k): shard k's backend (called in shard k's thread, only for a shard with
    work left; closed after it); devices[k]: the devices of shard k's engine, as recorded in the
    manifest (CUDA_VISIBLE_DEVICES, e.g. "3" or "0,1"; None: none named). The other arguments are
    `regenerate`'s, used by every shard.
    Returns (the run's counts, as `regenerate` counts them for one engine: the shards' turn counts
    summed, the merge's written, dropped and duplicates; per shard {shard, devices, file,
    conversations, status, error?, vllm?}).

    Raises:
        ShardError: a shard failed (after the others finished), naming it, its devices, its error and
            the command that redoes it; the output's manifest names it too.
        ConfigError: unmerged shards of another number of engines (`check_shards`).
        CorruptFileError: the output or a shard is damaged, altered or was written with other settings.
    """
    from .manifest import read_regenerated_manifest, regenerate_fix, regenerated_manifest_path

    out_path, n = Path(out_path), len(devices)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    stats = RegenerateStats()
    fix = regenerate_fix(out_path, command)
    _check_resumable(out_path, read_regenerated_manifest(out_path), settings, fix)
    check_shards(out_path, n)
    done = done_ids(out_path, stats, fix=f"remove that line (or the file) and {fix}")
    dropped_before = read_dropped(out_path)
    todo, parts = [], [[] for _ in range(n)]
    for cid, msgs in conversations:
        cid = str(cid)
        if cid in done:
            stats.skipped_done += 1
        elif cid in dropped_before:
            stats.skipped_dropped += 1
        else:
            todo.append(cid)
            parts[shard_of(cid, n)].append((cid, msgs))
    info = [{"shard": k, "devices": devices[k], "file": str(shard_path(out_path, k, n).relative_to(out_path.parent)),
             "conversations": len(parts[k]), "status": "running"} for k in range(n)]
    manifest = {"what": "peagle regenerate output", "file": out_path.name, "settings": settings, "command": command,
                "complete": False, "conversations": len(done),
                "bytes": out_path.stat().st_size if out_path.is_file() else 0, "sha256": None, "data_parallel": n,
                "shards": info}
    atomic_write_json(regenerated_manifest_path(out_path), manifest)
    out_path.touch()  # as `regenerate` opens it: readers see an unfinished output, not a missing one
    shards_dir(out_path).mkdir(exist_ok=True)
    run = dict(batch_size=batch_size, extra=extra, max_turns=max_turns, settings=settings, command=command,
               seed=seed, drop_cut=drop_cut)
    shard_stats, errors = _run_shards(parts, make_backend, out_path, devices, info, run)
    for st in shard_stats:
        for key in SUMMED:
            setattr(stats, key, getattr(stats, key) + (getattr(st, key) if st else 0))
    if errors:
        atomic_write_json(regenerated_manifest_path(out_path), {**manifest, "shards": info})
        raise ShardError(_failure_message(out_path, devices, info, errors, command)) from errors[min(errors)]
    _merge(out_path, todo, n, stats, manifest, info)
    shutil.rmtree(shards_dir(out_path))
    return stats, info


def _run_shards(parts: list[list], make_backend, out_path: Path, devices: list, info: list[dict],
                run: dict) -> tuple[list[RegenerateStats | None], dict[int, BaseException]]:
    """Shard k's conversations `parts[k]` regenerated into its file by `make_backend(k)`, one thread
    per shard, all to their end; a shard already finished (`_shard_done`) is not started. `run`:
    `regenerate`'s keyword arguments. Updates info[k] (status, error, vllm summary). Returns (each
    shard's counts, None where it did not run; {shard: its exception})."""
    n = len(devices)
    shard_stats: list[RegenerateStats | None] = [None] * n
    errors: dict[int, BaseException] = {}

    def one(k: int) -> None:
        path = shard_path(out_path, k, n)
        try:
            if _shard_done(path, [c for c, _ in parts[k]], run["settings"]):
                info[k]["status"] = "finished before"
                return
            backend = make_backend(k)
            try:
                shard_stats[k] = regenerate(parts[k], backend, path, desc=f"shard {k} ({devices[k] or 'regenerating'})",
                                            **run)
            finally:
                if hasattr(backend, "summary"):
                    info[k]["vllm"] = backend.summary()
                if hasattr(backend, "close"):
                    backend.close()
            info[k]["status"] = "finished"
        except BaseException as e:  # noqa: BLE001 (a KeyboardInterrupt raised in the thread included): reported
            errors[k] = e
            info[k].update(status="failed", error=f"{type(e).__name__}: {e}"[:500])
            logger.error(f"regeneration shard {k} of {n} (devices {devices[k]}) failed: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(k,), name=f"regenerate-{k}-of-{n}", daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)  # a short wait: Ctrl-C reaches this thread
    return shard_stats, errors


def _failure_message(out_path: Path, devices: list, info: list[dict], errors: dict, command: str | None) -> str:
    """One line: which shards failed (devices, error), which finished and where, and the rerun."""
    n = len(devices)
    failed = "; ".join(f"shard {k} (devices {devices[k]}): {info[k]['error']}" for k in sorted(errors))
    kept = [str(k) for k in range(n) if k not in errors]
    kept = (f"shard{'s' if len(kept) > 1 else ''} {', '.join(kept)} finished (kept in {shards_dir(out_path)})"
            if kept else "none finished")
    how = command or f"peagle regenerate regenerate.output={out_path} with the settings it was made with"
    return (f"{out_path}: {len(errors)} of {n} regeneration shards failed ({failed}); {kept}. Fix: rerun {how}: it "
            f"keeps the finished shards and redoes shard{'s' if len(errors) > 1 else ''} "
            f"{', '.join(map(str, sorted(errors)))} from {'their' if len(errors) > 1 else 'its'} complete lines.")


def _merge(out_path: Path, todo: list[str], n: int, stats: RegenerateStats, manifest: dict, info: list[dict]) -> None:
    """Append the finished shards' conversations of `todo` (ids, in the input's order) to `out_path`
    and their drops to its .dropped, a conversation equal to one already in the output dropped
    (DUPLICATE); then write the output's finished manifest (`_finish`) with the shards' `info`.
    `todo` holds no id already in the output, so a rerun after a kill in the middle of the merge
    continues after the conversations it appended."""
    index: dict[str, tuple[int, int]] = {}  # id -> (shard, byte offset of its line)
    shard_dropped = []
    for k in range(n):
        path = shard_path(out_path, k, n)
        shard_dropped.append(read_dropped(path))
        offset = 0
        if path.is_file():
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        index[str(json.loads(line)["id"])] = (k, offset)
                    offset += len(line)
    seen = _Seen(out_path)
    files = [open(shard_path(out_path, k, n), "rb") if shard_path(out_path, k, n).is_file() else None
             for k in range(n)]
    try:
        with open(out_path, "ab") as f, open(dropped_path(out_path), "a", encoding="utf-8") as fd:
            for s in range(0, len(todo), MERGE_CHUNK):
                lines, gone = [], []
                for cid in todo[s: s + MERGE_CHUNK]:
                    k = shard_of(cid, n)
                    if cid in index:
                        k, offset = index[cid]
                        files[k].seek(offset)
                        line = files[k].readline()
                        msgs = json.loads(line)["messages"]
                        if not seen.is_duplicate(msgs):
                            stats.duplicate_answers += seen.add(msgs)
                            lines.append(line)
                            continue
                        reason = DUPLICATE
                    elif cid in shard_dropped[k]:
                        reason = shard_dropped[k][cid]
                    else:
                        path = shard_path(out_path, k, n)
                        raise CorruptFileError(f"{path}: conversation {cid!r} is neither in it nor in its .dropped, "
                                               f"though the shard finished. Fix: remove {path} and its sidecars (the "
                                               "shard is redone), then rerun.")
                    stats.duplicate_conversations += reason == DUPLICATE
                    stats.drop(reason)
                    gone.append(json.dumps({"id": cid, "reason": reason}, ensure_ascii=False) + "\n")
                for handle, data in ((fd, "".join(gone)), (f, b"".join(lines))):  # the dropped first, as regenerate
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                stats.written += len(lines)
    finally:
        for h in files:
            if h is not None:
                h.close()
    for k in range(n):
        info[k]["status"] = "merged"
    _finish(out_path, {**manifest, "conversations": manifest["conversations"] + stats.written, "shards": info},
            seen.file_duplicate_answers + stats.duplicate_answers)
