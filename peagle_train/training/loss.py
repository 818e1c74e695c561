"""Losses and per-depth metrics (DESIGN.md §4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_loss_sum(draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Σ over valid elements of KL(p_target ‖ q_draft), in fp32 over the draft vocabulary.

    draft_logits, target_logits: [M, V_draft]; valid: [M] bool. Returns a scalar (a sum: divide by
    the count of valid elements of all depths for the mean).
    """
    logq = F.log_softmax(draft_logits[valid].float(), dim=-1)
    logp = F.log_softmax(target_logits[valid].float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum()


def ce_loss_sum(draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Σ over valid elements of cross-entropy against the target's argmax (over the draft vocab)."""
    return F.cross_entropy(draft_logits[valid].float(), target_logits[valid].argmax(-1), reduction="sum")


LOSSES = {"kl": kl_loss_sum, "ce": ce_loss_sum}


def depth_counts(draft_logits, target_logits, anchors, depths, valid, num_depths: int) -> torch.Tensor:
    """Counts for per-depth metrics, summable across steps and processes.

    Returns [4, K] float: row 0 valid elements per depth, row 1 correct (draft argmax == target
    argmax over the draft vocab), row 2 valid elements whose chain (same anchor, all shallower
    depths) was right, row 3 of those, the correct ones.
    """
    return chain_counts(draft_logits.argmax(-1) == target_logits.argmax(-1), anchors, depths, valid, num_depths)


def chain_counts(correct, anchors, depths, valid, num_depths: int) -> torch.Tensor:
    """`depth_counts` from per-element correctness flags [M] bool (see there)."""
    K = num_depths
    n = int(anchors.max()) + 1 if anchors.numel() else 1
    table = torch.zeros(n, K, dtype=torch.bool, device=anchors.device)
    table[anchors, depths] = correct
    chain_ok = torch.ones(n, K, dtype=torch.bool, device=anchors.device)
    for d in range(1, K):
        chain_ok[:, d] = chain_ok[:, d - 1] & table[:, d - 1]
    prev_ok = chain_ok[anchors, depths]
    out = torch.zeros(4, K, dtype=torch.float64, device=anchors.device)
    v = valid.bool()
    out[0].index_add_(0, depths[v], torch.ones_like(depths[v], dtype=torch.float64))
    out[1].index_add_(0, depths[v], correct[v].double())
    pv = v & prev_ok
    out[2].index_add_(0, depths[pv], torch.ones_like(depths[pv], dtype=torch.float64))
    out[3].index_add_(0, depths[pv], correct[pv].double())
    return out


def metrics_from_counts(counts: torch.Tensor) -> dict:
    """acc per depth, conditional (chain) acc per depth and EAL = 1 + Σ_{k=1..K} Π_{d<k} acc_d|prev."""
    c = counts.double()
    acc = (c[1] / c[0].clamp(min=1)).tolist()
    cond = (c[3] / c[2].clamp(min=1)).tolist()
    eal, prod = 1.0, 1.0
    for a in cond:
        prod *= a
        eal += prod
    return {"acc": acc, "cond_acc": cond, "eal": eal}
