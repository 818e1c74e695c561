"""Conversation sources → `datasets.Dataset` of normalised conversations, cached by fingerprint.

One source is a ShareGPT JSON/JSONL file, an OpenAI `messages` JSONL, an UltraChat JSONL (`data`),
a JSONL of already tokenised rows (`input_ids` + `loss_mask`), a Parquet file, or a local Hugging
Face dataset directory (`save_to_disk` output, or a directory of .parquet or .json/.jsonl files)
holding any of these.

Every source becomes the same Arrow table (memory-mapped, in `cache_dir`):
    id: str, messages: list of {role, content}, input_ids: list[int], loss_mask: list[int],
    drop: str ("" = kept; else the reason), changes: list[str] (normalisation changes made).
JSON files, alone or in a directory, go through `read_records` (which salvages truncated files and
counts malformed records) inside `Dataset.from_generator`, whose cache key holds the file's sha256:
a second run with the same file is a cache hit and reads nothing but the Arrow file.

`data.sources` (`mix_sources`): datasets named by hub id (or a local dataset directory or file), read
with `datasets.load_dataset`, each mapped from its format (ShareGPT `conversations`, OpenAI
`messages`, UltraChat `data`, Magpie's `instruction` + `response`) to the same table, cut to its
count and mixed into one conversation set: the input of the regenerate stage.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets

from ..io import atomic_write_json
from ..provenance import digest, sha256_file
from .conversations import DataFileError, normalize_record, read_records, read_summary
from .manifest import check_regenerated, regenerated_manifest_path

logger = logging.getLogger(__name__)

NORMALIZE_VERSION = "3"  # bump when the normalisation rules change: invalidates cached Arrow tables
FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
    "input_ids": datasets.Sequence(datasets.Value("int64")),
    "loss_mask": datasets.Sequence(datasets.Value("int8")),
    "drop": datasets.Value("string"),
    "changes": datasets.Sequence(datasets.Value("string")),
})


def default_cache_dir() -> Path:
    """Where prepared Arrow tables are cached: $PEAGLE_DATA_CACHE or ~/.cache/peagle_train/data."""
    return Path(os.environ.get("PEAGLE_DATA_CACHE", Path.home() / ".cache" / "peagle_train" / "data"))


@dataclass
class SourceInfo:
    """What one source is: its path, sha256 (files; for a directory, of its file list and hashes),
    size in bytes, format, and the read report (records, truncation, malformed records by reason,
    notes on how it was read; `unrecognised_keys`: the keys of the first record that had none of
    the known fields, to name in an error when nothing could be normalised)."""

    path: str
    sha256: str
    bytes: int
    format: str
    records: int = 0
    truncated: bool = False
    lost_bytes: int = 0
    malformed_records: int = 0
    first_malformed: str = ""
    malformed_by_reason: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    unrecognised_keys: list = field(default_factory=list)

    def summary(self) -> str:
        return read_summary(self.path, self.records, self.truncated, self.lost_bytes, self.malformed_records,
                            self.first_malformed, self.notes)


def load_source(path: str | Path, cache_dir: str | Path | None = None) -> tuple[datasets.Dataset, SourceInfo]:
    """Load one source as the normalised table described in the module docstring.

    A JSON/JSONL file (or a directory of them) goes through `read_records`, which salvages cut-off
    and malformed records and counts them; a Parquet file or directory and a `save_to_disk`
    directory are read with `datasets`.

    Raises:
        DataFileError: the path is empty, does not exist, cannot be read, or holds no record (names
            the path and the fix).
        CorruptFileError: an output of `peagle regenerate` (a file with a sidecar <file>.manifest)
            that is unfinished, cut off or altered (data/manifest.py `check_regenerated`).
    """
    check_data_path(path)
    path = Path(path).expanduser()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if path.is_dir():
        return _load_dataset_dir(path, cache)
    if not path.is_file():
        raise DataFileError(f"Data file not found: {path}. Fix: set data.path (or a data.mix entry's path) to an "
                            "existing JSON/JSONL file or a local Hugging Face dataset directory.")
    sha = sha256_file(path, memo_dir=cache)
    check_regenerated(path, sha)  # a `peagle regenerate` output: finished, and as its run left it
    if _is_parquet(path):
        return _load_with_datasets(path, [path], sha, path.stat().st_size, cache)
    return _load_json_files(path, [path], sha, path.stat().st_size, cache)


def check_data_path(path, key: str = "data.path") -> None:
    """Refuse an empty or blank path (an unset shell variable in `data.path=$DATA`), which would
    otherwise name the working directory. Raises DataFileError naming `key` and the fix."""
    if path is None or not str(path).strip():
        raise DataFileError(f"{key} is empty ({'null' if path is None else repr(str(path))}): no data file or "
                            f"directory is named (an unset shell variable?). Fix: set {key}=FILE, a JSON/JSONL/Parquet "
                            "file or a dataset directory.")


def _is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def _load_json_files(root: Path, files: list[Path], digest: str, size: int, cache: Path,
                     notes: list[str] | None = None) -> tuple[datasets.Dataset, SourceInfo]:
    """JSON/JSONL files through `read_records` inside `Dataset.from_generator` (cached by `digest`)."""
    report_path = cache / "reports" / f"{digest}-v{NORMALIZE_VERSION}.json"
    kwargs = {"root": str(root), "paths": tuple(str(f) for f in files), "sha256": digest,  # tuples: datasets
              "version": NORMALIZE_VERSION, "report_path": str(report_path), "notes": tuple(notes or ())}  # shards lists
    try:
        ds = datasets.Dataset.from_generator(_normalised_records, features=FEATURES, cache_dir=str(cache / "arrow"),
                                             gen_kwargs=kwargs)
    except Exception as e:  # datasets wraps the generator's errors; surface ours as they are
        cause = e
        while cause is not None and not isinstance(cause, DataFileError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise
    if not report_path.is_file():  # cached table but the sidecar is gone: re-read the files once
        for _ in _normalised_records(**kwargs):
            pass
    rep = json.loads(report_path.read_text())
    fmt = "json" if root.is_file() else "json_dir"
    return ds, SourceInfo(str(root), digest, size, fmt, **rep)


def _normalised_records(root: str, paths: tuple[str, ...], sha256: str, version: str, report_path: str,
                        notes: tuple[str, ...]):
    """Generator behind `Dataset.from_generator` (sha256 and version only key the cache): the rows
    of every file, and the sidecar report (read counts summed over the files)."""
    total = {"records": 0, "truncated": False, "lost_bytes": 0, "malformed_records": 0, "first_malformed": "",
             "malformed_by_reason": Counter(), "notes": list(notes), "unrecognised_keys": []}
    several = len(paths) > 1
    for p in paths:
        name = str(Path(p).relative_to(root)) if several else ""
        try:
            records, rep = read_records(p)
        except DataFileError as e:
            if not several:
                raise
            total["notes"].append(f"skipped {name}: {str(e).split(' (')[0]}")
            continue
        total["records"] += rep.records
        total["truncated"] |= rep.truncated
        total["lost_bytes"] += rep.lost_bytes
        total["malformed_records"] += len(rep.bad_records)
        total["malformed_by_reason"].update(rep.bad_reasons)
        if rep.bad_records and not total["first_malformed"]:
            total["first_malformed"] = f"{name}: {rep.bad_records[0]}" if several else rep.bad_records[0]
        total["notes"] += [f"{name}: {n}" if several else n for n in rep.notes]
        for idx, rec in enumerate(records):
            rid = rec.get("id", idx)
            rid = str(rid) if isinstance(rid, (str, int)) else str(idx)
            row = _row_of(rec, f"{name}:{rid}" if several else rid)
            if not total["unrecognised_keys"] and row["drop"].startswith("no 'conversations'"):
                total["unrecognised_keys"] = sorted(map(str, rec))[:20]
            yield row
    if not total["records"]:
        raise DataFileError(f"No record in {root} ({'; '.join(total['notes'])}). Fix: point data.path at JSON/JSONL "
                            "files of conversations.")
    _write_report(total, Path(report_path))


def _row_of(rec: dict, rid: str) -> dict:
    if "input_ids" in rec and "loss_mask" in rec:  # already tokenised: passes through unchanged
        ids, mask = rec["input_ids"], rec["loss_mask"]
        ok = (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask) and len(ids) > 0
              and all(type(t) is int and 0 <= t < 2**62 for t in ids) and all(type(m) is int and m in (0, 1) for m in mask))
        drop = "" if ok else "pre-tokenised row: input_ids/loss_mask not equal-length lists of ids and 0/1"
        return {"id": rid, "messages": [], "input_ids": ids if ok else [], "loss_mask": mask if ok else [],
                "drop": drop, "changes": []}
    msgs, drop, changes = normalize_record(rec)
    return {"id": rid, "messages": msgs or [], "input_ids": [], "loss_mask": [], "drop": drop, "changes": changes}


def _write_report(rep: dict, path: Path) -> None:
    atomic_write_json(path, {**rep, "malformed_by_reason": dict(rep["malformed_by_reason"])}, indent=None)


JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".json.bz2", ".jsonl.bz2", ".json.xz", ".jsonl.xz")


def _load_dataset_dir(path: Path, cache: Path) -> tuple[datasets.Dataset, SourceInfo]:
    """A `save_to_disk` directory (read with `datasets`), or a directory of .parquet files (read with
    `datasets`) or of JSON/JSONL files (each through `read_records`, as a single file is). Files are
    listed by `list_data_files` (hidden ones skipped, symlinks followed; both noted)."""
    files, walk_notes = list_data_files(path)
    sidecars = {regenerated_manifest_path(f) for f in files}
    files = [f for f in files if f not in sidecars]  # read with the file they describe
    for f in files:
        if regenerated_manifest_path(f).is_file():
            check_regenerated(f, sha256_file(f, memo_dir=cache))
    listing = digest("".join(f"{f.relative_to(path)}:{sha256_file(f, memo_dir=cache)}\n" for f in files),
                     *walk_notes)
    size = sum(f.stat().st_size for f in files)
    if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
        return _load_with_datasets(path, None, listing, size, cache)
    parquet = [f for f in files if f.suffix == ".parquet"]
    jsons = [f for f in files if f.name.endswith(JSON_SUFFIXES)]
    if parquet and jsons:
        raise DataFileError(f"{path} holds both .parquet ({len(parquet)}) and JSON/JSONL ({len(jsons)}) files. "
                            "Fix: keep one kind per directory, or list them as data.mix entries.")
    if not parquet and not jsons:
        seen = f" ({'; '.join(walk_notes)})" if walk_notes else ""
        raise DataFileError(f"{path} is a directory without a saved dataset (dataset_info.json) or "
                            f".parquet/.json/.jsonl files{seen}. Fix: point data.path at a file or a dataset directory.")
    used = parquet or jsons
    ignored = [str(f.relative_to(path)) for f in files if f not in used]
    notes = [f"{len(used)} files; {len(ignored)} other files ignored ({', '.join(ignored[:5])})"] if ignored else []
    notes += walk_notes
    for n in walk_notes:
        logger.info("%s: %s", path, n)
    if parquet:
        return _load_with_datasets(path, parquet, listing, size, cache, notes)
    return _load_json_files(path, jsons, listing, size, cache, notes)


def _shown(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def list_data_files(root: Path) -> tuple[list[Path], list[str]]:
    """The files under directory `root` that are read as data, sorted, and notes on what was not read.

    Hidden files and folders (a name starting with "."; e.g. .ipynb_checkpoints/, editor swap files,
    .DS_Store) are skipped, as `datasets` skips them: they hold copies that would double the data.
    Symlinked files and folders are followed; a folder reached again (a symlink loop, or a second
    link to it) is read once, a file reached through several links is read once, and a broken link
    is skipped. Each of these is noted with its count and the first names (relative to `root`)."""
    root = Path(root)
    files, hidden, broken, loops, twice, links = [], [], [], [], [], []
    seen_dirs, seen_files = {os.path.realpath(root)}, {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        here = Path(dirpath)
        keep = []
        for d in sorted(dirnames):
            rel = str((here / d).relative_to(root))
            if d.startswith("."):
                hidden.append(rel + "/")
                continue
            real = os.path.realpath(here / d)
            if real in seen_dirs:
                loops.append(rel + "/")
                continue
            seen_dirs.add(real)
            if (here / d).is_symlink():
                links.append(rel + "/")
            keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            f = here / name
            rel = str(f.relative_to(root))
            if name.startswith("."):
                hidden.append(rel)
            elif not f.exists():
                broken.append(rel)
            elif not f.is_file():
                continue  # a socket or fifo: not data
            elif (real := os.path.realpath(f)) in seen_files:
                twice.append(f"{rel} = {seen_files[real]}")
            else:
                seen_files[real] = rel
                if f.is_symlink():
                    links.append(rel)
                files.append(f)
    notes = []
    if hidden:
        notes.append(f"{len(hidden)} hidden files and folders skipped ({_shown(hidden)})")
    if links:
        notes.append(f"{len(links)} symlinks followed ({_shown(links)})")
    if loops:
        notes.append(f"{len(loops)} symlinked folders already read skipped (a loop or a second link: {_shown(loops)})")
    if twice:
        notes.append(f"{len(twice)} files reached through a second link read once ({_shown(twice)})")
    if broken:
        notes.append(f"{len(broken)} broken symlinks skipped ({_shown(broken)})")
    return sorted(files), notes


def _load_with_datasets(path: Path, parquet: list[Path] | None, digest: str, size: int, cache: Path,
                        notes: list[str] | None = None) -> tuple[datasets.Dataset, SourceInfo]:
    """A `save_to_disk` directory (parquet None) or Parquet files, normalised with `map`."""
    try:
        if parquet is None:
            raw = datasets.load_from_disk(str(path))
        else:
            raw = datasets.load_dataset("parquet", data_files=[str(f) for f in parquet], split="train",
                                        cache_dir=str(cache / "arrow"))
    except Exception as e:  # noqa: BLE001 - pyarrow/datasets raise many types for a damaged file
        raise DataFileError(f"Cannot read {path} as a {'saved dataset' if parquet is None else 'Parquet'} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Fix: check or "
                            "re-create the files.") from e
    if isinstance(raw, datasets.DatasetDict):
        raw = raw["train"] if "train" in raw else raw[next(iter(raw))]
    if len(raw) == 0:
        raise DataFileError(f"No record in dataset directory {path}. Fix: check the directory.")
    ds = raw.map(_normalise_batch, batched=True, with_indices=True, remove_columns=raw.column_names,
                 features=FEATURES, desc=f"normalising {path.name}")
    unrecognised = [] if {"conversations", "messages", "data", "input_ids"} & set(raw.column_names) else \
        sorted(raw.column_names)[:20]
    fmt = "hf_dataset_dir" if parquet is None else "parquet"
    return ds, SourceInfo(str(path), digest, size, fmt, records=len(raw), notes=list(notes or []),
                          unrecognised_keys=unrecognised)


def _normalise_batch(batch: dict, indices: list[int]) -> dict:
    out = {k: [] for k in FEATURES}
    keys = list(batch)
    for j, idx in enumerate(indices):
        rec = {k: batch[k][j] for k in keys}
        rid = rec.get("id")
        row = _row_of(rec, str(rid) if isinstance(rid, (str, int)) else str(idx))
        for k in out:
            out[k].append(row[k])
    return out


def source_info_dict(info: SourceInfo) -> dict:
    return asdict(info)


# ------------------------------------------------------------------------------------------------
# data.sources: datasets named by hub id (or a local file or dataset directory), each in its format,
# mixed into one conversation set (what the regenerate stage reads)

TURN_COLUMNS = {"sharegpt": "conversations", "openai": "messages"}  # format -> default column of the turns
PAIR_COLUMNS = {"prompt": "instruction", "response": "response"}   # format instruction: Magpie's column names


def source_name(entry: dict) -> str:
    """`<last part of the hub id or path>/<split>`: how a source's rows are named (their ids start with it)."""
    return f"{Path(str(entry['hub']).rstrip('/')).name}/{entry.get('split') or 'train'}"


