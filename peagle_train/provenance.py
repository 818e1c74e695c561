"""Fingerprints: what a prepared dataset, a features directory or a checkpoint was made from.

One function per thing that is fingerprinted, used by every manifest and cache key:

| thing | function | what changes it |
|---|---|---|
| bytes / strings | `digest(*parts)` | any part (parts are separated, so ("ab", "c") ≠ ("a", "bc")) |
| a file | `sha256_file(path, memo_dir=)` | its bytes (memoised per path, size and mtime) |
| a tokenizer | `tokenizer_fingerprint(tok)` | vocabulary, merges, normaliser, added/special tokens |
| a chat template | `chat_template_fingerprint(tok, template_kwargs)` | the template text or its arguments |
| token rows | `rows_fingerprint(rows)` | any row's input_ids or loss_mask, or their order |
| target weights | `weights_fingerprint(model)` | the config, any parameter's name/shape/dtype, first/last values |

All are sha256 hex digests (64 characters). They identify inputs; they are not a security measure.

The files a command writes as a set (a prepared dataset, an evaluation's report) are checksummed
the same way: `file_checksums` records the size and sha256 of each in its manifest's "files", and
`verify_files` checks them before anything is read, naming the first file that is missing, cut off
or altered.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .errors import CorruptFileError
from .io import atomic_write_json

_BLOCK = 1 << 22  # 4 MiB reads


def digest(*parts) -> str:
    """sha256 of `parts` (bytes as they are, anything else as str(...)), separated by NUL bytes."""
    h = hashlib.sha256()
    for i, p in enumerate(parts):
        if i:
            h.update(b"\0")
        h.update(p if isinstance(p, bytes) else str(p).encode())
    return h.hexdigest()


def sha256_file(path: str | Path, memo_dir: str | Path | None = None) -> str:
    """sha256 of a file's bytes, read in 4 MiB blocks.

    `memo_dir`: remember the digest per (resolved path, size, mtime_ns) in memo_dir/hashes.json, so
    a large unchanged source is hashed once per machine (the memo is written atomically).

    Raises:
        FileNotFoundError: the file does not exist.
    """
    path = Path(path)
    key = None
    if memo_dir is not None:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        memo_path = Path(memo_dir) / "hashes.json"
        try:
            memo = json.loads(memo_path.read_text())
        except (OSError, ValueError):
            memo = {}
        if key in memo:
            return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    value = h.hexdigest()
    if key is not None:
        memo[key] = value
        atomic_write_json(memo_path, memo, indent=None)
    return value


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's serialised model (vocabulary, merges, normaliser, pre-tokeniser,
    added and special tokens), without the call-time truncation/padding state; for a slow
    (Python) tokenizer, of the vocabulary sorted by id and the special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        trunc, pad = backend.truncation, backend.padding
        backend.no_truncation()
        backend.no_padding()
        try:
            blob = backend.to_str()
        finally:
            if trunc:
                backend.enable_truncation(**trunc)
            if pad:
                backend.enable_padding(**{k: v for k, v in pad.items() if k != "length" or v is not None})
        return hashlib.sha256(blob.encode()).hexdigest()
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return digest(json.dumps(vocab), json.dumps(list(getattr(tokenizer, "all_special_tokens", []))))


def chat_template_fingerprint(tokenizer, template_kwargs: dict | None = None) -> str:
    """sha256 of the tokenizer's chat template and of the arguments every rendering passes to it
    (`data.template_kwargs`, e.g. {enable_thinking: false}): the same template with other
    arguments renders other text, so it is another template."""
    tpl = getattr(tokenizer, "chat_template", None)
    tpl = tpl if isinstance(tpl, str) else repr(tpl)
    kw = repr(sorted((template_kwargs or {}).items()))
    return hashlib.sha256((tpl + "\0" + kw).encode()).hexdigest()


def rows_fingerprint(rows) -> str:
    """sha256 of every token row's input_ids (int32) and loss_mask (int8), in order.

    `rows`: a mapping (or `datasets.Dataset`) with columns "input_ids" and "loss_mask", lists of
    ints of equal length per row. A `datasets.Dataset` is read as Arrow batches of 1,024 rows
    without building Python lists (the same digest); the cost is then sha256 over ~5 bytes a token."""
    import numpy as np

    h = hashlib.sha256()
    if hasattr(rows, "with_format") and hasattr(rows, "iter"):  # a datasets.Dataset (its indices mapping honoured)
        import pyarrow.compute as pc

        for batch in rows.with_format("arrow").iter(batch_size=1024):
            ids, mask = batch.column("input_ids").combine_chunks(), batch.column("loss_mask").combine_chunks()
            ends = np.cumsum(pc.list_value_length(ids).to_numpy(zero_copy_only=False)).tolist()
            flat_ids = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
            flat_mask = mask.flatten().to_numpy(zero_copy_only=False).astype(np.int8, copy=False)
            start = 0
            for end in ends:
                h.update(flat_ids[start:end].tobytes())
                h.update(flat_mask[start:end].tobytes())
                h.update(b"|")
                start = end
        return h.hexdigest()
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"]):
        h.update(np.asarray(ids, dtype=np.int32).tobytes())
        h.update(np.asarray(mask, dtype=np.int8).tobytes())
        h.update(b"|")
    return h.hexdigest()


def weights_fingerprint(model, sample: int = 4096) -> str:
    """sha256 of a model's config and of every parameter/buffer's name, shape, dtype and first and
    last `sample` values (cheap for large targets; a retrained or re-quantised model changes it)."""
    h = hashlib.sha256(json.dumps(model.config.to_diff_dict(), sort_keys=True, default=str).encode())
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().flatten()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        for part in (flat[:sample], flat[-sample:]):
            h.update(part.float().cpu().numpy().tobytes())
    return h.hexdigest()


def file_checksums(directory: str | Path, names: list[str]) -> dict:
    """{relative path: {"bytes", "sha256"}} of every file under the entries `names` of directory
    (files, or directories walked recursively), for a manifest's "files"."""
    d = Path(directory)
    out = {}
    for name in names:
        p = d / name
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                out[f.relative_to(d).as_posix()] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    return out


def verify_files(directory: str | Path, manifest: dict, *, writer: str, fix: str, where: str | Path | None = None) -> None:
    """Check the files recorded in the manifest's "files" (`file_checksums`): present, their size,
    then their sha256 (only the files recorded are read: for a prepared dataset, rows/state.json
    names the Arrow files of the rows, so other files there, such as `datasets`' cache files, are
    not). A manifest without "files" (older versions) is not checked. `where`: the file holding the
    manifest (default directory/manifest.json); `writer`: the command that writes the files, and
    `fix` the one that rebuilds them, for the messages.

    Raises:
        CorruptFileError: naming the first file that is missing, cut off or altered, and `fix`.
    """
    files = manifest.get("files")
    if not files:
        return
    d = Path(directory)
    where = f"{where or d / 'manifest.json'}"
    for rel, rec in files.items():
        f = d / rel
        if not f.is_file():
            raise CorruptFileError(f"{f}: missing (recorded in {where}). Fix: {fix}.")
        size = f.stat().st_size
        if size != rec["bytes"]:
            raise CorruptFileError(f"{f}: {size} bytes, {where} records {rec['bytes']}: the file is cut off or was "
                                   f"rewritten by another {writer}. Fix: {fix}.")
        if sha256_file(f) != rec["sha256"]:
            raise CorruptFileError(f"{f}: its sha256 differs from {where}: the file was altered or rewritten by "
                                   f"another {writer}. Fix: {fix}.")
