"""P-EAGLE training attention whose cost follows the visible (query, key) pairs, on SDPA's kernels.

The COD axis (algorithms/cod.py) is [depth 0 | depth 1 | ...]: depth 0 holds every row position
0..n-1 in order, the slots (anchor a, depth d ≥ 1) follow. The §4 rule (DESIGN.md §4, §8) makes
few pairs visible, and they have structure:

- a depth-0 query attends causally within its document: one causal SDPA call per document;
- a slot (a, d) attends to the depth-0 keys of its document up to a (a prefix of the document)
  plus the keys (a, 1..d) of its own chain (at most d ≤ K-1 of them).

Slots are sorted by (anchor, depth) and cut into blocks of at most `block` queries whose anchors
lie in one document and close together. A block [lo, hi] of anchors reads one contiguous range
of depth-0 keys, doc_start..hi, and the slot keys anchored in [lo, hi]; one SDPA call with a
small boolean mask over that key set (prefix ≤ a, own chain ≤ d) gives the exact softmax over
the union of the two key sets, which is what merging two partial attentions through their
log-sum-exp gives (flash attention's trick), without needing the kernel's private LSE output.
Autograd keeps each block's gathered keys/values for the backward while all blocks together hold
at most `keep_factor` × M keys (short rows: ≈ 2-7× M); beyond that (long rows, where the prefixes
grow with the row) the blocks run under activation checkpointing, so a block's gathered keys and
mask live only while it is computed and memory grows with the row (O(M)), not with the pairs.
Compute follows the visible pairs (plus at most `block` × anchor spread per block).

`CODSparseMask` is what `cod_mask(..., kind="sparse")` returns; the draft's attention calls its
`attend(q, k, v)` where it would otherwise apply a dense mask (draft/peagle.py DraftAttention).
The dense reference is `cod_attention_mask` (algorithms/cod.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _block_attention(q, k, v, ctx_start: int, ctx_end: int, chain_idx, q_anchor, q_depth, k_anchor, k_depth):
    """One block of slot queries: SDPA over [depth-0 keys ctx_start..ctx_end-1 | chain keys].

    q: [B, h, Nb, dh]; k, v: [B, kvh, S, dh]; chain_idx: [C] key indices of the slots anchored in
    the block's anchor range; q_anchor, q_depth: [Nb]; k_anchor, k_depth: [C]. Returns [B, h, Nb, dh].
    """
    kb = torch.cat([k[:, :, ctx_start:ctx_end], k.index_select(2, chain_idx)], dim=2)
    vb = torch.cat([v[:, :, ctx_start:ctx_end], v.index_select(2, chain_idx)], dim=2)
    ctx_pos = torch.arange(ctx_start, ctx_end, device=q.device)
    ctx_vis = ctx_pos[None, :] <= q_anchor[:, None]  # the document's prefix up to the anchor
    chain_vis = (k_anchor[None, :] == q_anchor[:, None]) & (k_depth[None, :] <= q_depth[:, None])
    mask = torch.cat([ctx_vis, chain_vis], dim=1)
    return F.scaled_dot_product_attention(q, kb, vb, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class CODSparseMask:
    """The P-EAGLE training mask as a plan of SDPA calls (see the module docstring).

    Built once per step (`cod_sparse_mask`) and shared by every layer, forward and backward.
    Queries are the elements from `q_start` on, keys all M elements, as for the dense mask
    `cod_mask(..., q_start)`: in the sequence-partitioned step the depth-0 keys/values come from
    the kept context (cache) and the queries are one part's slots.
    """

    def __init__(self, anchors: torch.Tensor, depths: torch.Tensor, doc_ids: torch.Tensor, q_start: int = 0,
                 block: int = 256, max_spread: int = 256, keep_factor: float = 8.0):
        dev = anchors.device
        M, n = anchors.numel(), doc_ids.numel()
        a, d = anchors.long(), depths.long()
        if M < n or not torch.equal(d[:n], torch.zeros(n, dtype=torch.long, device=dev)) \
                or not torch.equal(a[:n], torch.arange(n, device=dev)) or bool((d[n:] == 0).any()):
            raise ValueError("sparse COD attention: the axis must start with depth 0 at every row position "
                             "0..n-1 in order, then slots of depth ≥ 1 only (cod_sample's layout). "
                             "Fix: training.attention=dense for another layout.")
        if not 0 <= q_start <= M or 0 < q_start < n:
            raise ValueError(f"sparse COD attention: q_start={q_start} must be 0 (all queries) or in [n={n}, M={M}]")
        doc_ids = doc_ids.to(dev)
        change = torch.ones(n, dtype=torch.bool, device=dev)
        change[1:] = doc_ids[1:] != doc_ids[:-1]
        starts = change.nonzero().flatten()
        if torch.unique(doc_ids[starts]).numel() != starts.numel():
            raise ValueError("sparse COD attention: each document must be one contiguous run of row positions "
                             "(packed rows are). Fix: training.attention=dense.")
        ends = torch.cat([starts[1:], torch.tensor([n], device=dev)])
        self.q_start, self.n, self.M = q_start, n, M
        # depth-0 queries: one causal range per document (only when queries include depth 0)
        self.docs = list(zip(starts.tolist(), ends.tolist())) if q_start == 0 else []
        doc_start = starts[torch.cumsum(change.long(), 0) - 1]  # [n] start of each position's document
        # slot queries sorted by (anchor, depth); slot keys sorted the same way
        qs = torch.arange(max(q_start, n), M, device=dev)
        q_order = qs[torch.argsort(a[qs] * (int(d.max()) + 1 if M else 1) + d[qs], stable=True)]
        ks = torch.arange(n, M, device=dev)
        k_order = ks[torch.argsort(a[ks] * (int(d.max()) + 1 if M else 1) + d[ks], stable=True)]
        k_anchor_sorted = a[k_order]
        self.q_order = q_order                      # [Ns] query element indices, sorted
        self.q_rows = q_order - q_start             # their rows in the query tensor
        qa, qd = a[q_order], d[q_order]
        qa_list, qdoc = qa.tolist(), doc_ids[qa].tolist()
        self.blocks = []
        i, Ns = 0, q_order.numel()
        while i < Ns:
            j, lo = i + 1, qa_list[i]
            while j < Ns and j - i < block and qdoc[j] == qdoc[i] and qa_list[j] - lo <= max_spread:
                j += 1
            hi = qa_list[j - 1]
            c0 = int(torch.searchsorted(k_anchor_sorted, lo))
            c1 = int(torch.searchsorted(k_anchor_sorted, hi, right=True))
            chain = k_order[c0:c1]
            self.blocks.append((i, j, int(doc_start[lo]), hi + 1, chain, qa[i:j], qd[i:j], a[chain], d[chain]))
            i = j
        gathered = sum(ce - cs + chain.numel() for _, _, cs, ce, chain, *_ in self.blocks)
        self.recompute = gathered > keep_factor * M  # checkpoint the blocks (see the module docstring)
        # sorted position of each slot query row (to put block outputs back in query order)
        self.inverse = torch.empty_like(self.q_rows)
        self.inverse[self.q_rows - (n if q_start == 0 else 0)] = torch.arange(Ns, device=dev)

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs the kernels compute (per head), for cost accounting."""
        total = sum((e - s) * (e - s + 1) // 2 for s, e in self.docs)
        return total + sum((j - i) * (ce - cs + chain.numel()) for i, j, cs, ce, chain, *_ in self.blocks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the queries q [B, h, M - q_start, dh] over keys/values k, v [B, kvh, M, dh]
        (GQA: h a multiple of kvh) under the COD rule. Returns [B, h, M - q_start, dh] in q's
        dtype, equal to SDPA with the dense `cod_mask` (up to float rounding), gradients included.

        Raises ValueError when the shapes disagree with the plan."""
        Nq = self.M - self.q_start
        if q.shape[2] != Nq or k.shape[2] != self.M or v.shape[2] != self.M:
            raise ValueError(f"sparse COD attention: expected {Nq} queries and {self.M} keys, "
                             f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
        gqa = q.shape[1] != k.shape[1]
        parts = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=gqa)
                 for s, e in self.docs]
        if self.blocks:
            qs = q.index_select(2, self.q_rows)  # slot queries in (anchor, depth) order
            outs = []
            for i, j, cs, ce, chain, qa, qd, ka, kd in self.blocks:
                args = (qs[:, :, i:j], k, v, cs, ce, chain, qa, qd, ka, kd)
                if self.recompute and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                    outs.append(checkpoint(_block_attention, *args, use_reentrant=False))
                else:
                    outs.append(_block_attention(*args))
            parts.append(torch.cat(outs, dim=2).index_select(2, self.inverse))
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def cod_sparse_mask(anchors: torch.Tensor, depths: torch.Tensor, doc_ids: torch.Tensor, q_start: int = 0) -> CODSparseMask:
    """The COD mask as a sparse SDPA plan: queries = elements[q_start:], keys = all elements.

    anchors, depths: [M] in cod_sample's layout (depth 0 at every position 0..n-1 first);
    doc_ids: [n], each document one contiguous run. Raises ValueError for another layout."""
    return CODSparseMask(anchors, depths, doc_ids, q_start)