def load_hub_source(entry: dict, where: str = "data.sources[0]", cache_dir: str | Path | None = None
                    ) -> datasets.Dataset:
    """The raw table of one `data.sources` entry, read with `datasets.load_dataset`: `hub` is a hub
    id (e.g. HuggingFaceH4/ultrachat_200k), a local dataset directory (the hub's layout, e.g.
    data/train_sft-00000-of-00001.parquet) or a local .json/.jsonl/.parquet file (split train);
    `split` defaults to train. Hub datasets are cached by `datasets` (HF_HOME; HF_HUB_OFFLINE=1:
    the cache only).

    Raises:
        DataFileError: the dataset or split cannot be loaded; one line naming `where`, the hub id,
            the split, the cause and the fix.
    """
    hub, split = str(entry["hub"]), entry.get("split") or "train"
    local = Path(hub).expanduser()
    try:
        if local.is_file():
            kind = "parquet" if _is_parquet(local) else "json"
            raw = datasets.load_dataset(kind, data_files=[str(local)], split=split,
                                        cache_dir=str(cache_dir) if cache_dir else None)
        else:
            raw = datasets.load_dataset(str(local) if local.is_dir() else hub, split=split,
                                        cache_dir=str(cache_dir) if cache_dir else None)
    except Exception as e:  # noqa: BLE001 - datasets / the hub client raise many types
        cause = str(e).splitlines()[0] if str(e) else ""
        raise DataFileError(f"{where} ({hub}, split {split}): cannot load it ({type(e).__name__}: {cause}). Fix: check "
                            "the hub id and the split (the dataset card lists its splits), set HF_TOKEN for a gated "
                            "dataset, or unset HF_HUB_OFFLINE to download it.") from e
    if isinstance(raw, datasets.DatasetDict):  # a split given as None: the first
        raw = raw[next(iter(raw))]
    return raw


