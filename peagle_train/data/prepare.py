"""Conversations file → token rows + draft vocabulary + mask token, with a summary of every drop."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from tqdm.auto import tqdm

from .conversations import NormalizeStats, normalize_messages, read_records
from .template import TemplateError, tokenize_conversation
from .vocab import DraftVocab, build_draft_vocab, choose_mask_token, validate_mask_token


@dataclass
class PreparedData:
    """Training rows (a `datasets.Dataset` with input_ids, loss_mask), the draft vocabulary,
    the validated mask token, and the summary counts of this preparation."""

    rows: datasets.Dataset
    vocab: DraftVocab
    mask_token_id: int
    summary: dict = field(default_factory=dict)


def prepare_data(
    path: str | Path,
    tokenizer,
    target_vocab_size: int,
    *,
    num_conversations: int | None,
    max_length: int,
    min_supervised_tokens: int,
    draft_vocab_size: int,
    mask_token_id: int | None = None,
    seed: int = 0,
    log=print,
) -> PreparedData:
    """Read, normalise, render, tokenise and mask conversations; build d2t/t2d and the mask token.

    Conversations are shuffled with `seed` and taken until `num_conversations` rows are kept
    (None: all). Rows are cut at `max_length` tokens; a row with fewer than
    `min_supervised_tokens` assistant tokens is dropped (counted).

    Raises:
        DataFileError: the file is missing or unreadable (names the file).
        ValueError: no row survives (the summary names the reasons), or an invalid mask token.
    """
    records, report = read_records(path)
    log(report.summary())
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    stats = NormalizeStats()
    ids_list, mask_list, source = [], [], []
    read = 0
    target = num_conversations or len(order)
    with tqdm(total=target, desc="tokenising conversations", unit="conv", leave=False) as bar:
        for idx in order:
            if len(ids_list) >= target:
                break
            read += 1
            messages = normalize_messages(records[idx], stats)
            if messages is None:
                continue
            try:
                row = tokenize_conversation(tokenizer, messages, max_length)
            except TemplateError as e:
                stats.dropped["template error"] += 1
                log(f"{path}: record {idx} (id={records[idx].get('id')}): {e}")
                continue
            if sum(row.loss_mask) < min_supervised_tokens:
                stats.dropped[f"fewer than {min_supervised_tokens} supervised tokens"] += 1
                continue
            ids_list.append(row.input_ids)
            mask_list.append(row.loss_mask)
            source.append(str(records[idx].get("id", idx)))
            bar.update(1)
    if not ids_list:
        raise ValueError(f"No trainable conversation in {path}; drops by reason: {dict(stats.dropped)}")
    vocab = build_draft_vocab(ids_list, mask_list, draft_vocab_size, target_vocab_size)
    used = {t for ids in ids_list for t in ids}
    if mask_token_id is None:
        mask_token_id = choose_mask_token(tokenizer, used, target_vocab_size)
    validate_mask_token(mask_token_id, target_vocab_size, used, set(tokenizer.all_special_ids))
    n_tok = sum(len(x) for x in ids_list)
    n_sup = sum(sum(m) for m in mask_list)
    summary = {
        "file": str(path),
        "records_in_file": report.records,
        "file_truncated": report.truncated,
        "malformed_records_skipped": len(report.bad_records),
        "conversations_read": read,
        "conversations_kept": len(ids_list),
        "dropped": dict(stats.dropped),
        "changed": dict(stats.changed),
        "tokens": n_tok,
        "supervised_tokens": n_sup,
        "draft_vocab_size": len(vocab.draft_ids),
        "draft_vocab_coverage": vocab.coverage,
        "mask_token_id": mask_token_id,
        "mask_token": tokenizer.convert_ids_to_tokens(mask_token_id),
    }
    rows = datasets.Dataset.from_dict({"input_ids": ids_list, "loss_mask": mask_list, "source": source})
    return PreparedData(rows, vocab, mask_token_id, summary)


def format_summary(summary: dict) -> str:
    """The data summary as an aligned two-column table."""
    lines = []
    for k, v in summary.items():
        if isinstance(v, dict):
            lines.append(f"  {k:<28} {sum(v.values()) if v else 0}")
            lines += [f"    - {r:<40} {c}" for r, c in sorted(v.items(), key=lambda x: -x[1])]
        elif isinstance(v, float):
            lines.append(f"  {k:<28} {v:.4f}")
        else:
            lines.append(f"  {k:<28} {v}")
    return "\n".join(lines)


def save_prepared(data: PreparedData, out_dir: str | Path) -> None:
    """Write rows (Arrow), draft vocabulary (safetensors: d2t, t2d) and summary.json to out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data.rows.save_to_disk(str(out / "rows"))
    save_file({"d2t": data.vocab.d2t, "t2d": data.vocab.t2d}, str(out / "draft_vocab.safetensors"))
    (out / "summary.json").write_text(json.dumps(data.summary, indent=2))
