"""Batched greedy decoding with shared forwards: B sequences in one target forward and one draft
forward per step, for the target alone, P-EAGLE (parallel drafting) and EAGLE-3 (sequential).

On a memory-bound device (a CPU, or a GPU at batch 1) a forward over B×(K+1) tokens costs little
more than one over K+1, so evaluating 80 MT-Bench questions at batch 16 takes a fraction of the
batch-1 time; the tokens are the same as `decoder.py`'s, up to floating-point ties.

Ragged rows in one cache: every row appends the same number of cache slots per forward (left
padding at the prefill, K+1 verify slots per step); a per-row validity mask [B, S] marks the slots
a row really keeps (its prompt, its accepted tokens) and the rest are holes that no query attends
to. Positions come from each row's count of valid slots, so a row sees exactly the attention and
RoPE it would see alone. Rows that finish leave the batch (`batch_select_indices`).

Compaction: rejected drafts leave K - j holes per row per step, so without it the caches grow by
K + 1 slots per step while a row keeps about τ. Once a cache is COMPACT_SLACK slots longer than
its longest row, `_compact` moves each row's kept slots to the right end, in order, and cuts the
cache to that row (RoPE is already in the cached keys and positions come from the counts, so
nothing a query sees changes); attention, GQA expansion and the cache's concatenation then cost
O(kept tokens) instead of O(steps × (K + 1)). One compaction copies the cache once, as every
step's concatenation does. Measured: 16 MT-Bench first turns, 256 tokens, K = 5, two CPU threads:
188 s instead of 240 s without compaction, the same tokens (docs/BENCHMARKS.md).

Timing: the wall time of each forward is shared equally among the rows in it, so the sums over
rows of `seconds`, `draft_seconds`, `target_seconds` are the batch's wall times and summed tokens
over summed seconds is the batch throughput; per-row latency figures need batch size 1.
Greedy only (temperature > 0 uses `decoder.speculative_generate_batch`).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from ..draft.peagle import Eagle3Draft, PEagleDraft
from ..target.features import FeatureTarget
from .decoder import GenerationResult, _finish, _sync


def supports_shared(target: FeatureTarget) -> bool:
    """Whether the target can take the ragged 4D masks of this module: not with sliding-window
    layers (Gemma-3, Mistral), whose window a custom mask would drop."""
    cfg = target.config
    types = getattr(cfg, "layer_types", None) or []
    return not getattr(cfg, "sliding_window", None) and "sliding_attention" not in types


def _new_mask(valid: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
    """[B, n, S+n] bool: query i of row b sees the row's valid cached slots and its valid new
    slots up to i; a hole query sees only itself (no all-masked softmax row)."""
    n = new_valid.shape[1]
    tri = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
    new = (tri[None] & new_valid[:, None, :]) | torch.eye(n, dtype=torch.bool, device=valid.device)[None]
    return torch.cat([valid[:, None, :].expand(-1, n, -1), new], dim=2)


def _positions(lens: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
    """[B, n] positions: each row's valid slots continue from its count `lens` [B]; holes get 0."""
    return (lens[:, None] + new_valid.long().cumsum(1) - 1).clamp_min(0) * new_valid


COMPACT_SLACK = 64  # holes a cache may hold beyond its longest row before `_Shared._compact` drops them


