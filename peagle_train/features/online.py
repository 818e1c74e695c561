"""Feature sources: what gives the trainer (and validation) its packed rows.

A source maps data rows to a `PackedRow` with `packed_row(doc_indices, docs, draft_ids)`:
`OnlineFeatures` runs the frozen target over the row's documents (one forward per packed row),
`OfflineFeatures` (features/shards.py) reads the same rows from verified shards. Training and
validation read the same source, so a head trained on int8 shards is validated on int8 features.
"""

from __future__ import annotations

import torch

from ..target.capture import FeatureTarget
from .rows import PackedRow, pack_row


class PackedRowSource:
    """Interface of a feature source. `target` supplies the device rows are delivered on."""

    target: FeatureTarget

    def packed_row(self, doc_indices: list[int] | None, docs: list[tuple[list[int], list[int]]],
                   draft_ids: torch.Tensor, lazy_targets=None) -> PackedRow:
        """The packed row of these documents. doc_indices: their data row indices (offline sources
        look their shards up by them); docs: their (input_ids, loss_mask); draft_ids [V_draft]:
        the target ids of the draft vocabulary (target logits are restricted to them);
        lazy_targets: None, or the target's autocast context under which a source that stores final
        states computes target logits only where the objective indexes them (`TargetLogitsAt`)."""
        raise NotImplementedError


class OnlineFeatures(PackedRowSource):
    """The frozen target run inside the training step: all documents of a packed row in one forward
    (`FeatureTarget.forward_documents`, block-diagonal attention), no grad."""

    def __init__(self, target: FeatureTarget):
        self.target = target

    def packed_row(self, doc_indices, docs, draft_ids, lazy_targets=None) -> PackedRow:
        # the forward gives the logits with the features: nothing to save by computing them later
        dev = self.target.model.device
        ids = [torch.tensor(x, device=dev) for x, _ in docs]
        outs = self.target.forward_documents(ids, draft_ids=draft_ids)
        return pack_row([(i, torch.tensor(m, device=dev), o.aux[0], o.logits[0])
                         for i, (_, m), o in zip(ids, docs, outs)])


def packed_row(target: FeatureTarget, docs: list[tuple[list[int], list[int]]], draft_ids: torch.Tensor) -> PackedRow:
    """Run the frozen target on the documents of one packed row (one forward, no grad) and pack the
    aligned results (§2). docs: (input_ids, loss_mask) pairs; each document of T tokens gives T-1
    aligned positions."""
    return OnlineFeatures(target).packed_row(None, docs, draft_ids)
