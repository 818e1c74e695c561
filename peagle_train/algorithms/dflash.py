"""DFlash training (draft/dflash.py): blocks anchored at sampled row positions, all run in one
forward over the row's shared context, the loss over every slot's target distribution.

A block anchored at row position a (draft/dflash.py module docstring): the anchor token tokens[a]
at position pos_ids[a] + 1 and K mask tokens after it; its queries see the context of row
positions ≤ a of the same document and the block's own K + 1 entries (all of them, or those up to
themselves with `block_causal`; with `sliding_window` W, only keys less than W positions behind
the query, as vLLM's sliding-window layers), never another block. Slot j = 1..K is scored against the target
distribution of row position a + j - 1 (the token x_{a+j+1} of the document), so slot 1 learns what
P-EAGLE's depth 0 learns and slot j what its depth j - 1 learns; metrics use depth = j - 1.

Slot j's loss is weighted by `slot_weights`: equally (uniform), by exp(-(j-1)/γ) (the DFlash paper's,
arXiv 2602.06036 §A.1, γ 7 / 5 / 4 for blocks of 16 / 10 / 8) or by D-PACE (speculators'
`dpace_loss_decay`). Anchors are re-drawn for every packed row the trainer takes (its generator is
seeded by the row's global index, which grows with the epoch), so every epoch sees other blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..draft.peagle import DraftConfig
from ..features.rows import PackedRow
from .loss import LOSSES, chain_counts, weighted_loss_sum
from .base import Objective
from .peagle import global_loss_norm


@dataclass
class DFlashBlocks:
    """The blocks of one row: anchors [N] int64 (row positions, ascending), labels [N, K] int64
    (row position a + j - 1 of slot j, clamped into the row) and valid [N, K] bool (that label lies
    in the anchor's document and is loss-valid)."""

    anchors: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor


def dflash_blocks(valid: torch.Tensor, doc_ids: torch.Tensor, K: int, max_anchors: int | None,
                  generator: torch.Generator | None = None) -> DFlashBlocks:
    """Anchors a with at least one valid slot (a row position a + j - 1, j = 1..K, in a's
    document and loss-valid), a random `max_anchors`-subset when there are more (drawn with
    `generator`), sorted. valid, doc_ids: [n] of the row (on any device; computed on the CPU)."""
    valid, doc_ids = valid.cpu().bool(), doc_ids.cpu()
    n = valid.numel()
    lab = torch.arange(n)[:, None] + torch.arange(K)[None]                    # [n, K]: a + j - 1
    inside = lab < n
    lab = lab.clamp(max=n - 1)
    ok = inside & (doc_ids[lab] == doc_ids[:, None]) & valid[lab]
    a = ok.any(1).nonzero().flatten()
    if max_anchors is not None and a.numel() > max_anchors:
        a = a[torch.randperm(a.numel(), generator=generator)[:max_anchors]].sort().values
    return DFlashBlocks(a, lab[a], ok[a])


def with_a_block(blocks: DFlashBlocks, K: int) -> DFlashBlocks:
    """`blocks`, or for a row without any (no loss-valid position: nothing to learn) one block at
    anchor 0 whose K slots are all invalid: its loss is an exact 0 with a graph, so the row still
    runs one forward and one backward, as the collectives of DDP, DeepSpeed and FSDP expect of
    every process."""
    if blocks.anchors.numel():
        return blocks
    return DFlashBlocks(torch.zeros(1, dtype=torch.long), torch.zeros(1, K, dtype=torch.long),
                        torch.zeros(1, K, dtype=torch.bool))


def dflash_mask(anchors: torch.Tensor, doc_ids: torch.Tensor, K: int, causal: bool = False,
                window: int | None = None, pos_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[N(K+1), n + N(K+1)] bool (True = attend): the queries of the blocks at `anchors` [N] over
    the keys [the row's n context entries, then every block's K + 1 entries, block-major].

    Query (block b, slot s) sees context c iff doc_ids[c] == doc_ids[anchors[b]] and c ≤ anchors[b];
    and block entry (b', s') iff b' == b (and s' ≤ s when `causal`). doc_ids: [n].
    With `window` W (sliding-window layers, vLLM's rule per query): query (b, s) sits at position
    q = pos_ids[anchors[b]] + 1 + s and sees only keys at positions > q - W: context c at
    pos_ids[c], block entry s' at q - s + s'. pos_ids: [n], needed with a window (ValueError)."""
    dev = doc_ids.device
    a = anchors.to(dev)
    N, n, B = a.numel(), doc_ids.numel(), K + 1
    qa = a.repeat_interleave(B)
    ctx = (doc_ids[None, :] == doc_ids[qa][:, None]) & (torch.arange(n, device=dev)[None, :] <= qa[:, None])
    blk = torch.arange(N, device=dev).repeat_interleave(B)
    inner = blk[:, None] == blk[None, :]
    slot = torch.arange(B, device=dev).repeat(N)
    if causal:
        inner &= slot[None, :] <= slot[:, None]
    if window is not None:
        if pos_ids is None:
            raise ValueError("dflash_mask: a sliding window needs the row's pos_ids")
        q = pos_ids.to(dev)[qa] + 1 + slot                                      # [N(K+1)] query positions
        ctx &= (q[:, None] - pos_ids.to(dev)[None, :]) < window
        inner &= (slot[:, None] - slot[None, :]) < window
    return torch.cat([ctx, inner], 1)


def paper_gamma(block_size: int) -> float:
    """γ of the exp_decay slot weights for a block of `block_size` = K + 1 entries, the DFlash paper's
    (§A.1: 7 for block 16, 5 for 10, 4 for 8): 7 for 16 and more, 5 for 10 to 15, 4 below."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def slot_weights(kind: str, valid: torch.Tensor, confidence: torch.Tensor | None = None,
                 gamma: float | None = None, alpha: float = 0.5) -> torch.Tensor:
    """Loss weights [N, K] float of the K slots of N blocks; 0 where `valid` [N, K] bool is False.

    kind: "uniform" (1), "exp_decay" (slot j = 1..K: exp(-(j-1)/γ), γ = `gamma` or `paper_gamma(K+1)`)
    or "dpace" (D-PACE, speculators 0.9 `dpace_loss_decay`: with s_i = (1-α)·q_i + α on valid slots
    and 1 elsewhere, slot k weighs Σ_{j ≥ k, valid} Π_{i ≤ j} s_i: the expected run of accepted
    slots that passes through k; confidence [N, K]: q_i, the head's probability of the target's
    token at slot i, no gradient). Raises ValueError for another kind or dpace without confidence."""
    v = valid.float()
    K = valid.shape[-1]
    if kind == "uniform":
        return v
    if kind == "exp_decay":
        g = float(gamma) if gamma is not None else paper_gamma(K + 1)
        return v * torch.exp(-torch.arange(K, dtype=torch.float32, device=v.device) / g)
    if kind == "dpace":
        if confidence is None:
            raise ValueError("slot_weights('dpace') needs the confidences of the slots")
        smooth = torch.where(valid, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(v))
        prefix = torch.cumprod(smooth, dim=-1)
        return torch.flip(torch.cumsum(torch.flip(prefix * v, dims=[-1]), dim=-1), dims=[-1]) * v
    raise ValueError(f"slot weights {kind!r}: expected uniform | exp_decay | dpace")


@dataclass
class SlotWeighting:
    """How dflash_loss weighs the slots (`slot_weights`): kind, γ (exp_decay; None = the paper's),
    α (dpace)."""

    kind: str = "uniform"
    gamma: float | None = None
    alpha: float = 0.5

    @classmethod
    def of(cls, training) -> "SlotWeighting":
        """From the `training` group (slot_weights, slot_decay_gamma, dpace_alpha; absent: uniform)."""
        get = (lambda k, d: training.get(k, d)) if hasattr(training, "get") else (lambda k, d: getattr(training, k, d))
        g = get("slot_decay_gamma", None)
        return cls(str(get("slot_weights", "uniform")), None if g is None else float(g), float(get("dpace_alpha", 0.5)))


def head_config(model) -> DraftConfig:
    """The DraftConfig of a head, through the wrappers of distributed engines (DDP's and DeepSpeed's
    `.module`; DeepSpeed's engine has a `config` of its own)."""
    while not isinstance(getattr(model, "config", None), DraftConfig) and hasattr(model, "module"):
        model = model.module
    return model.config


def dflash_forward(draft, row: PackedRow, blocks: DFlashBlocks, K: int) -> torch.Tensor:
    """Logits [N, K, V_draft] of the K slots of every block of `blocks` over `row`, one forward
    (`draft` is called only through its forward, so sharded engines gather its parameters)."""
    dev = row.tokens.device
    cfg = head_config(draft)
    a = blocks.anchors.to(dev)
    N = a.numel()
    tokens = torch.full((N, K + 1), cfg.mask_token_id, dtype=row.tokens.dtype, device=dev)
    tokens[:, 0] = row.tokens[a]
    pos = row.pos_ids[a][:, None] + 1 + torch.arange(K + 1, device=dev)
    mask = dflash_mask(a, row.doc_ids, K, cfg.block_causal, cfg.sliding_window, row.pos_ids)
    slots = torch.arange(N * (K + 1), device=dev).view(N, K + 1)[:, 1:].reshape(-1)  # the anchors get no logits
    logits = draft(row.features[None], row.pos_ids[None], tokens.reshape(1, -1), pos.reshape(1, -1), mask[None],
                   logits_at=slots)
    return logits.view(N, K, -1)  # a view of the batch of one (indexing [0] would zero-fill its gradient)


def dflash_loss(draft, row: PackedRow, blocks: DFlashBlocks, loss_name: str, K: int, count: float,
                weighting: SlotWeighting | None = None):
    """(Σ over valid slots of weight · loss / count, counts [4, K]) of `dflash_forward`, the weights
    `weighting`'s (None: uniform, every valid slot 1); counts by depth j - 1."""
    dev = row.tokens.device
    weighting = weighting or SlotWeighting()
    logits = dflash_forward(draft, row, blocks, K)
    N = logits.shape[0]
    lab, lmask = blocks.labels.to(dev).reshape(-1), blocks.valid.to(dev).reshape(-1)
    flat = logits.reshape(N * K, -1)
    # overlapping blocks share labels: the target logits of each labelled position once
    # (a lazy row computes only these), their argmax for CE, the metrics and D-PACE
    at, inv = lab.unique(return_inverse=True)
    t_at = row.target_logits[at]
    with torch.no_grad():
        t_ids = t_at.max(-1).indices[inv]                          # max().indices: argmax, first on ties
        a = torch.arange(N, device=dev).repeat_interleave(K)      # block index as the chain's anchor
        d = torch.arange(K, device=dev).repeat(N)
        counts = chain_counts(flat.max(-1).indices == t_ids, a, d, lmask, K).cpu()
        conf = None
        if weighting.kind == "dpace":  # q = the head's probability of the target's token
            x = flat.float()
            conf = (x.gather(1, t_ids[:, None])[:, 0] - torch.logsumexp(x, -1)).exp().view(N, K)
        w = slot_weights(weighting.kind, lmask.view(N, K), conf, weighting.gamma, weighting.alpha).reshape(-1)
    if loss_name == "ce":  # every slot in one call, invalid ones at weight 0: no copies of the valid rows
        return (F.cross_entropy(flat.float(), t_ids, reduction="none") * w).sum() / count, counts
    tl = t_at[inv]
    if weighting.kind == "uniform":
        return LOSSES[loss_name](flat, tl, lmask) / count, counts
    return weighted_loss_sum(loss_name, flat, tl, w) / count, counts


class DFlashObjective(Objective):
    """DFlash: blocks of K = draft.num_depths mask slots at up to `max_anchors` anchors per row
    (`dflash_blocks`), one forward per row (`dflash_forward`), the loss normalised by the valid
    slots of all micro-rows of all processes (`global_loss_norm`, as P-EAGLE)."""

    name = "dflash"
    lazy_target_logits = True  # one lookup per row, of the blocks' labels

    def sample(self, row: PackedRow, generator: torch.Generator) -> DFlashBlocks:
        t = self.training
        return dflash_blocks(row.valid, row.doc_ids, self.num_depths, t.max_anchors, generator)

    def backward_passes(self, micro) -> int:
        """One per micro-row (`with_a_block` gives every row a block)."""
        return len(micro)

    def step(self, model, micro, *, accelerator, amp, backward=None):
        t = self.training
        backward = backward or (lambda x: x.backward())
        norm = global_loss_norm(accelerator, sum(int(b.valid.sum()) for _, b in micro))
        loss_value, counts = 0.0, torch.zeros(4, self.num_depths, dtype=torch.float64)
        for row, blocks in micro:
            blocks = with_a_block(blocks, self.num_depths)  # every process runs one forward and backward per row
            with amp:
                loss, c = dflash_loss(model, row, blocks, t.loss, self.num_depths, norm, SlotWeighting.of(t))
            backward(loss)
            loss_value, counts = loss_value + loss.item(), counts + c
        return loss_value, counts

    @torch.no_grad()
    def validate_row(self, model, row: PackedRow, generator: torch.Generator):
        t = self.training
        blocks = with_a_block(self.sample(row, generator), self.num_depths)  # lockstep engines gather in forward
        loss, c = dflash_loss(model, row, blocks, t.loss, self.num_depths, 1.0, SlotWeighting.of(t))
        return float(loss), float(blocks.valid.sum()), c
