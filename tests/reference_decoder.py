"""The lossless oracle: a per-sequence reference speculative decoder for P-EAGLE heads (and EAGLE-3 heads, sequentially) (DESIGN.md §5).

Per step: one draft forward over the new real pairs (x_{i+1}, g_i) (appended to the draft's KV
cache) plus K-1 slots (mask token, `mask_hidden`); the last real position proposes the first draft
token and slot d the (d+1)-th. The target verifies [x_n, x̂_1..x̂_K] in one forward with its KV
cache. Greedy (temperature 0): the longest prefix equal to the target's argmax is accepted, then the
target's own next token (bonus). Temperature > 0: speculative (rejection) sampling (Leviathan et al.
2023, Chen et al. 2023): draft i is accepted with probability min(1, p_i(x̂)/q_i(x̂)); the first
rejection is replaced by a sample of norm(max(0, p_i - q_i)); if all K are accepted the bonus is
drawn from p_K. Rejected entries are cropped from both caches and the slots are never kept.

The engine (peagle_train/decoding/engine.py) is tested against it: its own drafting forwards
(not `head.propose`), its own caches (HF DynamicCache, one per sequence) and its own acceptance.

Every result carries wall times split into drafting (draft forwards), verifying (target forwards)
and bookkeeping (the rest), plus the time to the first token, so latency can be reported.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from peagle_train.decoding.engine import GenerationResult
from peagle_train.decoding.engine import finish as _finish
from peagle_train.draft.peagle import PEagleDraft
from peagle_train.target.capture import FeatureTarget


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(res: GenerationResult, attr: str, device, fn, *args, **kw):
    """Run fn(*args, **kw), adding its synchronised wall time to res.<attr>."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    _sync(device)
    setattr(res, attr, getattr(res, attr) + time.perf_counter() - t0)
    return out


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax (temperature 0) or a sample of softmax(logits / temperature); logits [.., V] →
    ids [..]."""
    if temperature <= 0:
        return logits.argmax(-1)
    p = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).reshape(p.shape[:-1])


@torch.no_grad()
def target_generate(target: FeatureTarget, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int], *,
                    temperature: float = 0.0, generator: torch.Generator | None = None) -> GenerationResult:
    """Decoding with the target alone (KV cache, one token per forward): greedy at temperature 0,
    else ancestral sampling from softmax(logits / temperature) with `generator`."""
    dev = target.model.device
    _sync(dev)
    t0 = time.perf_counter()
    cache = DynamicCache()
    res = GenerationResult([])
    out = _timed(res, "target_seconds", dev, target, torch.tensor([prompt_ids], device=dev), cache=cache)
    tokens = [int(_pick(out.logits[0, -1], temperature, generator))]
    res.first_token_seconds = time.perf_counter() - t0
    res.target_forwards = 1
    while True:
        tokens, done = _finish(tokens, max_new_tokens, eos_ids)
        if done:
            break
        out = _timed(res, "target_seconds", dev, target, torch.tensor([[tokens[-1]]], device=dev), cache=cache)
        res.target_forwards += 1
        tokens.append(int(_pick(out.logits[0, -1], temperature, generator)))
    _sync(dev)
    res.tokens, res.seconds = tokens, time.perf_counter() - t0
    return res


def _causal_mask(n_new: int, cached: int, device) -> torch.Tensor:
    """[1, n_new, cached + n_new] bool: every cached entry, causal among the new ones."""
    mask = torch.ones(n_new, cached + n_new, dtype=torch.bool, device=device)
    mask[:, cached:] = torch.ones(n_new, n_new, dtype=torch.bool, device=device).tril()
    return mask[None]


def _draft_probs_in_target_vocab(draft: PEagleDraft, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) over the draft vocabulary scattered to target ids: [N, V_draft] → [N, V]."""
    q = torch.softmax(logits.float() / temperature, dim=-1)
    ids = torch.arange(q.shape[-1], device=q.device) + draft.d2t
    full = torch.zeros(q.shape[0], draft.config.vocab_size, device=q.device)
    return full.index_copy_(1, ids, q)


