"""The manifest of a prepared dataset, and the check that training's target matches it.

manifest.json records what the rows depend on: the source files and their sha256, the tokenizer
(sha256 of its serialised vocabulary/merges/specials), the chat template and its arguments, the
target vocabulary size, max_length, min_supervised_tokens, the draft vocabulary (size, sha256 of the
chosen ids, coverage), the mask token, and the counts of the summary. `save_prepared` adds "files":
the size and sha256 of every file it wrote (rows/, packed/, draft_vocab.safetensors, summary.json),
which `provenance.verify_files` checks before anything is read: a cut or altered file, or rows written by a
later run that was killed before its manifest, is refused with the file named.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CorruptFileError, UserError, read_json
from ..provenance import chat_template_fingerprint, digest, sha256_file, tokenizer_fingerprint

MANIFEST_VERSION = 1


class ManifestMismatchError(UserError, ValueError):
    """Prepared data that was made for another target/tokenizer/template/settings than the one given."""


def build_manifest(*, sources: list[dict], tokenizer, template_kwargs: dict | None, target_vocab_size: int,
                   max_length: int, min_supervised_tokens: int, draft_ids, coverage: float, mask_token_id: int,
                   mask_token_source: str, counts: dict, tokenizer_sha256: str | None = None) -> dict:
    """The manifest dict (see the module docstring); tokenizer_sha256: `tokenizer_fingerprint` if known."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "sources": sources,
        "tokenizer": {"name_or_path": getattr(tokenizer, "name_or_path", ""), "sha256": tokenizer_sha256 or tokenizer_fingerprint(tokenizer),
                      "len": len(tokenizer)},
        "chat_template": {"sha256": chat_template_fingerprint(tokenizer, template_kwargs),
                          "template_kwargs": dict(template_kwargs or {})},
        "target_vocab_size": int(target_vocab_size),
        "max_length": int(max_length),
        "min_supervised_tokens": int(min_supervised_tokens),
        "draft_vocab": draft_vocab_entry(draft_ids, coverage),
        "mask_token_id": int(mask_token_id),
        "mask_token_source": mask_token_source,
        "counts": counts,
    }


def draft_vocab_entry(draft_ids, coverage: float, source: str | None = None) -> dict:
    """The manifest's "draft_vocab": its size, the sha256 of its ids, its coverage of the supervised
    tokens and, for a vocabulary not built from the data, its `source`."""
    ids = [int(x) for x in draft_ids]
    return {"size": len(ids), "sha256": digest(json.dumps(ids)), "coverage": coverage,
            **({"source": source} if source else {})}


def check_manifest(manifest: dict, tokenizer, target_vocab_size: int, *, template_kwargs: dict | None = None,
                   max_length: int | None = None, draft_vocab_size: int | None = None,
                   mask_token_id: int | None = None, where: str = "the prepared data") -> None:
    """Refuse prepared data whose manifest does not match the target and settings given to training.

    Compared: tokenizer sha256, chat template (+ arguments) sha256, target vocabulary size, and, when
    given, max_length, draft_vocab_size and mask_token_id.

    Raises:
        ManifestMismatchError: one line per mismatch (manifest value vs. the given one) and the fix.
    """
    problems = []

    def differ(name, have, want):
        if have != want:
            problems.append(f"  {name}: prepared with {have!r}, training gives {want!r}")

    differ("tokenizer sha256", manifest.get("tokenizer", {}).get("sha256"), tokenizer_fingerprint(tokenizer))
    differ("chat template sha256 (template + template_kwargs)", manifest.get("chat_template", {}).get("sha256"),
           chat_template_fingerprint(tokenizer, template_kwargs))
    differ("target vocabulary size", manifest.get("target_vocab_size"), int(target_vocab_size))
    if max_length is not None:
        differ("max_length", manifest.get("max_length"), int(max_length))
    if draft_vocab_size is not None:
        differ("draft_vocab_size", manifest.get("draft_vocab", {}).get("size"), int(draft_vocab_size))
    if mask_token_id is not None:
        differ("mask_token_id", manifest.get("mask_token_id"), int(mask_token_id))
    if problems:
        raise ManifestMismatchError(
            f"{where} does not match the target given to training:\n" + "\n".join(problems) +
            "\nFix: prepare the data again for this target (peagle prepare with the same target.* "
            "and data.* settings), or point data.prepared_dir at data prepared for it.")