def source_format(entry: dict, columns: list[str], where: str) -> tuple[str, dict]:
    """(format, {role of a column: its name}) of a `data.sources` entry over a table with `columns`:
    the entry's `format` and `columns`, or for format auto the first of conversations (sharegpt:
    from/value turns), messages (openai: role/content turns), data (UltraChat's alternating strings)
    and instruction + response (Magpie's single-turn pair) the table holds.

    Raises:
        DataFileError: a named column is missing, or (auto) none of those columns is there; one
            line naming `where`, the hub id, the columns there and the fix.
    """
    fmt, given = str(entry.get("format") or "auto"), dict(entry.get("columns") or {})
    hub = entry["hub"]
    if fmt == "auto":
        if "conversations" in columns:
            fmt = "sharegpt"
        elif "messages" in columns:
            fmt = "openai"
        elif "data" in columns:
            return "ultrachat", {"turns": "data"}
        elif set(PAIR_COLUMNS.values()) <= set(columns):
            fmt = "instruction"
        else:
            raise DataFileError(f"{where} ({hub}): none of the columns conversations, messages, data or instruction + "
                                f"response is there (its columns: {', '.join(columns[:20])}). Fix: set its format "
                                "(sharegpt | openai | instruction) and columns, e.g. columns: {turns: dialog}.")
    want = {"turns": given.get("turns", TURN_COLUMNS[fmt])} if fmt in TURN_COLUMNS else \
        {k: given.get(k, v) for k, v in PAIR_COLUMNS.items()}
    missing = [f"{k}: {v}" for k, v in want.items() if v not in columns]
    if missing:
        raise DataFileError(f"{where} ({hub}): format {fmt} reads the column(s) {', '.join(missing)}, which it lacks "
                            f"(its columns: {', '.join(columns[:20])}). Fix: name the column(s) in its columns "
                            f"(columns: {{{', '.join(k + ': NAME' for k in want)}}}), or set format: auto.")
    return fmt, want


