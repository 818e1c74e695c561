"""Conversation sources → `datasets.Dataset` of normalised conversations, cached by fingerprint.

One source is a ShareGPT JSON/JSONL file, an OpenAI `messages` JSONL, an UltraChat JSONL (`data`),
a JSONL of already tokenised rows (`input_ids` + `loss_mask`), or a local Hugging Face dataset
directory (`save_to_disk` output, or a directory of .parquet/.json/.jsonl files) holding any of these.

Every source becomes the same Arrow table (memory-mapped, in `cache_dir`):
    id: str, messages: list of {role, content}, input_ids: list[int], loss_mask: list[int],
    drop: str ("" = kept; else the reason), changes: list[str] (normalisation changes made).
JSON files go through `read_records` (which salvages truncated files) inside `Dataset.from_generator`,
whose cache key holds the file's sha256: a second run with the same file is a cache hit and reads
nothing but the Arrow file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets

from ..io import atomic_write_json
from ..provenance import digest, sha256_file
from .conversations import DataFileError, ReadReport, normalize_record, read_records, read_summary

NORMALIZE_VERSION = "2"  # bump when the normalisation rules change: invalidates cached Arrow tables
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
    size in bytes, format, and the read report (records, truncation, malformed records)."""

    path: str
    sha256: str
    bytes: int
    format: str
    records: int = 0
    truncated: bool = False
    lost_bytes: int = 0
    malformed_records: int = 0
    first_malformed: str = ""

    def summary(self) -> str:
        return read_summary(self.path, self.records, self.truncated, self.lost_bytes, self.malformed_records,
                            self.first_malformed)


def load_source(path: str | Path, cache_dir: str | Path | None = None, log=print) -> tuple[datasets.Dataset, SourceInfo]:
    """Load one source as the normalised table described in the module docstring.

    Raises:
        DataFileError: the path does not exist, cannot be read, or holds no record (names the path
            and the fix).
    """
    path = Path(path).expanduser()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if path.is_dir():
        return _load_dataset_dir(path, cache)
    if not path.is_file():
        raise DataFileError(f"Data file not found: {path}. Fix: set data.path (or a data.mix entry's path) to an "
                            "existing JSON/JSONL file or a local Hugging Face dataset directory.")
    sha = sha256_file(path, memo_dir=cache)
    report_path = cache / "reports" / f"{sha}-v{NORMALIZE_VERSION}.json"
    try:
        ds = datasets.Dataset.from_generator(
            _normalised_records, features=FEATURES, cache_dir=str(cache / "arrow"),
            gen_kwargs={"path": str(path), "sha256": sha, "version": NORMALIZE_VERSION,
                        "report_path": str(report_path)})
    except Exception as e:  # datasets wraps the generator's errors; surface ours as they are
        cause = e
        while cause is not None and not isinstance(cause, DataFileError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise
    if not report_path.is_file():  # cached table but the sidecar is gone: re-read the file once
        _, rep = read_records(path)
        _write_report(rep, report_path)
    rep = json.loads(report_path.read_text())
    info = SourceInfo(str(path), sha, path.stat().st_size, "json", **rep)
    return ds, info


def _normalised_records(path: str, sha256: str, version: str, report_path: str):
    """Generator behind `Dataset.from_generator` (sha256 and version only key the cache)."""
    records, report = read_records(path)
    _write_report(report, Path(report_path))
    for idx, rec in enumerate(records):
        rid = str(rec.get("id", idx)) if isinstance(rec.get("id", idx), (str, int)) else str(idx)
        yield _row_of(rec, rid)


def _row_of(rec: dict, rid: str) -> dict:
    if "input_ids" in rec and "loss_mask" in rec:  # already tokenised: passes through unchanged
        ids, mask = rec["input_ids"], rec["loss_mask"]
        ok = (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask) and len(ids) > 0
              and all(isinstance(t, int) and t >= 0 for t in ids) and all(m in (0, 1) for m in mask))
        drop = "" if ok else "pre-tokenised row: input_ids/loss_mask not equal-length lists of ids and 0/1"
        return {"id": rid, "messages": [], "input_ids": ids if ok else [], "loss_mask": mask if ok else [],
                "drop": drop, "changes": []}
    msgs, drop, changes = normalize_record(rec)
    return {"id": rid, "messages": msgs or [], "input_ids": [], "loss_mask": [], "drop": drop, "changes": changes}


def _write_report(rep: ReadReport, path: Path) -> None:
    d = {"records": rep.records, "truncated": rep.truncated, "lost_bytes": rep.lost_bytes,
         "malformed_records": len(rep.bad_records), "first_malformed": rep.bad_records[0] if rep.bad_records else ""}
    atomic_write_json(path, d, indent=None)


def _load_dataset_dir(path: Path, cache: Path) -> tuple[datasets.Dataset, SourceInfo]:
    """A `save_to_disk` directory, or a directory of parquet/json/jsonl files, normalised with `map`."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    listing = "".join(f"{f.relative_to(path)}:{sha256_file(f, memo_dir=cache)}\n" for f in files)
    size = sum(f.stat().st_size for f in files)
    if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
        raw = datasets.load_from_disk(str(path))
    else:
        kinds = {f.suffix for f in files} & {".parquet", ".json", ".jsonl"}
        if not kinds:
            raise DataFileError(f"{path} is a directory without a saved dataset (dataset_info.json) or "
                                ".parquet/.json/.jsonl files. Fix: point data.path at a file or a dataset directory.")
        builder = "parquet" if ".parquet" in kinds else "json"
        data_files = [str(f) for f in files if f.suffix in ({".parquet"} if builder == "parquet" else {".json", ".jsonl"})]
        raw = datasets.load_dataset(builder, data_files=data_files, split="train", cache_dir=str(cache / "arrow"))
    if isinstance(raw, datasets.DatasetDict):
        raw = raw["train"] if "train" in raw else raw[next(iter(raw))]
    if len(raw) == 0:
        raise DataFileError(f"No record in dataset directory {path}. Fix: check the directory.")
    ds = raw.map(_normalise_batch, batched=True, with_indices=True, remove_columns=raw.column_names,
                 features=FEATURES, desc=f"normalising {path.name}")
    return ds, SourceInfo(str(path), digest(listing), size, "hf_dataset_dir", records=len(raw))


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