def rebuild_fix(prepared_dir) -> str:
    """The command that rebuilds a prepared directory (the Fix: of its errors)."""
    return (f"prepare it again: peagle prepare output_dir={prepared_dir} with the target.* and data.* settings "
            "(or the recipe) it was made with")


def read_manifest(prepared_dir: str | Path) -> dict:
    """manifest.json of a prepared directory.

    Raises:
        FileNotFoundError: no manifest.json (not a prepared directory, or a prepare that was stopped
            before its last step, which writes the manifest), naming the directory and the fix.
        CorruptFileError: manifest.json is cut off or not a manifest.
    """
    p = Path(prepared_dir) / "manifest.json"
    if not p.is_file():
        if (Path(prepared_dir) / "rows").exists():
            raise FileNotFoundError(f"{p} not found: {prepared_dir} holds rows/ without a manifest (a prepare that "
                                    f"was stopped before it finished). Fix: {rebuild_fix(prepared_dir)}.")
        raise FileNotFoundError(f"{p} not found: {prepared_dir} is not a prepared dataset directory. "
                                "Fix: run peagle prepare output_dir=<dir> first.")
    return read_json(p, "manifest of the prepared data", required=("target_vocab_size", "mask_token_id", "draft_vocab"),
                     fix=rebuild_fix(prepared_dir))


# --- the output of `peagle regenerate` -----------------------------------------------------------------
# regenerated.jsonl is appended to batch by batch (resumable), so it cannot be written as a whole;
# its sidecar <file>.manifest (JSON, written atomically) says whether the run finished and, when it
# did, the file's size and sha256. The readers of data (`sources.load_source`) check it.


def regenerated_manifest_path(path: str | Path) -> Path:
    """The sidecar manifest of a `peagle regenerate` output file: <file>.manifest beside it."""
    path = Path(path)
    return path.with_name(path.name + ".manifest")


def regenerate_fix(path: str | Path, command: str | None = None) -> str:
    """The command that finishes or rebuilds a regenerated file (the Fix: of its errors)."""
    how = command or f"peagle regenerate regenerate.output={path} with the settings it was made with"
    return f"rerun {how}: it keeps the complete conversations of {path} and regenerates the rest"


def read_regenerated_manifest(path: str | Path) -> dict | None:
    """The sidecar manifest of regenerated file `path`, or None when there is none (a file written by
    hand, or by a version that wrote none: not checked).

    Raises:
        CorruptFileError: the manifest is cut off or not one, naming it and the fix.
    """
    m = regenerated_manifest_path(path)
    if not m.is_file():
        return None
    return read_json(m, "manifest of a peagle regenerate output", required=("complete", "conversations", "bytes"),
                     fix=f"remove it and {regenerate_fix(path)}")


def check_regenerated(path: str | Path, sha256: str | None = None) -> None:
    """Refuse a `peagle regenerate` output that its sidecar manifest does not vouch for: a run that
    has not finished (stopped between two batches, or before its last write), or a file whose size or
    sha256 (`sha256`: the file's, when the caller has it) differs from what the finished run recorded
    (cut off, or altered since). A file without a sidecar is not checked.

    Raises:
        CorruptFileError: naming the file, what is wrong and the command that finishes or rebuilds it.
    """
    path = Path(path)
    m = read_regenerated_manifest(path)
    if m is None:
        return
    where, fix = regenerated_manifest_path(path), regenerate_fix(path, m.get("command"))
    if not m["complete"]:
        raise CorruptFileError(f"{path}: an unfinished peagle regenerate output ({where} records the run as not "
                               f"finished: stopped after {m['conversations']} conversations). Fix: {fix}.")
    size = path.stat().st_size
    if size != m["bytes"]:
        raise CorruptFileError(f"{path}: {size} bytes, {where} records {m['bytes']}: the file is cut off or was "
                               f"changed after peagle regenerate finished it. Fix: {fix}.")
    if m.get("sha256") and (sha256 or sha256_file(path)) != m["sha256"]:
        raise CorruptFileError(f"{path}: its sha256 differs from {where}: the file was altered after peagle "
                               f"regenerate finished it. Fix: remove it and {where.name}, then {fix}.")
