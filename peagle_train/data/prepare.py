"""Conversation sources → token rows + draft vocabulary + mask token + manifest, with a summary of every drop.

Pipeline (each stage a `datasets` transform, cached by fingerprint under `cache_dir`, so a second run
with the same inputs reads Arrow files and tokenises nothing):
  load_source (normalised conversations) → keep the normalisable ones → shuffle(seed) → tokenise and
  mask (chat template, `num_proc` workers) in chunks until `num_conversations` rows are kept → mix the
  sources by weight → draft vocabulary from token counts → mask token → manifest.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch

from ..errors import ConfigError, CorruptFileError, load_safetensors, read_json, writing
from ..io import atomic_dir, atomic_path, atomic_write_json
from ..provenance import chat_template_fingerprint, digest, file_checksums, tokenizer_fingerprint, verify_files
from .conversations import DataFileError
from .manifest import build_manifest, check_manifest, draft_vocab_entry, read_manifest, rebuild_fix
from .sources import NORMALIZE_VERSION, check_data_path, default_cache_dir, load_source, source_info_dict
from .template import (TemplateError, cut_at_end_of_turn_token, end_of_turn_strings, set_chat_template,
                       tokenize_conversation)
from .vocab import DraftVocab, choose_mask_token, draft_vocab_from_counts, mask_token_source, validate_mask_token

logger = logging.getLogger(__name__)

TOKENIZE_VERSION = "4"  # bump when tokenisation/masking changes: invalidates cached token rows


@dataclass
class PreparedData:
    """Training rows (a `datasets.Dataset` with input_ids, loss_mask, source), the draft vocabulary,
    the validated mask token, the summary counts and the manifest of this preparation."""

    rows: datasets.Dataset
    vocab: DraftVocab
    mask_token_id: int
    summary: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)


def prepare_from_config(dcfg, tokenizer, target_vocab_size: int, *, seed: int = 0) -> PreparedData:
    """`prepare_data` for the `data` config group (config.py `DataConfig`): every key is passed by
    its name, so the entry points (train, prepare, features) read the same rows from the same
    settings. Raises what `prepare_data` raises."""
    from omegaconf import OmegaConf

    def plain(x):
        return OmegaConf.to_container(x) if OmegaConf.is_config(x) else x

    check_regenerate_stage(dcfg)
    return prepare_data(dcfg.path, tokenizer, target_vocab_size, num_conversations=dcfg.num_conversations,
                        max_length=dcfg.max_length, min_supervised_tokens=dcfg.min_supervised_tokens,
                        draft_vocab_size=dcfg.draft_vocab_size, mask_token_id=dcfg.mask_token_id, seed=seed,
                        mix=plain(dcfg.mix) or None, num_proc=dcfg.num_proc, cache_dir=dcfg.cache_dir,
                        chat_template=dcfg.chat_template, template_kwargs=plain(dcfg.template_kwargs) or None)


def check_regenerate_stage(dcfg) -> None:
    """A config naming data.sources reads them in its regenerate stage, whose output is data.path:
    raise DataFileError, naming the command that writes it, when data.path does not exist yet."""
    from ..paths import resolve_path

    if not dcfg.get("sources") or dcfg.get("mix") or not str(dcfg.path or "").strip():
        return
    if not resolve_path(str(dcfg.path)).exists():
        raise DataFileError(f"data.path={dcfg.path} does not exist yet: it is the output of the regenerate stage, which "
                            f"reads data.sources ({len(dcfg.sources)} datasets). Fix: run that stage first, with the "
                            f"same recipe: peagle regenerate recipe=NAME regenerate.backend=vllm "
                            f"regenerate.output={dcfg.path} (docs/TRAINING.md), or set data.path to conversations "
                            "of your own.")


def data_from_config(dcfg, tokenizer, target_vocab_size: int, *, seed: int = 0) -> PreparedData:
    """The rows of the `data` config group as every stage reads them (train, features): the directory
    `data.prepared_dir` when set (`load_prepared`, refused when its manifest disagrees with the
    tokenizer, the template with its `template_kwargs`, max_length, draft_vocab_size or mask_token_id),
    else `prepare_from_config`. Raises what those raise."""
    if not dcfg.prepared_dir:
        return prepare_from_config(dcfg, tokenizer, target_vocab_size, seed=seed)
    from omegaconf import OmegaConf

    kwargs = OmegaConf.to_container(dcfg.template_kwargs) if OmegaConf.is_config(dcfg.template_kwargs) \
        else dcfg.template_kwargs
    return load_prepared(dcfg.prepared_dir, tokenizer, target_vocab_size, template_kwargs=kwargs,
                         chat_template=dcfg.chat_template, max_length=dcfg.max_length,
                         draft_vocab_size=dcfg.draft_vocab_size, mask_token_id=dcfg.mask_token_id)


def prepare_data(
    path,
    tokenizer,
    target_vocab_size: int,
    *,
    num_conversations: int | None,
    max_length: int,
    min_supervised_tokens: int,
    draft_vocab_size: int,
    mask_token_id: int | None = None,
    seed: int = 0,
    mix: list | None = None,
    num_proc: int | None = None,
    cache_dir: str | Path | None = None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> PreparedData:
    """Read, normalise, render, tokenise and mask conversations; build d2t/t2d, the mask token, a manifest.

    path: one source (file or dataset directory), used when `mix` is empty. mix: a list of
    {path, weight} sources; rows are taken in proportion to the weights (with num_conversations None:
    the largest mix with those proportions that uses no row twice). Conversations of each source are
    shuffled with `seed` and taken until its share is kept. Rows are cut at `max_length` tokens
    (counted); a row with fewer than `min_supervised_tokens` assistant tokens is dropped (counted).
    chat_template: a Jinja string or file replacing the tokenizer's; template_kwargs: passed to the
    template at every rendering (e.g. {"enable_thinking": False}); both are part of the manifest.

    Raises:
        DataFileError: a source is missing or unreadable, none of its records is a conversation
            (names its keys), or none of its rows survives tokenisation (names the reasons and the
            setting, e.g. data.min_supervised_tokens); each names the file and the fix.
        MissingChatTemplateError: no chat template (names the option data.chat_template).
        ConfigError (a ValueError): an invalid data.mask_token_id (how often the data uses it) or
            data.draft_vocab_size.
    """
    if chat_template or getattr(tokenizer, "chat_template", None):
        set_chat_template(tokenizer, chat_template)
    template_kwargs = dict(template_kwargs or {})
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    specs = _source_specs(path, mix)
    tok_sha = tokenizer_fingerprint(tokenizer)
    tok_key = _tokenize_key(tokenizer, template_kwargs, max_length, min_supervised_tokens, target_vocab_size, tok_sha)
    record = _prepared_record(cache, specs, tok_key, num_conversations, seed, draft_vocab_size, mask_token_id)
    kwargs = {"tokenizer": tokenizer, "max_length": max_length, "min_supervised_tokens": min_supervised_tokens,
              "vocab_size": target_vocab_size, "template_kwargs": template_kwargs}
    dropped, changed = Counter(), Counter()
    shares = _shares(num_conversations, [s["weight"] for s in specs])
    kept_sets, infos, read, tokenised = _tokenise_sources(specs, shares, cache, tokenizer, kwargs, tok_key,
                                                          num_proc, seed, dropped, changed)
    rows = _mix(kept_sets, shares, specs, seed)
    if len(rows) == 0 or any(len(k) == 0 for _, k in kept_sets):
        empty = [s["path"] for s, k in kept_sets if len(k) == 0]
        raise DataFileError(no_row_message(", ".join(empty), dropped, min_supervised_tokens))
    keys = row_keys(rows)
    duplicates = len(keys) - len(set(keys))
    if duplicates:
        logger.info("%d of %d rows repeat an earlier row exactly (the same conversation twice): kept, counted as "
                    "duplicate_conversations; a validation split keeps each with its twins", duplicates, len(rows))
    sup, allc = token_counts(rows, target_vocab_size)
    vocab = draft_vocab_from_counts(sup, allc, draft_vocab_size)
    nz = torch.nonzero(allc).flatten()
    used = dict(zip(nz.tolist(), allc[nz].tolist()))  # id -> occurrences
    if mask_token_id is None:
        mask_token_id = choose_mask_token(tokenizer, used, target_vocab_size)
    validate_mask_token(mask_token_id, target_vocab_size, used, set(tokenizer.all_special_ids))
    summary = _prepare_summary(specs, infos, read, tokenised, rows, duplicates, dropped, changed, sup, allc, vocab,
                               mask_token_id, tokenizer)
    manifest = build_manifest(
        sources=infos, tokenizer=tokenizer, template_kwargs=template_kwargs, target_vocab_size=target_vocab_size,
        max_length=max_length, min_supervised_tokens=min_supervised_tokens, draft_ids=vocab.draft_ids.tolist(),
        coverage=vocab.coverage, mask_token_id=mask_token_id,
        mask_token_source=mask_token_source(tokenizer, mask_token_id),
        counts={k: summary[k] for k in ("conversations_read", "conversations_kept", "tokens", "supervised_tokens")},
        tokenizer_sha256=tok_sha)
    if record is not None:  # this node's cache now holds these rows: `prepared_in_cache` answers yes
        atomic_write_json(record, {k: summary[k] for k in ("conversations_kept", "tokens")})
    return PreparedData(rows, vocab, int(mask_token_id), summary, manifest)


def _tokenize_key(tokenizer, template_kwargs: dict, max_length: int, min_supervised_tokens: int,
                  target_vocab_size: int, tok_sha: str | None = None) -> str:
    """The part of the token rows' cache key that the tokenizer, its chat template (with
    `template_kwargs`) and the row settings decide (32 hex characters)."""
    return digest(tok_sha or tokenizer_fingerprint(tokenizer), chat_template_fingerprint(tokenizer, template_kwargs),
                  max_length, min_supervised_tokens, target_vocab_size, TOKENIZE_VERSION)[:32]


def _prepared_record(cache: Path, specs: list[dict], tok_key: str, num_conversations: int | None, seed: int,
                     draft_vocab_size: int, mask_token_id: int | None) -> Path | None:
    """cache/prepared/<key>.json: written when `prepare_data` has finished these inputs in this cache
    (the source files by path, size and modification time, the tokenisation, the row count, seed,
    draft vocabulary and mask token), so that a later run can tell a cache hit before preparing.
    None when a source file is missing (nothing was prepared from it)."""
    listing = []
    for spec in specs:
        root = Path(spec["path"])
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else []
        if not files:
            return None
        listing += [f"{f}|{f.stat().st_size}|{f.stat().st_mtime_ns}|{spec['weight']}" for f in files]
    key = digest("\n".join(listing), tok_key, num_conversations, seed, draft_vocab_size, mask_token_id,
                 NORMALIZE_VERSION)[:32]
    return cache / "prepared" / f"{key}.json"


def prepared_in_cache(dcfg, tokenizer, target_vocab_size: int, *, seed: int = 0) -> bool:
    """Whether `prepare_from_config(dcfg, ...)` would find its rows in data.cache_dir: a finished
    preparation of the same inputs left its record there (`_prepared_record`; a changed source file
    or setting is a miss). Applies data.chat_template to `tokenizer`, as preparing does. A miss
    means a cold preparation (tokenising every row with data.num_proc workers)."""
    from omegaconf import OmegaConf

    def plain(x):
        return OmegaConf.to_container(x) if OmegaConf.is_config(x) else x

    if dcfg.chat_template or getattr(tokenizer, "chat_template", None):
        set_chat_template(tokenizer, dcfg.chat_template)
    cache = Path(dcfg.cache_dir) if dcfg.cache_dir else default_cache_dir()
    tok_key = _tokenize_key(tokenizer, dict(plain(dcfg.template_kwargs) or {}), dcfg.max_length,
                            dcfg.min_supervised_tokens, target_vocab_size)
    record = _prepared_record(cache, _source_specs(dcfg.path, plain(dcfg.mix) or None), tok_key,
                              dcfg.num_conversations, seed, dcfg.draft_vocab_size, dcfg.mask_token_id)
    return record is not None and record.is_file()


def _tokenise_sources(specs: list[dict], shares: list[int | None], cache: Path, tokenizer, kwargs: dict,
                      tok_key: str, num_proc, seed: int, dropped: Counter,
                      changed: Counter) -> tuple[list, list[dict], int, int]:
    """Each source of `specs` read (`load_source`), its normalisable conversations kept, shuffled
    with `seed` and tokenised until its share is kept (`_tokenise_until`); adds drops/changes to the
    counters.

    Returns (kept_sets [(spec, kept rows)], source infos (with their weight), conversations read,
    conversations tokenised). Raises DataFileError when no record of a source is a conversation
    (names its reasons and keys), MissingChatTemplateError when there are conversations to render
    and no chat template."""
    infos, kept_sets = [], []
    read = tokenised = 0
    for spec, share in zip(specs, shares):
        ds, info = load_source(spec["path"], cache)
        logger.info(info.summary())
        infos.append({**source_info_dict(info), "weight": spec["weight"]})
        read += info.records
        drops = ds.select_columns(["drop", "changes"]).to_dict()
        dropped.update(d for d in drops["drop"] if d)
        changed.update(c for cs in drops["changes"] for c in cs)
        valid = ds.filter(_is_kept, input_columns="drop", desc="keeping normalised conversations")
        if len(valid) == 0:
            raise DataFileError(no_conversation_message(info, Counter(d for d in drops["drop"] if d)))
        if not getattr(tokenizer, "chat_template", None) and any(len(x) == 0 for x in valid["input_ids"]):
            set_chat_template(tokenizer, None)  # conversations to render and no template: the error names the fix
        valid = valid.shuffle(seed=seed)
        kept, n_tok = _tokenise_until(valid, share, kwargs, tok_key, num_proc, dropped, changed)
        tokenised += n_tok
        kept_sets.append((spec, kept))
    return kept_sets, infos, read, tokenised


def _prepare_summary(specs: list[dict], infos: list[dict], read: int, tokenised: int, rows: datasets.Dataset,
                     duplicates: int, dropped: Counter, changed: Counter, sup: torch.Tensor, allc: torch.Tensor,
                     vocab: DraftVocab, mask_token_id: int, tokenizer) -> dict:
    """`PreparedData.summary`: the counts of every stage (records, conversations, drops and changes
    by reason, tokens), the draft vocabulary and the mask token. sup, allc: supervised and all
    token counts per target id [V] (`token_counts`)."""
    return {
        "file": ", ".join(str(s["path"]) for s in specs),
        "records_in_file": read + sum(i["malformed_records"] for i in infos),
        "file_truncated": any(i["truncated"] for i in infos),
        "malformed_records_skipped": sum(i["malformed_records"] for i in infos),
        "malformed_by_reason": dict(sum((Counter(i["malformed_by_reason"]) for i in infos), Counter())),
        "conversations_read": read,
        "conversations_tokenised": tokenised,
        "conversations_kept": len(rows),
        "duplicate_conversations": duplicates,
        "dropped": dict(dropped),
        "changed": dict(changed),
        "tokens": int(allc.sum()),
        "supervised_tokens": int(sup.sum()),
        "draft_vocab_size": len(vocab.draft_ids),
        "draft_vocab_coverage": vocab.coverage,
        "mask_token_id": int(mask_token_id),
        "mask_token": tokenizer.convert_ids_to_tokens(int(mask_token_id)) if mask_token_id < len(tokenizer) else None,
    }


def no_conversation_message(info, dropped: Counter) -> str:
    """Why no record of a source could be normalised, with its reasons, its keys and the fix."""
    reasons = ", ".join(f"{r}: {c}" for r, c in dropped.most_common(5))
    keys = f" Its records have the keys {info.unrecognised_keys} (first such record)." if info.unrecognised_keys else ""
    return (f"{info.path}: none of its {info.records} records is a trainable conversation ({reasons}).{keys} "
            "Fix: give records with 'conversations' (ShareGPT: from/value turns), 'messages' (OpenAI: role/content "
            "turns), 'data' (UltraChat: alternating strings) or 'input_ids' + 'loss_mask', with user and "
            "assistant turns (README, Data rules).")


def no_row_message(paths: str, dropped: Counter, min_supervised_tokens: int) -> str:
    """Why no tokenised row of `paths` survives, naming the setting behind the short-answer drops."""
    reasons = ", ".join(f"{r}: {c}" for r, c in dropped.most_common(5))
    fix = (f"Fix: lower data.min_supervised_tokens (now {min_supervised_tokens}; answers shorter than that many "
           "tokens are dropped) or use data with longer answers."
           if dropped.get(f"fewer than {min_supervised_tokens} supervised tokens")
           else "Fix: see the reasons, and README, Data rules.")
    return f"No trainable row in {paths} (drops by reason: {reasons}). {fix}"


def _source_specs(path, mix) -> list[dict]:
    from ..paths import resolve_path

    if mix:
        specs = []
        for i, m in enumerate(mix):
            m = dict(m)
            if "path" not in m:
                raise ValueError(f"data.mix[{i}] has no 'path'. Fix: write entries as {{path: FILE, weight: W}}.")
            check_data_path(m["path"], f"data.mix[{i}].path")
            w = float(m.get("weight", 1.0))
            if not w > 0:
                raise ValueError(f"data.mix[{i}] ({m['path']}): weight={w} must be > 0.")
            specs.append({"path": str(resolve_path(str(m["path"]))), "weight": w})
        return specs
    check_data_path(path)
    return [{"path": str(resolve_path(str(path))), "weight": 1.0}]


def _shares(total: int | None, weights: list[float]) -> list[int | None]:
    """Rows wanted per source: total split by weight (largest remainder); None = all (decided later)."""
    if total is None:
        return [None] * len(weights)
    raw = [total * w / sum(weights) for w in weights]
    n = [math.floor(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: n[i] - raw[i])[: total - sum(n)]:
        n[i] += 1
    return n


def _is_kept(drop: str) -> bool:
    return drop == ""


def _tokenise_until(valid: datasets.Dataset, want: int | None, kwargs: dict, tok_key: str, num_proc,
                    dropped: Counter, changed: Counter) -> tuple[datasets.Dataset, int]:
    """Tokenise `valid` in growing chunks until `want` rows are kept (all rows for want None).
    Returns (kept rows, number of conversations tokenised); adds drops/changes to the counters."""
    chunks, kept_n, start = [], 0, 0
    size = len(valid) if want is None else min(len(valid), max(64, int(want * 1.15) + 16))
    while start < len(valid) and (want is None or kept_n < want):
        end = min(len(valid), start + size)
        part = valid.select(range(start, end))
        procs = num_proc if num_proc and num_proc > 1 and end - start >= 256 else None
        tok = part.map(_tokenise_batch, batched=True, batch_size=64, fn_kwargs=kwargs, num_proc=procs,
                       remove_columns=["messages"], new_fingerprint=digest(part._fingerprint, tok_key)[:32],
                       desc="tokenising and masking")
        cols = tok.select_columns(["drop", "changes"]).to_dict()
        dropped.update(d for d in cols["drop"] if d)
        changed.update(c for cs in cols["changes"] for c in cs)
        k = tok.filter(_is_kept, input_columns="drop", desc="keeping rows")
        chunks.append(k)
        kept_n += len(k)
        start, size = end, size * 2
    if not chunks:  # nothing to tokenise
        return valid.remove_columns(["messages"]), 0
    kept = datasets.concatenate_datasets(chunks) if len(chunks) > 1 else chunks[0]
    if want is not None and len(kept) > want:
        kept = kept.select(range(want))
    return kept, start


def _tokenise_batch(batch: dict, tokenizer, max_length: int, min_supervised_tokens: int, vocab_size: int,
                    template_kwargs: dict) -> dict:
    """datasets.map worker: messages → input_ids, loss_mask; pre-tokenised rows pass through (cut at
    max_length). Sets `drop` to the reason a row cannot be trained on, and records this stage's changes
    (an assistant turn holding an end-of-turn token, see `cut_at_end_of_turn_token`; the cut at
    max_length; history turns the template rewrites)."""
    out = {"input_ids": [], "loss_mask": [], "drop": [], "changes": []}
    eot = end_of_turn_strings(tokenizer)
    for msgs, ids, mask, drop in zip(batch["messages"], batch["input_ids"], batch["loss_mask"], batch["drop"]):
        changes = []  # only this stage's: the normalisation changes were counted when the source was read
        if not drop and msgs:
            msgs, drop, cut_at = cut_at_end_of_turn_token(msgs, eot)
            if cut_at:
                changes.append(cut_at)
        if not drop and msgs:
            try:
                row = tokenize_conversation(tokenizer, msgs, max_length, template_kwargs)
                ids, mask = row.input_ids, row.loss_mask
                changes += ["cut at max_length"] * row.cut
                changes += ["history turn rendered differently from its generation"] * row.rewritten_turns
            except TemplateError:
                drop, ids, mask = "chat template cannot place the loss mask", [], []
        elif not drop:  # pre-tokenised: unchanged, except the cut at max_length
            if max(ids) >= vocab_size:
                drop = f"pre-tokenised row has a token id >= the target vocabulary ({vocab_size})"
            elif len(ids) > max_length:
                ids, mask = ids[:max_length], mask[:max_length]
                changes.append("cut at max_length")
        if not drop and sum(mask) < min_supervised_tokens:
            drop = f"fewer than {min_supervised_tokens} supervised tokens"
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["drop"].append(drop)
        out["changes"].append(changes)
    return out


def _mix(kept_sets, shares, specs, seed: int) -> datasets.Dataset:
    """Concatenate each source's share (with a `source` column naming the record), shuffled if several."""
    if shares[0] is None and len(kept_sets) > 1:  # all data: the largest exact-proportion mix
        scale = min(len(k) / s["weight"] for s, k in kept_sets)
        shares = [math.floor(scale * s["weight"]) for s in specs]
    parts = []
    for (spec, kept), share in zip(kept_sets, shares):
        n = len(kept) if share is None else min(share, len(kept))
        if share is not None and 0 < n < share:
            logger.info(f"{spec['path']}: only {len(kept)} trainable rows for a share of {share}; using all of them")
        part = kept.select(range(n))
        if len(kept_sets) > 1:  # a mix: the source column names the file too
            prefix = f"{Path(spec['path']).stem}:"
            part = part.map(lambda b: {"source": [prefix + i for i in b["id"]]}, batched=True,
                            new_fingerprint=digest(part._fingerprint, "source", prefix)[:32], desc="naming rows")
        else:
            part = part.rename_column("id", "source")
        parts.append(part.select_columns(["input_ids", "loss_mask", "source"]))
    rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    return rows.shuffle(seed=seed) if len(parts) > 1 else rows