def _compact_index(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index [B, S'] and new validity [B, S'] that move each row's valid slots of `valid`
    [B, S] (bool) to the right end, in their order; S' = the largest count of valid slots in a row
    and the slots left of a shorter row's are holes (index of some hole, validity False)."""
    counts = valid.sum(1)
    S2 = int(counts.max()) if valid.numel() else 0
    # a stable ascending sort puts each row's holes first, then its valid slots in order
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices[:, valid.shape[1] - S2:]
    new_valid = torch.arange(S2, device=valid.device)[None] >= (S2 - counts)[:, None]
    return order, new_valid


def _gather_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Slots `idx` [B, S'] of a cache tensor [B, heads, S, head_dim]."""
    return t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


class _Rows:
    """The rows still decoding: their results, tokens and pending draft pairs, and the validity
    masks and lengths of the shared target and draft caches."""

    def __init__(self, n: int, device):
        self.ids = list(range(n))            # original row index of each live row
        self.res = [GenerationResult([]) for _ in range(n)]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.pend_tok: list[list[int]] = [[] for _ in range(n)]
        self.pend_feat: list[torch.Tensor] = [None] * n
        self.tvalid = torch.zeros(n, 0, dtype=torch.bool, device=device)
        self.tlen = torch.zeros(n, dtype=torch.long, device=device)
        self.dvalid = torch.zeros(n, 0, dtype=torch.bool, device=device)
        self.dlen = torch.zeros(n, dtype=torch.long, device=device)

    def charge(self, attr: str, seconds: float) -> None:
        """Share `seconds` of a forward among the live rows."""
        for i in self.ids:
            setattr(self.res[i], attr, getattr(self.res[i], attr) + seconds / len(self.ids))


class _Shared:
    """Shared-forward decoding state over a target (and an optional draft head)."""

    def __init__(self, target: FeatureTarget, draft: PEagleDraft | None, prompts: list[list[int]], K: int,
                 max_new_tokens: int, eos_ids: set[int], compact: bool = True):
        if not supports_shared(target):
            raise ValueError("shared-forward decoding does not support sliding-window targets; use batch_size=1 "
                             "or decoder.speculative_generate_batch")
        if any(len(p) < 1 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.target, self.draft, self.K = target, draft, K
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.dev = target.model.device
        self.rows = _Rows(len(prompts), self.dev)
        self.tcache = DynamicCache()
        self.dcache = None
        self.pad = 0
        self.compact, self.compactions = compact, 0
        self._prefill(prompts)

    def _timed(self, attr: str, fn, *a, **kw):
        _sync(self.dev)
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _sync(self.dev)
        self.rows.charge(attr, time.perf_counter() - t0)
        return out

    def _target(self, tokens: torch.Tensor, new_valid: torch.Tensor, last_only: bool = False):
        r = self.rows
        mask = _new_mask(r.tvalid, new_valid)[:, None]
        out = self._timed("target_seconds", self.target, tokens, cache=self.tcache, attention_mask=mask,
                          position_ids=_positions(r.tlen, new_valid), last_only=last_only)
        for i in r.ids:
            r.res[i].target_forwards += 1
        return out

    def _prefill(self, prompts: list[list[int]]) -> None:
        r, P = self.rows, max(len(p) for p in prompts)
        toks = torch.tensor([[self.pad] * (P - len(p)) + list(p) for p in prompts], device=self.dev)
        valid = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts], device=self.dev)
        out = self._target(toks, valid, last_only=True)  # only the last position's logits are used
        first = out.logits[:, -1].argmax(-1).tolist()
        r.tvalid, r.tlen = valid, valid.sum(1)
        for i, p in enumerate(prompts):
            r.tokens[i] = [first[i]]
            r.res[i].first_token_seconds = r.res[i].seconds = r.res[i].target_seconds
            r.pend_tok[i] = list(p[1:]) + [first[i]]
            r.pend_feat[i] = out.aux[i, P - len(p):]
        self._drop_finished()

    def _drop_finished(self) -> None:
        r = self.rows
        keep = []
        for n, i in enumerate(r.ids):
            toks, done = _finish(r.tokens[i], self.max_new_tokens, self.eos_ids)
            if done:
                r.res[i].tokens = toks
            else:
                keep.append(n)
        if len(keep) == len(r.ids):
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.dev)
        r.ids = [r.ids[n] for n in keep]
        if keep:
            self.tcache.batch_select_indices(idx)
            if self.dcache is not None:
                self.dcache = [(k[idx], v[idx]) for k, v in self.dcache]
        r.tvalid, r.tlen, r.dvalid, r.dlen = r.tvalid[idx], r.tlen[idx], r.dvalid[idx], r.dlen[idx]

    # ---- drafting ----------------------------------------------------------------------------
    def _draft_inputs(self, slots: int):
        """Left-padded pending pairs of the live rows plus `slots` mask slots: tokens [B, M+slots],
        features [B, M+slots, 3H], validity [B, M+slots]; M = the longest pending run."""
        r, d = self.rows, self.draft
        M = max(len(r.pend_tok[i]) for i in r.ids)
        H3 = r.pend_feat[r.ids[0]].shape[-1]
        toks, feats, valid = [], [], []
        for i in r.ids:
            m = len(r.pend_tok[i])
            toks.append([self.pad] * (M - m) + r.pend_tok[i] + [d.config.mask_token_id] * slots)
            f = r.pend_feat[i]
            parts = [f.new_zeros(M - m, H3), f]
            if slots:
                parts.append(d.mask_hidden[0].to(f.dtype).expand(slots, -1))
            feats.append(torch.cat(parts))
            valid.append([False] * (M - m) + [True] * (m + slots))
        return (torch.tensor(toks, device=self.dev), torch.stack(feats),
                torch.tensor(valid, device=self.dev), M)

    def _propose_parallel(self) -> torch.Tensor:
        """P-EAGLE: one draft forward over the pending pairs and K-1 slots. Returns [B, K] target ids."""
        r, d, K = self.rows, self.draft, self.K
        toks, feats, valid, M = self._draft_inputs(K - 1)
        logits, cache = d(toks, feats, _positions(r.dlen, valid), _new_mask(r.dvalid, valid), self.dcache)
        S = r.dvalid.shape[1] + M
        self.dcache = [(k[:, :, :S], v[:, :, :S]) for k, v in cache]  # drop the slots
        self._keep_draft(valid[:, :M])
        return d.draft_to_target(logits[:, M - 1:].argmax(-1))

    def _propose_sequential(self) -> torch.Tensor:
        """EAGLE-3: the pending pairs, then K-1 one-token forwards on the draft's own hidden state.
        Returns [B, K] target ids."""
        r, d, K = self.rows, self.draft, self.K
        toks, feats, valid, M = self._draft_inputs(0)
        h, cache = d.hidden_states(toks, feats, _positions(r.dlen, valid), _new_mask(r.dvalid, valid), self.dcache)
        self.dcache = cache
        self._keep_draft(valid)
        hid = h[:, -1:]
        tok = d.draft_to_target(d.logits(hid[:, -1]).argmax(-1))
        out = [tok]
        ext_valid, c = r.dvalid, cache
        one = torch.ones(len(r.ids), 1, dtype=torch.bool, device=self.dev)
        for j in range(1, K):
            pos = (r.dlen + j - 1)[:, None]
            hid, c = d.hidden_states(tok[:, None], hid, pos, _new_mask(ext_valid, one), c, project=False)
            ext_valid = torch.cat([ext_valid, one], dim=1)
            tok = d.draft_to_target(d.logits(hid[:, -1]).argmax(-1))
            out.append(tok)
        return torch.stack(out, dim=1)

    def _keep_draft(self, new_valid: torch.Tensor) -> None:
        r = self.rows
        r.dvalid = torch.cat([r.dvalid, new_valid], dim=1)
        r.dlen = r.dlen + new_valid.sum(1)

    # ---- steps -------------------------------------------------------------------------------
    def step(self) -> None:
        """One round for every live row: draft K (or none: target alone), verify, keep accepted."""
        r, K = self.rows, self.K
        if self.draft is None:
            toks = torch.tensor([[r.tokens[i][-1]] for i in r.ids], device=self.dev)
            out = self._target(toks, torch.ones_like(toks, dtype=torch.bool))
            nxt = out.logits[:, -1].argmax(-1).tolist()
            self._keep_target(torch.ones_like(toks, dtype=torch.bool))
            for n, i in enumerate(r.ids):
                r.tokens[i].append(nxt[n])
            self._drop_finished()
            return
        seq = isinstance(self.draft, Eagle3Draft)
        proposal = self._timed("draft_seconds", self._propose_sequential if seq else self._propose_parallel)
        for i in r.ids:
            r.res[i].draft_forwards += K if seq else 1
        last = torch.tensor([[r.tokens[i][-1]] for i in r.ids], device=self.dev)
        inp = torch.cat([last, proposal], dim=1)
        out = self._target(inp, torch.ones_like(inp, dtype=torch.bool))
        greedy = out.logits.argmax(-1)                                       # [B, K+1]
        match = (proposal == greedy[:, :K]).long().cumprod(1).sum(1)         # accepted drafts j
        kept = torch.arange(K + 1, device=self.dev)[None] <= match[:, None]  # x_n and j drafts
        self._keep_target(kept)
        prop, gr, js = proposal.tolist(), greedy.tolist(), match.tolist()
        for n, i in enumerate(r.ids):
            j = js[n]
            new = prop[n][:j] + [gr[n][j]]
            r.res[i].accepted.append(j)
            r.tokens[i] += new
            r.pend_tok[i], r.pend_feat[i] = new, out.aux[n, : j + 1]
        self._drop_finished()
        if self.compact and r.ids:
            self._compact()

    def _compact(self) -> None:
        """Drop the caches' holes once they exceed COMPACT_SLACK (module docstring)."""
        r = self.rows
        if r.tvalid.shape[1] > int(r.tlen.max()) + COMPACT_SLACK:
            idx, r.tvalid = _compact_index(r.tvalid)
            for layer in self.tcache.layers:
                layer.keys, layer.values = _gather_slots(layer.keys, idx), _gather_slots(layer.values, idx)
            self.compactions += 1
        if self.dcache is not None and r.dvalid.shape[1] > int(r.dlen.max()) + COMPACT_SLACK:
            idx, r.dvalid = _compact_index(r.dvalid)
            self.dcache = [(_gather_slots(k, idx), _gather_slots(v, idx)) for k, v in self.dcache]
            self.compactions += 1

    def _keep_target(self, kept: torch.Tensor) -> None:
        r = self.rows
        r.tvalid = torch.cat([r.tvalid, kept], dim=1)
        r.tlen = r.tlen + kept.sum(1)

    def run(self) -> list[GenerationResult]:
        while self.rows.ids:
            t0, live = time.perf_counter(), list(self.rows.ids)
            self.step()
            for i in live:  # the step's wall time, shared by the rows that were in it
                self.rows.res[i].seconds += (time.perf_counter() - t0) / len(live)
        return self.rows.res


@torch.no_grad()
def shared_generate(target: FeatureTarget, draft: PEagleDraft | None, prompts: list[list[int]],
                    num_speculative_tokens: int, max_new_tokens: int, eos_ids: set[int],
                    compact: bool = True) -> list[GenerationResult]:
    """Greedy decoding of a batch of prompts with shared forwards (module docstring).

    draft None: the target alone, one token per forward. A PEagleDraft drafts K tokens in one
    forward (P-EAGLE); an Eagle3Draft in K sequential forwards. Returns one GenerationResult per
    prompt, in order, with the tokens `decoder.speculative_generate` / `target_generate` give (up
    to floating-point ties) and time shares as described above. compact=False keeps every hole in
    the caches (the same tokens, slower on long outputs; for tests and measurements).

    Raises:
        ValueError: an empty prompt, or a sliding-window target (`supports_shared`).
    """
    state = _Shared(target, draft, prompts, num_speculative_tokens, max_new_tokens, eos_ids, compact)
    return state.run()
