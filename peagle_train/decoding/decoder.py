"""Reference speculative decoder for P-EAGLE heads (and EAGLE-3 heads, sequentially) (DESIGN.md §5), greedy.

Per step: one draft forward over the new real pairs (x_{i+1}, g_i) (appended to the draft's KV
cache) plus K-1 slots (mask token, `mask_hidden`); the last real position proposes the first draft
token and slot d the (d+1)-th. The target verifies [x_n, x̂_1..x̂_K] in one forward with its KV
cache; the longest prefix equal to the target's argmax is accepted, then the target's own next token
(bonus). Rejected entries are cropped from both caches and the slots are never kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..draft.peagle import Eagle3Draft, PEagleDraft
from ..target.features import FeatureTarget


@dataclass
class GenerationResult:
    """tokens: the generated ids (prompt excluded); accepted: accepted drafts per verify step;
    draft_forwards / target_forwards: forward counts; seconds: wall time of the generation."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    draft_forwards: int = 0
    target_forwards: int = 0
    seconds: float = 0.0


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Cut at the first eos (kept) or at max_new_tokens; returns (tokens, done)."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.no_grad()
def target_generate(target: FeatureTarget, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> GenerationResult:
    """Plain greedy decoding with the target alone (KV cache, one token per forward)."""
    t0 = time.perf_counter()
    dev = target.model.device
    cache = DynamicCache()
    out = target(torch.tensor([prompt_ids], device=dev), cache=cache)
    tokens = [int(out.logits[0, -1].argmax())]
    res = GenerationResult(tokens, target_forwards=1)
    while True:
        tokens, done = _finish(tokens, max_new_tokens, eos_ids)
        if done:
            break
        out = target(torch.tensor([[tokens[-1]]], device=dev), cache=cache)
        res.target_forwards += 1
        tokens.append(int(out.logits[0, -1].argmax()))
    res.tokens, res.seconds = tokens, time.perf_counter() - t0
    return res


def _causal_mask(n_new: int, cached: int, device) -> torch.Tensor:
    """[1, n_new, cached + n_new] bool: every cached entry, causal among the new ones."""
    mask = torch.ones(n_new, cached + n_new, dtype=torch.bool, device=device)
    mask[:, cached:] = torch.ones(n_new, n_new, dtype=torch.bool, device=device).tril()
    return mask[None]


def propose_parallel(draft: PEagleDraft, pend_tok: list[int], pend_feat: torch.Tensor, cache, cached: int, K: int):
    """P-EAGLE: one forward over the new real pairs plus K-1 (mask token, mask_hidden) slots.

    Returns (K proposed target ids, cache of the real pairs only, draft forwards = 1).
    """
    dev, m = pend_feat.device, len(pend_tok)
    toks = torch.tensor([pend_tok + [draft.config.mask_token_id] * (K - 1)], device=dev)
    feats = torch.cat([pend_feat, draft.mask_hidden[0].to(pend_feat.dtype).expand(K - 1, -1)], dim=0)[None]
    pos = torch.arange(cached, cached + m + K - 1, device=dev)[None]
    logits, new_cache = draft(toks, feats, pos, _causal_mask(m + K - 1, cached, dev), cache)
    keep = [(k[:, :, : cached + m], v[:, :, : cached + m]) for k, v in new_cache]  # drop the slots
    return draft.draft_to_target(logits[0, m - 1 :].argmax(-1)).tolist(), keep, 1


def propose_sequential(draft: PEagleDraft, pend_tok: list[int], pend_feat: torch.Tensor, cache, cached: int, K: int):
    """EAGLE-3: the real pairs, then K-1 forwards, each reading the previous draft token and the
    draft's own pre-norm hidden state. Returns (K proposed target ids, cache of the real pairs, K)."""
    dev, m = pend_feat.device, len(pend_tok)
    pos = torch.arange(cached, cached + m, device=dev)[None]
    h, c = draft.hidden_states(torch.tensor([pend_tok], device=dev), pend_feat[None], pos, _causal_mask(m, cached, dev), cache)
    keep = c
    hid = h[:, -1:]
    tok = draft.draft_to_target(draft.logits(hid[0, -1]).argmax(-1))
    out = [int(tok)]
    for j in range(1, K):
        n_cached = cached + m + j - 1
        h, c = draft.hidden_states(tok.view(1, 1), hid, torch.tensor([[n_cached]], device=dev),
                                   _causal_mask(1, n_cached, dev), c, project=False)
        hid = h
        tok = draft.draft_to_target(draft.logits(hid[0, -1]).argmax(-1))
        out.append(int(tok))
    return out, keep, K


@torch.no_grad()
def speculative_generate(
    target: FeatureTarget, draft: PEagleDraft, prompt_ids: list[int], num_speculative_tokens: int,
    max_new_tokens: int, eos_ids: set[int],
) -> GenerationResult:
    """Greedy speculative decoding: K draft tokens per verify step, from one draft forward
    (P-EAGLE parallel drafting) or K sequential ones (EAGLE-3 heads).

    Lossless: the output equals `target_generate` up to floating-point ties. Source: DESIGN.md §5,
    vLLM parallel drafting (one draft pass with K-1 mask slots).
    """
    K = num_speculative_tokens
    propose = propose_sequential if isinstance(draft, Eagle3Draft) else propose_parallel
    t0 = time.perf_counter()
    dev = target.model.device
    tcache = DynamicCache()
    out = target(torch.tensor([prompt_ids], device=dev), cache=tcache)
    tokens = [int(out.logits[0, -1].argmax())]
    res = GenerationResult(tokens, target_forwards=1)
    pend_tok = list(prompt_ids[1:]) + tokens[-1:]  # x_{i+1} for the pending features g_i
    pend_feat = out.aux[0]  # [n, 3H]
    dcache, dlen = None, 0
    while not _finish(tokens, max_new_tokens, eos_ids)[1]:
        proposal, dcache, nf = propose(draft, pend_tok, pend_feat, dcache, dlen, K)
        res.draft_forwards += nf
        dlen += len(pend_tok)
        out = target(torch.tensor([[tokens[-1]] + proposal], device=dev), cache=tcache)
        res.target_forwards += 1
        greedy = out.logits[0].argmax(-1).tolist()  # K + 1
        j = 0
        while j < K and proposal[j] == greedy[j]:
            j += 1
        res.accepted.append(j)
        new = proposal[:j] + [greedy[j]]
        if j < K:
            tcache.crop(-(K - j))  # drop the rejected drafts (negative: entries to remove)
        tokens += new
        pend_tok, pend_feat = new, out.aux[0, : j + 1]
    res.tokens, _ = _finish(tokens, max_new_tokens, eos_ids)
    res.seconds = time.perf_counter() - t0
    return res