def row_keys(rows) -> list[int]:
    """One key per row of `rows` (a Dataset, or a dict of lists, with input_ids and loss_mask), equal
    for rows whose input_ids and loss_mask are equal: exact duplicates, the same conversation twice.
    A 64-bit hash of both lists; hashes of ints are not salted, so every process computes the same."""
    cols = rows.select_columns(["input_ids", "loss_mask"]).to_dict() if hasattr(rows, "select_columns") else rows
    return [hash((tuple(i), tuple(m))) for i, m in zip(cols["input_ids"], cols["loss_mask"])]


def token_counts(rows: datasets.Dataset, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(supervised, all) token counts over rows: two [vocab_size] int64 tensors.

    Raises:
        ValueError: a token id is outside [0, vocab_size).
    """
    sup = np.zeros(vocab_size, dtype=np.int64)
    allc = np.zeros(vocab_size, dtype=np.int64)
    for batch in rows.select_columns(["input_ids", "loss_mask"]).with_format("arrow").iter(batch_size=4096):
        ids = _flat(batch["input_ids"]).astype(np.int64)
        m = _flat(batch["loss_mask"]).astype(bool)
        if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
            raise ValueError(f"token id {int(ids.max())} is outside the target vocabulary [0, {vocab_size})")
        allc += np.bincount(ids, minlength=vocab_size)
        sup += np.bincount(ids[m], minlength=vocab_size)
    return torch.from_numpy(sup), torch.from_numpy(allc)


def with_draft_ids(data: PreparedData, draft_ids: torch.Tensor, target_vocab_size: int, source: str) -> PreparedData:
    """`data` with the draft vocabulary `draft_ids` ([V_draft] target ids: a head's own, from
    `source`, for data.draft_vocab_from_head) in place of the one built from its counts. The summary
    and the manifest give its size, its coverage of the data's supervised tokens, and its source.
    Raises ConfigError naming `source` when an id lies outside the target's vocabulary."""
    ids = torch.as_tensor(draft_ids, dtype=torch.long)
    if len(ids) and int(ids.max()) >= target_vocab_size:
        raise ConfigError(f"{source}: its draft vocabulary holds target ids up to {int(ids.max())}, beyond this "
                          f"target's vocabulary of {target_vocab_size}. Fix: target.path = the target the head was "
                          "trained for, or data.draft_vocab_from_head=false.")
    sup, _ = token_counts(data.rows, target_vocab_size)
    total = int(sup.sum())
    vocab = DraftVocab.from_ids(ids, target_vocab_size, float(sup[ids].sum()) / total if total else float("nan"))
    summary = {**data.summary, "draft_vocab_size": len(vocab.draft_ids), "draft_vocab_coverage": vocab.coverage,
               "draft_vocab_source": source}
    entry = draft_vocab_entry(vocab.draft_ids, vocab.coverage, source)
    return PreparedData(data.rows, vocab, data.mask_token_id, summary, {**data.manifest, "draft_vocab": entry})


def _flat(col) -> np.ndarray:
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return col.flatten().to_numpy(zero_copy_only=False)


def pack_rows(rows: datasets.Dataset, pack_length: int, max_length: int | None = None) -> datasets.Dataset:
    """Pack consecutive rows into training rows of at most `pack_length` tokens (greedy, in order).

    Returns a Dataset with input_ids [n], loss_mask [n] and document_ids [n] (0, 1, ... per document
    inside the packed row; attention must not cross documents, DESIGN.md §4).

    Raises:
        ValueError: pack_length < max_length (a row could not fit).
    """
    if max_length is not None and pack_length < max_length:
        raise ValueError(f"data.pack_length={pack_length} is shorter than data.max_length={max_length}; "
                         "a row could not fit. Fix: pack_length >= max_length.")
    out = {"input_ids": [], "loss_mask": [], "document_ids": []}
    cur = {"input_ids": [], "loss_mask": [], "document_ids": []}
    doc = 0
    for r in rows.select_columns(["input_ids", "loss_mask"]):
        n = len(r["input_ids"])
        if cur["input_ids"] and len(cur["input_ids"]) + n > pack_length:
            for k in out:
                out[k].append(cur[k])
            cur, doc = {"input_ids": [], "loss_mask": [], "document_ids": []}, 0
        cur["input_ids"] += r["input_ids"]
        cur["loss_mask"] += r["loss_mask"]
        cur["document_ids"] += [doc] * n
        doc += 1
    if cur["input_ids"]:
        for k in out:
            out[k].append(cur[k])
    return datasets.Dataset.from_dict(out)


def format_summary(summary: dict) -> str:
    """The data summary as an aligned two-column table."""
    lines = []
    for k, v in summary.items():
        if isinstance(v, dict):
            lines.append(f"  {k:<28} {sum(v.values()) if v else 0}")
            lines += [f"    - {r:<52} {c}" for r, c in sorted(v.items(), key=lambda x: -x[1])]
        elif isinstance(v, float):
            lines.append(f"  {k:<28} {v:.4f}")
        else:
            lines.append(f"  {k:<28} {v}")
    return "\n".join(lines)


def save_prepared(data: PreparedData, out_dir: str | Path, pack_length: int | None = None) -> None:
    """Write rows (Arrow), draft vocabulary (safetensors: d2t, t2d), summary.json and manifest.json
    to out_dir; with pack_length, also packed/ (see `pack_rows`).

    The manifest is removed first and written last, with the size and sha256 of every other file
    ("files"): a prepare stopped in between leaves no manifest (refused by `load_prepared`), never
    new rows beside an old manifest. rows/ and packed/ are each replaced as a whole directory.

    Raises:
        WriteError: an I/O failure (full disk, read-only, a file in the way) naming the file.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    with writing(out, "prepared data", note="the directory is left without a manifest, so no run reads it"):
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").unlink(missing_ok=True)
        with atomic_dir(out / "rows", overwrite=True) as tmp:
            data.rows.save_to_disk(str(tmp))
        with atomic_path(out / "draft_vocab.safetensors") as tmp:
            save_file({"d2t": data.vocab.d2t, "t2d": data.vocab.t2d}, str(tmp))
        names = ["rows", "draft_vocab.safetensors", "summary.json"]
        if pack_length:
            packed = pack_rows(data.rows, pack_length, data.manifest.get("max_length"))
            with atomic_dir(out / "packed", overwrite=True) as tmp:
                packed.save_to_disk(str(tmp))
            n = sum(len(x) for x in packed["input_ids"])
            data.summary["packed_rows"] = len(packed)
            data.summary["packing_fill"] = n / (len(packed) * pack_length)
            names.append("packed")
        atomic_write_json(out / "summary.json", data.summary)
        files = file_checksums(out, names)
        atomic_write_json(out / "manifest.json", {**data.manifest, "files": files})  # last: complete and checked


def load_prepared(prepared_dir: str | Path, tokenizer, target_vocab_size: int, *, template_kwargs: dict | None = None,
                  chat_template: str | None = None, max_length: int | None = None,
                  draft_vocab_size: int | None = None, mask_token_id: int | None = None) -> PreparedData:
    """Load a directory written by `save_prepared`, after checking its manifest against the target.

    Raises:
        FileNotFoundError: not a prepared directory (or one whose prepare was stopped).
        ManifestMismatchError: made for another tokenizer / template / vocabulary / settings (each
            difference named). CorruptFileError: a file that is cut off, altered or newer than the
            manifest (`verify_files`), named with the command that rebuilds the directory.
    """
    d = Path(prepared_dir)
    manifest = read_manifest(d)
    if chat_template:
        set_chat_template(tokenizer, chat_template)
    check_manifest(manifest, tokenizer, target_vocab_size, template_kwargs=template_kwargs, max_length=max_length,
                   draft_vocab_size=draft_vocab_size, mask_token_id=mask_token_id, where=str(d))
    fix = rebuild_fix(d)
    verify_files(d, manifest, writer="prepare", fix=fix)  # cut, altered or newer than the manifest: refused
    try:
        rows = datasets.load_from_disk(str(d / "rows"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{d / 'rows'}: missing (the token rows). Fix: {fix}.") from None
    except Exception as e:  # noqa: BLE001 - pyarrow / datasets raise several types for a cut Arrow file
        raise CorruptFileError(f"{d / 'rows'}: cannot read the token rows ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}): a file is cut off or corrupted. "
                               f"Fix: {fix}.") from e
    v = load_safetensors(d / "draft_vocab.safetensors", "draft vocabulary", fix)
    if "t2d" not in v:
        raise CorruptFileError(f"{d / 'draft_vocab.safetensors'}: lacks the tensor 't2d'. Fix: {fix}.")
    draft_ids = torch.nonzero(v["t2d"]).flatten()
    vocab = DraftVocab.from_ids(draft_ids, target_vocab_size, manifest["draft_vocab"].get("coverage", float("nan")))
    summary = read_json(d / "summary.json", "data summary", fix=fix)
    return PreparedData(rows, vocab, int(manifest["mask_token_id"]), summary, manifest)