def draft_parallel(draft: PEagleDraft, pend_tok: list[int], pend_feat: torch.Tensor, cache, cached: int, K: int,
                   temperature: float = 0.0, generator: torch.Generator | None = None):
    """P-EAGLE: one forward over the new real pairs plus K-1 (mask token, mask_hidden) slots.

    pend_tok: m new tokens x_{i+1}; pend_feat [m, 3H] their features g_i; cache: the draft's
    per-layer (k, v) of `cached` earlier pairs. Returns (K proposed target ids, q [K, V] the
    distributions they were sampled from (None when greedy), cache of the real pairs only, 1).
    """
    dev, m = pend_feat.device, len(pend_tok)
    toks = torch.tensor([pend_tok + [draft.config.mask_token_id] * (K - 1)], device=dev)
    feats = torch.cat([pend_feat, draft.mask_hidden[0].to(pend_feat.dtype).expand(K - 1, -1)], dim=0)[None]
    pos = torch.arange(cached, cached + m + K - 1, device=dev)[None]
    logits, new_cache = draft(toks, feats, pos, _causal_mask(m + K - 1, cached, dev), cache)
    keep = [(k[:, :, : cached + m], v[:, :, : cached + m]) for k, v in new_cache]  # drop the slots
    logits = logits[0, m - 1 :]
    q = None if temperature <= 0 else _draft_probs_in_target_vocab(draft, logits, temperature)
    return draft.draft_to_target(_pick(logits, temperature, generator)).tolist(), q, keep, 1


def draft_sequential(draft: PEagleDraft, pend_tok: list[int], pend_feat: torch.Tensor, cache, cached: int, K: int,
                     temperature: float = 0.0, generator: torch.Generator | None = None):
    """EAGLE-3: the real pairs, then K-1 forwards, each reading the previous draft token and the
    draft's own pre-norm hidden state. Returns (K proposed target ids, q [K, V] or None, cache of
    the real pairs, K draft forwards)."""
    dev, m = pend_feat.device, len(pend_tok)
    pos = torch.arange(cached, cached + m, device=dev)[None]
    h, c = draft.hidden_states(torch.tensor([pend_tok], device=dev), pend_feat[None], pos, _causal_mask(m, cached, dev), cache)
    keep = c
    hid = h[:, -1:]
    all_logits = [draft.logits(hid[0, -1])]
    tok = draft.draft_to_target(_pick(all_logits[-1], temperature, generator))
    out = [int(tok)]
    for j in range(1, K):
        n_cached = cached + m + j - 1
        h, c = draft.hidden_states(tok.view(1, 1), hid, torch.tensor([[n_cached]], device=dev),
                                   _causal_mask(1, n_cached, dev), c, project=False)
        hid = h
        all_logits.append(draft.logits(hid[0, -1]))
        tok = draft.draft_to_target(_pick(all_logits[-1], temperature, generator))
        out.append(int(tok))
    q = None if temperature <= 0 else _draft_probs_in_target_vocab(draft, torch.stack(all_logits), temperature)
    return out, q, keep, K


def propose_parallel(draft: PEagleDraft, pend_tok: list[int], pend_feat: torch.Tensor, cache, cached: int, K: int):
    """Greedy `draft_parallel`: returns (K proposed target ids, cache of the real pairs only, 1)."""
    toks, _, keep, nf = draft_parallel(draft, pend_tok, pend_feat, cache, cached, K)
    return toks, keep, nf


def propose_sequential(draft: PEagleDraft, pend_tok: list[int], pend_feat: torch.Tensor, cache, cached: int, K: int):
    """Greedy `draft_sequential`: returns (K proposed target ids, cache of the real pairs, K)."""
    toks, _, keep, nf = draft_sequential(draft, pend_tok, pend_feat, cache, cached, K)
    return toks, keep, nf


def accept_drafts(proposal: list[int], q: torch.Tensor | None, target_logits: torch.Tensor, temperature: float,
                  generator: torch.Generator | None) -> tuple[int, int]:
    """Verification of K drafts against the target's K+1 logits [K+1, V].

    Greedy (q None, temperature 0): j = longest prefix equal to the target's argmax, next = the
    target's argmax after it. Sampling: Leviathan et al. 2023, Alg. 1 / Chen et al. 2023: draft i is
    kept if u < p_i(x̂_i) / q_i(x̂_i) (u ~ U(0,1)); at the first rejection next ~ norm(max(0, p_i - q_i));
    if all K are kept next ~ p_K. Returns (j accepted drafts, next token id).
    """
    K = len(proposal)
    if temperature <= 0:
        greedy = target_logits.argmax(-1).tolist()
        j = 0
        while j < K and proposal[j] == greedy[j]:
            j += 1
        return j, greedy[j]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [K+1, V]
    u = torch.rand(K, generator=generator, device=p.device)
    for i, x in enumerate(proposal):
        if u[i] * q[i, x] < p[i, x]:  # u < p/q without dividing by a zero q
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if residual.sum() <= 0:  # p == q up to rounding: any sample of p is exact
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return K, int(torch.multinomial(p[K], 1, generator=generator))