def _record_of(row: dict, fmt: str, cols: dict) -> dict:
    """One table row as a record `normalize_record` reads."""
    if fmt == "sharegpt":
        return {"conversations": row[cols["turns"]]}
    if fmt == "openai":
        return {"messages": row[cols["turns"]]}
    if fmt == "ultrachat":
        return {"data": row[cols["turns"]]}
    return {"messages": [{"role": "user", "content": row[cols["prompt"]]},
                         {"role": "assistant", "content": row[cols["response"]]}]}


def _source_batch(batch: dict, indices: list[int], fmt: str, cols: dict, name: str) -> dict:
    out = {k: [] for k in FEATURES}
    keys = list(batch)
    for j, idx in enumerate(indices):
        row = _row_of(_record_of({k: batch[k][j] for k in keys}, fmt, cols), f"{name}:{idx}")
        for k in out:
            out[k].append(row[k])
    return out


@dataclass
class SourceCount:
    """What one `data.sources` entry gave: records read, conversations kept (normalisable),
    conversations taken into the mix (its `count`, or all), records skipped by reason and the first
    skipped record's id."""

    name: str
    hub: str
    split: str
    format: str
    records: int
    kept: int
    taken: int
    skipped: dict = field(default_factory=dict)
    first_skipped: str = ""

    def line(self) -> str:
        skipped = sum(self.skipped.values())
        why = "; ".join(f"{r}: {c}" for r, c in sorted(self.skipped.items(), key=lambda x: -x[1])[:3])
        tail = f", {skipped:,} skipped ({why}; first: record {self.first_skipped})" if skipped else ", 0 skipped"
        return f"{self.name} ({self.hub}, {self.format}): {self.records:,} records, {self.kept:,} conversations, " \
               f"{self.taken:,} taken{tail}"


