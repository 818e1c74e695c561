"""Packed rows: documents grouped into rows (`pack_documents`) and aligned, concatenated features
(`pack_row`, the one packing function both feature sources use; DESIGN.md §2 and §4)."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError
from ..target.capture import align_for_draft


class TargetLogitsAt:
    """A packed row's target logits over the draft vocabulary, computed only at the positions an
    objective indexes (DFlash reads its anchored blocks' labels, a fraction of the row) from the
    row's stored final states, with no gradient and under `amp` (the target's autocast).

    finals: [n, H] the pre-norm final states aligned as target_logits would be (position i holds the
    state whose logits are the target distribution of position i); head: [m, H] → fp32 [m, V_draft]
    (`FeatureTarget.logits_from_final` over the draft vocabulary). `self[idx]` (idx an index tensor or
    slice of positions) equals the materialised target_logits[idx]."""

    def __init__(self, finals: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], amp=None):
        self.finals, self.head, self.amp = finals, head, amp

    def __getitem__(self, idx) -> torch.Tensor:
        with torch.no_grad(), (self.amp if self.amp is not None else contextlib.nullcontext()):
            return self.head(self.finals[idx])

    def __len__(self) -> int:
        return self.finals.shape[0]


@dataclass
class PackedRow:
    """One packed training row of n aligned positions (several documents, no cross-document
    attention). tokens [n], valid [n] bool, doc_ids [n], pos_ids [n] (position within its document),
    features [n, 3H], target_logits [n, V_draft] (or a `TargetLogitsAt`, indexed the same way)."""

    tokens: torch.Tensor
    features: torch.Tensor
    target_logits: torch.Tensor | TargetLogitsAt
    valid: torch.Tensor
    doc_ids: torch.Tensor
    pos_ids: torch.Tensor


def pack_documents(lengths: list[int], tokens_per_step: int, seed: int) -> list[list[int]]:
    """Shuffle documents with `seed` and group them greedily into rows of ≤ tokens_per_step tokens
    (a longer document gets a row of its own). Returns lists of document indices."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    rows, cur, size = [], [], 0
    for i in order:
        if cur and size + lengths[i] > tokens_per_step:
            rows.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += lengths[i]
    if cur:
        rows.append(cur)
    return rows


def pack_row(docs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> PackedRow:
    """Align each document (the EAGLE pairing, `align_for_draft`) and concatenate them into a row.

    docs: per document (input_ids [T], loss_mask [T], aux [T, 3H], target_logits [T, V_draft]), all
    on one device. Each document of T tokens gives T-1 positions; doc_ids number the documents in
    order, pos_ids restart at 0 in each."""
    parts = []
    for d, (ids, mask, aux, logits) in enumerate(docs):
        tok, feat, tl, valid = align_for_draft(ids, mask, aux, logits)
        n, dev = tok.numel(), tok.device
        parts.append((tok, feat, tl, valid.bool(), torch.full((n,), d, device=dev), torch.arange(n, device=dev)))
    return PackedRow(*(torch.cat(x) for x in zip(*parts)))


def mask_out_of_vocab(row: PackedRow, in_draft_vocab: torch.Tensor) -> PackedRow:
    """`row` with the positions whose label lies outside the draft vocabulary made invalid (no loss,
    no metric), as SpecForge's P-EAGLE trains: the head can never propose such a token.

    Position i of a document predicts the token at its position i + 1 (`align_for_draft`), so its
    label is tokens[i + 1]; a document's last position, whose label the row does not hold, is kept.
    in_draft_vocab: [V] bool over the target vocabulary (True for the draft vocabulary's ids).
    Returns a new PackedRow; `row` is unchanged."""
    ok = torch.ones_like(row.valid)
    same_doc = row.doc_ids[1:] == row.doc_ids[:-1]
    ok[:-1] = ~same_doc | in_draft_vocab[row.tokens[1:]]
    return PackedRow(row.tokens, row.features, row.target_logits, row.valid & ok, row.doc_ids, row.pos_ids)


def split_validation(n: int, n_val: int, seed: int, keys: list | None = None) -> tuple[list[int], list[int]]:
    """(train indices, validation indices): `n_val` documents held out by a seeded shuffle.

    keys: one per document, equal for exact duplicates (`data.prepare.row_keys`). Duplicates then go
    to the same side: walking the shuffled order, a document whose key is not placed yet takes all
    its twins to validation when they fit in what is left of `n_val`, else to training. Without
    duplicates (or keys None) the split is the first `n_val` of the shuffled order.

    Raises ConfigError: n_val outside [0, n)."""
    if not 0 <= n_val < n:
        raise ConfigError(f"training.val_conversations={n_val} must be in [0, {n}) (there are {n} conversations)")
    order = list(range(n))
    random.Random(seed + 7919).shuffle(order)
    if keys is None:
        return sorted(order[n_val:]), sorted(order[:n_val])
    twins: dict = {}
    for i in order:
        twins.setdefault(keys[i], []).append(i)
    train, val, placed = [], [], set()
    for i in order:
        if keys[i] in placed:
            continue
        placed.add(keys[i])
        group = twins[keys[i]]
        (val if len(val) + len(group) <= n_val else train).extend(group)
    return sorted(train), sorted(val)
