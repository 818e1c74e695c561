"""P-EAGLE training (DESIGN.md §4; P-EAGLE arXiv 2602.01469 §3.2, Algorithm 1): COD sampling of a
packed row, one forward over all depths under the P-EAGLE mask, the KL loss over all valid
elements, optionally partitioned along the row with the same gradients (`draft_step`).
"""

from __future__ import annotations

import torch

from ..features.rows import PackedRow
from .cod import CODElements, attention_kind, cod_mask, cod_sample
from .loss import LOSSES, chain_counts, depth_counts, weighted_loss_sum
from .base import Objective


def depth_loss_sum(loss_name: str, logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor,
                   depths: torch.Tensor, depth_weight: float = 1.0) -> torch.Tensor:
    """Σ over valid elements e of depth_weight^(depth of e) · loss_e, the loss `loss_name` (a key of
    LOSSES), in fp32.

    logits, target_logits: [M, V_draft]; valid: [M] bool; depths: [M] int64. With depth_weight 1
    this is LOSSES[loss_name] itself (every element the same, P-EAGLE arXiv 2602.01469 §3.2).
    Returns an fp32 scalar differentiable in logits. Raises KeyError for an unknown loss name."""
    if depth_weight == 1:
        return LOSSES[loss_name](logits, target_logits, valid)
    return weighted_loss_sum(loss_name, logits, target_logits, valid.float() * depth_weight ** depths.float())


def depth_weight_total(valid: torch.Tensor, depths: torch.Tensor, depth_weight: float = 1.0) -> float:
    """Σ over valid elements of depth_weight^depth: the divisor that makes `depth_loss_sum` a
    weighted mean (the count of valid elements when depth_weight is 1). valid: [M] bool;
    depths: [M] int64."""
    if depth_weight == 1:
        return float(int(valid.sum()))
    return float((valid.double() * float(depth_weight) ** depths.double()).sum())


def draft_step(draft, row: PackedRow, elements: CODElements, loss_name: str, num_depths: int, *,
               partitions: int = 1, attention: str = "dense", loss_norm: float | None = None, backward=None,
               depth_weight: float = 1.0):
    """Forward the draft over the COD elements of one row, compute the loss and backpropagate.

    The loss is Σ loss over valid elements of all depths / their count (DESIGN.md §4); with
    depth_weight w ≠ 1, Σ w^d · loss over valid elements at depth d / Σ w^d over them
    (`depth_loss_sum`, `depth_weight_total`).
    Sequence partitioning (P-EAGLE Algorithm 1, gradient accumulation within a sequence): with
    partitions = P > 1, the depth-0 context is run once and its per-layer keys/values are kept as
    detached leaves; the row's positions are cut into P contiguous parts, and each part runs only
    the chains (depth ≥ 1) anchored in it, attending to the kept context, and back-propagates its
    own loss at once, accumulating gradients into the weights and into the kept keys/values; one
    final backward takes the depth-0 loss and those key/value gradients through the context.
    Every element sees what it sees unpartitioned, so the gradients equal the unpartitioned
    step's (chain rule). A part with no chain runs one padding element with a zero loss, so the
    number of backward passes is always partitions + 1 (collectives under ZeRO and FSDP).
    Attention over the chains never spans more than one part: memory
    grows with the row, not with the row times the COD axis (≈ K×).
    `attention`: dense | sparse | flex | auto (algorithms/cod.py `attention_kind`; sparse builds no
    M×M mask, algorithms/cod_attention.py). Gradients are local: with
    several processes, average them afterwards (`average_gradients`).
    `loss_norm` replaces this row's valid count (weight total) as the divisor: with W processes, pass
    (valid count of all processes) / W so that DDP's gradient mean equals one process's step
    over all rows (see `global_loss_norm`).
    `backward`: called on every scalar loss (default `loss.backward()`); a distributed engine's
    backward (DeepSpeed `engine.backward`, training/engines.py). `draft` is called only through its
    forward (`is_slot` substitutes mask_hidden there), so a ZeRO-3/FSDP-sharded head gathers its
    parameters; the last pass through the context is one scalar, loss0 + Σ ⟨kv, ∂L/∂kv⟩.

    Returns (loss value (float), valid_count (int), depth_counts [4, K]).
    """
    dev = row.tokens.device
    a_all, d_all = elements.anchors.to(dev), elements.depths.to(dev)
    valid_all = row.valid[a_all + d_all]
    count = loss_norm if loss_norm is not None else max(depth_weight_total(valid_all, d_all, depth_weight), 1.0)
    kind = attention_kind(attention, dev)
    backward = backward or (lambda x: x.backward())

    def run(a, d, q_start=0, cache=None):
        """Forward elements (a, d)[q_start:] given the kept keys/values of (a, d)[:q_start]."""
        mask = cod_mask(a, d, row.doc_ids, kind, q_start)
        logits, cache = draft(row.tokens[a[q_start:]][None], row.features[a[q_start:]][None],
                              (row.pos_ids[a] + d)[q_start:][None], mask, cache, is_slot=(d[q_start:] > 0)[None])
        return logits[0], cache

    def loss_and_counts(logits, a, d, lmask):
        tl = row.target_logits[a + d]
        with torch.no_grad():
            c = depth_counts(logits, tl, a, d, lmask, num_depths).cpu()
        return depth_loss_sum(loss_name, logits, tl, lmask, d, depth_weight) / count, c

    if partitions == 1:
        logits, _ = run(a_all, d_all)
        loss, counts = loss_and_counts(logits, a_all, d_all, valid_all)
        backward(loss)
        return loss.item(), int(valid_all.sum()), counts
    return _partitioned_step(row, a_all, d_all, valid_all, run, loss_and_counts, partitions=partitions,
                             loss_name=loss_name, num_depths=num_depths, count=count, backward=backward,
                             depth_weight=depth_weight)