def mix_sources(entries: list[dict], *, seed: int = 0, cache_dir: str | Path | None = None
                ) -> tuple[datasets.Dataset, list[SourceCount]]:
    """The `data.sources` entries read (`load_hub_source`), each mapped from its format
    (`source_format`) to normalised conversations, its unusable records skipped and counted,
    shuffled with `seed` and cut to its `count` (all when null or absent), then concatenated and
    shuffled with `seed` into one conversation set.

    Returns (the set as the FEATURES table of this module, ids `<source_name>:<row index>`, stable
    across runs so a regeneration resumes; one SourceCount per entry, also logged one line each).

    Raises:
        DataFileError: an entry cannot be loaded, lacks the columns of its format, or gives no
            conversation at all (names the entry, its first record, the reasons and the fix).
    """
    parts, counts = [], []
    for i, entry in enumerate(entries):
        entry = dict(entry)
        where = f"data.sources[{i}]"
        raw = load_hub_source(entry, where, cache_dir)
        fmt, cols = source_format(entry, list(raw.column_names), where)
        name = source_name(entry)
        ds = raw.map(_source_batch, batched=True, with_indices=True, remove_columns=raw.column_names,
                     features=FEATURES, fn_kwargs={"fmt": fmt, "cols": cols, "name": name},
                     desc=f"normalising {name}")
        drops = ds.select_columns(["id", "drop"]).to_dict()
        skipped = Counter(d for d in drops["drop"] if d)
        first = next((rid for rid, d in zip(drops["id"], drops["drop"]) if d), "")
        kept = ds.filter(_is_kept_row, input_columns="drop", desc=f"keeping {name}")
        if len(kept) == 0:
            reasons = ", ".join(f"{r}: {c}" for r, c in skipped.most_common(3)) or "no record"
            raise DataFileError(f"{where} ({entry['hub']}, format {fmt}): none of its {len(raw):,} records is a "
                                f"conversation ({reasons}; first: record {first}). Fix: set its format and columns to "
                                "the column holding the turns (sharegpt: from/value, openai: role/content).")
        count = entry.get("count")
        kept = kept.shuffle(seed=seed)
        taken = kept.select(range(min(int(count), len(kept)))) if count else kept
        if count and len(kept) < int(count):
            logger.info("%s: %d conversations for a count of %d; taking all of them", name, len(kept), int(count))
        parts.append(taken)
        counts.append(SourceCount(name, str(entry["hub"]), entry.get("split") or "train", fmt, len(raw), len(kept),
                                  len(taken), dict(skipped), first))
        logger.info(counts[-1].line())
    mixed = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    mixed = mixed.shuffle(seed=seed)
    logger.info("data.sources: %d conversations from %d sources", len(mixed), len(parts))
    return mixed, counts


def _is_kept_row(drop: str) -> bool:
    return drop == ""