class SpeculativeState:
    """One sequence being decoded speculatively: its target and draft caches, pending pairs and
    counters. `step()` runs one draft + verify round; batches keep one state per row (per-sequence
    caches, stepped in lock-step by `speculative_generate_batch`)."""

    def __init__(self, target: FeatureTarget, draft: PEagleDraft, prompt_ids: list[int], K: int,
                 max_new_tokens: int, eos_ids: set[int], temperature: float = 0.0,
                 generator: torch.Generator | None = None):
        self.target, self.draft, self.K = target, draft, K
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.temperature, self.generator = temperature, generator
        self.draft_fn = draft_parallel if draft.config.parallel else draft_sequential
        self.dev = target.model.device
        _sync(self.dev)
        self.t0 = time.perf_counter()
        self.tcache = DynamicCache()
        self.res = res = GenerationResult([])
        out = _timed(res, "target_seconds", self.dev, target, torch.tensor([prompt_ids], device=self.dev), cache=self.tcache)
        self.tokens = [int(_pick(out.logits[0, -1], temperature, generator))]
        res.first_token_seconds = time.perf_counter() - self.t0
        res.target_forwards = 1
        self.pend_tok = list(prompt_ids[1:]) + self.tokens[-1:]  # x_{i+1} for the pending features g_i
        self.pend_feat = out.aux[0]  # [n, 3H]
        self.dcache, self.dlen = None, 0
        self.done = _finish(self.tokens, max_new_tokens, eos_ids)[1]
        if self.done:
            self._close()

    def step(self) -> None:
        """One verify step: draft K tokens, verify them in one target forward, roll back rejects."""
        res, K = self.res, self.K
        proposal, q, self.dcache, nf = _timed(res, "draft_seconds", self.dev, self.draft_fn, self.draft, self.pend_tok,
                                              self.pend_feat, self.dcache, self.dlen, K, self.temperature, self.generator)
        res.draft_forwards += nf
        self.dlen += len(self.pend_tok)
        out = _timed(res, "target_seconds", self.dev, self.target,
                     torch.tensor([[self.tokens[-1]] + proposal], device=self.dev), cache=self.tcache)
        res.target_forwards += 1
        j, nxt = accept_drafts(proposal, q, out.logits[0], self.temperature, self.generator)
        res.accepted.append(j)
        new = proposal[:j] + [nxt]
        if j < K:
            self.tcache.crop(-(K - j))  # drop the rejected drafts (negative: entries to remove)
        self.tokens += new
        self.pend_tok, self.pend_feat = new, out.aux[0, : j + 1]
        if _finish(self.tokens, self.max_new_tokens, self.eos_ids)[1]:
            self._close()

    def _close(self) -> None:
        self.done = True
        self.res.tokens, _ = _finish(self.tokens, self.max_new_tokens, self.eos_ids)
        _sync(self.dev)
        self.res.seconds = time.perf_counter() - self.t0


@torch.no_grad()
def speculative_generate(
    target: FeatureTarget, draft: PEagleDraft, prompt_ids: list[int], num_speculative_tokens: int,
    max_new_tokens: int, eos_ids: set[int], *, temperature: float = 0.0, generator: torch.Generator | None = None,
) -> GenerationResult:
    """Speculative decoding: K draft tokens per verify step, from one draft forward (P-EAGLE
    parallel drafting) or K sequential ones (EAGLE-3 heads).

    Greedy (temperature 0) is lossless: the output equals `target_generate` up to floating-point
    ties. Temperature > 0: rejection sampling, outputs follow the target's sampling distribution.
    Source: DESIGN.md §5, vLLM parallel drafting (one draft pass with K-1 mask slots).
    """
    state = SpeculativeState(target, draft, prompt_ids, num_speculative_tokens, max_new_tokens, eos_ids,
                             temperature, generator)
    while not state.done:
        state.step()
    return state.res


@torch.no_grad()
def speculative_generate_batch(
    target: FeatureTarget, draft: PEagleDraft, prompts: list[list[int]], num_speculative_tokens: int,
    max_new_tokens: int, eos_ids: set[int], *, temperature: float = 0.0, generator: torch.Generator | None = None,
) -> list[GenerationResult]:
    """A batch of prompts decoded in lock-step, one verify step per unfinished row per round, each
    row with its own target and draft KV caches (no padding; rows never see each other). Greedy
    outputs equal the batch-1 ones; each row's `seconds` runs until that row finished."""
    states = [SpeculativeState(target, draft, p, num_speculative_tokens, max_new_tokens, eos_ids, temperature, generator)
              for p in prompts]
    while not all(s.done for s in states):
        for s in states:
            if not s.done:
                s.step()
    return [s.res for s in states]