def _partitioned_step(row: PackedRow, a_all: torch.Tensor, d_all: torch.Tensor, valid_all: torch.Tensor, run,
                      loss_and_counts, *, partitions: int, loss_name: str, num_depths: int, count: float, backward,
                      depth_weight: float = 1.0):
    """`draft_step` with partitions = P > 1 (P-EAGLE Algorithm 1): the depth-0 context once, its
    keys/values kept as detached leaves; per contiguous part of the row's n positions, the chains
    anchored in it (or one zero-loss padding element) forwarded against them and back-propagated;
    then one backward of loss0 + Σ ⟨kv, ∂L/∂kv⟩ through the context.
    a_all, d_all, valid_all: [M] anchors, depths and validity of the row's COD elements; `run` and
    `loss_and_counts`: draft_step's forward of elements and its loss and depth counts of their
    logits; count: the loss divisor. Returns (loss value (float), valid_count (int),
    depth_counts [4, num_depths]). Raises ValueError when depth 0 does not hold every row
    position in order."""
    dev = row.tokens.device
    n = row.tokens.numel()
    ctx = d_all == 0
    a0, d0 = a_all[ctx], d_all[ctx]  # depth 0: every position, in order (cod_sample's layout)
    if not torch.equal(a0, torch.arange(n, device=dev)):
        raise ValueError("partitioned step: depth 0 must hold every row position in order (as cod_sample gives)")
    logits0, cache0 = run(a0, d0)
    leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in cache0]
    correct0 = logits0.detach().argmax(-1) == row.target_logits[a0].argmax(-1)
    bounds = torch.linspace(0, n, partitions + 1).round().long().tolist()
    total, counts = 0.0, torch.zeros(4, num_depths, dtype=torch.float64)
    for p in range(partitions):
        own = ~ctx & (a_all >= bounds[p]) & (a_all < bounds[p + 1])
        if not own.any():
            # no chain anchored in this part: one depth-1 element through the same layers with a zero loss, so
            # that every process runs partitions + 1 backward passes whatever its row (under ZeRO and FSDP each
            # backward is a collective: a process that skipped one would leave the others waiting)
            a_pad = torch.full((1,), min(bounds[p], n - 1), dtype=a0.dtype, device=dev)
            logits, _ = run(torch.cat([a0, a_pad]), torch.cat([d0, torch.ones_like(a_pad)]), q_start=n, cache=leaves)
            backward(logits.sum() * 0.0)
            continue
        a, d = torch.cat([a0, a_all[own]]), torch.cat([d0, d_all[own]])
        logits, _ = run(a, d, q_start=n, cache=leaves)
        tl = row.target_logits[a[n:] + d[n:]]
        lmask = row.valid[a[n:] + d[n:]]
        loss = depth_loss_sum(loss_name, logits, tl, lmask, d[n:], depth_weight) / count
        backward(loss)  # into the weights and the kept keys/values, not yet through the context
        total += loss.item()
        with torch.no_grad():  # chain metrics need the depth-0 correctness of the same anchors
            corr = torch.cat([correct0, logits.argmax(-1) == tl.argmax(-1)])
            only_chain = torch.cat([torch.zeros(n, dtype=torch.bool, device=dev), lmask])
            counts += chain_counts(corr, a, d, only_chain, num_depths).cpu()
    loss0, c0 = loss_and_counts(logits0, a0, d0, valid_all[ctx])
    kv = [t for pair in cache0 for t in pair]
    kv_grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for pair in leaves for leaf in pair]
    # one pass through the context: d/dkv of Σ⟨kv, g⟩ is exactly g, so one scalar carries loss0 and the kv grads
    backward(loss0 + sum((t * g).sum() for t, g in zip(kv, kv_grads)))
    return total + loss0.item(), int(valid_all.sum()), counts + c0


def global_loss_norm(accelerator, valid_count: float) -> float:
    """(Σ over processes of valid_count) / W: the per-process loss divisor for which DDP's
    gradient mean equals the gradient of Σ loss / Σ count over all processes' rows (DESIGN §4).
    valid_count: this process's count of valid elements, or their total weight (`depth_weight_total`)."""
    total = accelerator.reduce(torch.tensor(float(valid_count), device=accelerator.device), "sum")
    return max(float(total), 1.0) / accelerator.num_processes



class PEagleObjective(Objective):
    """P-EAGLE: COD elements per row (`cod_sample`: num_depths, down_sample_ratio(_min),
    max_anchors), the step by `draft_step` (loss, depth_weight, partitions, attention), normalised
    by the valid count (weight total) of all micro-rows of all processes (`global_loss_norm`), so
    the step equals one process's over every row whatever the number of processes and micro-rows.
    The validation loss weighs every element the same, whatever depth_weight."""

    name = "peagle"

    def sample(self, row: PackedRow, generator: torch.Generator) -> CODElements:
        t = self.training
        return cod_sample(row.valid.cpu(), row.doc_ids.cpu(), self.num_depths, t.down_sample_ratio,
                          t.down_sample_ratio_min, t.max_anchors, generator)

    def backward_passes(self, micro) -> int:
        """One per micro-row, or partitions + 1 with sequence partitioning (`draft_step`)."""
        p = int(self.training.partitions)
        return len(micro) * (p + 1 if p > 1 else 1)

    def step(self, model, micro, *, accelerator, amp, backward=None):
        t = self.training
        norm = global_loss_norm(accelerator, sum(
            depth_weight_total(row.valid[el.targets.to(row.valid.device)], el.depths.to(row.valid.device),
                               t.depth_weight)
            for row, el in micro))
        loss_value, counts = 0.0, 0
        for row, el in micro:
            with amp:
                lv, _, c = draft_step(model, row, el, t.loss, self.num_depths, partitions=t.partitions,
                                      attention=t.attention, loss_norm=norm, backward=backward,
                                      depth_weight=t.depth_weight)
            loss_value, counts = loss_value + lv, counts + c
        return loss_value, counts

    @torch.no_grad()
    def validate_row(self, model, row: PackedRow, generator: torch.Generator):
        t = self.training
        K = self.num_depths
        dev = row.tokens.device
        kind = attention_kind(t.attention, dev)
        el = self.sample(row, generator)
        a, d = el.anchors.to(dev), el.depths.to(dev)
        valid = row.valid[a + d]
        logits, _ = model(row.tokens[a][None], row.features[a][None], (row.pos_ids[a] + d)[None],
                          cod_mask(a, d, row.doc_ids, kind, 0), None, is_slot=(d > 0)[None])
        logits, tl = logits[0], row.target_logits[a + d]
        return (float(LOSSES[t.loss](logits, tl, valid)), float(valid.sum()),
                depth_counts(logits, tl, a, d, valid, K).cpu())
