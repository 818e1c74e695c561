"""The decoding engine: a batch of prompts decoded with one target forward (and one `propose`) per
step for all rows, greedy or with speculative (rejection) sampling (DESIGN.md §5).

Rows keep different lengths in one cache: every cache slot has a validity bit per row, new slots
take positions that continue each row's count of valid slots, and a query sees only its row's
valid slots (a [B, n, S+n] mask, with the sliding window added for targets that have one). Rows
that finish leave the batch (their cache rows are dropped). The target's and the head's caches are
preallocated (`kv_cache.SlotCache`): a step writes its new entries in place instead of
re-concatenating every layer's cache, and the head's drafted slots are cropped off again.

Per step, for every live row: the head proposes K drafts through `head.propose` (one forward for
P-EAGLE, K for EAGLE-3) over the row's new real pairs (x_{i+1}, g_i); the target verifies
[x_n, x̂_1..x̂_K]; the acceptance rule (decoding/acceptance.py: greedy or rejection sampling) keeps
j drafts and adds the next token. Rejected slots become holes. With one row left they end the
cache and are cut off at once (the cache then never holds a hole and the target runs with its own
causal mask); with more, once a cache is COMPACT_SLACK slots longer than its longest row, `_compact`
moves each row's kept slots to the right end, in order, and cuts the cache (RoPE is already in the
cached keys and positions come from the counts, so nothing a query sees changes).

Timing: the wall time of each forward is shared equally among the rows in it, so the sums over
rows of `seconds`, `draft_seconds`, `target_seconds` are the batch's wall times and summed tokens
over summed seconds is the batch throughput; per-row latency figures need batch size 1.
The per-sequence reference decoder that this engine is checked against lives in
tests/reference_decoder.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..draft import DraftHead
from ..target.capture import FeatureTarget, keeps_cache_dtype
from .acceptance import Greedy, make_acceptance
from ..draft.kv_cache import SlotCache

COMPACT_SLACK = 64  # holes a cache may hold beyond its longest row before `DecodingBatch._compact` drops them


@dataclass
class GenerationResult:
    """One decoded sequence.

    tokens: the generated ids (prompt excluded); accepted: accepted drafts per verify step;
    draft_forwards / target_forwards: forward counts; seconds: wall time of the generation (s);
    first_token_seconds: time to the first generated token (prefill, s); draft_seconds /
    target_seconds: wall time inside draft / target forwards (s, device-synchronised).
    """

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    draft_forwards: int = 0
    target_forwards: int = 0
    seconds: float = 0.0
    first_token_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0

    @property
    def bookkeeping_seconds(self) -> float:
        """Everything that is not a model forward: sampling, acceptance, cache rollback, lists (s)."""
        return max(self.seconds - self.draft_seconds - self.target_seconds, 0.0)

    @property
    def time_per_output_token(self) -> float:
        """Seconds per generated token after the first (TPOT); 0 for a single token."""
        n = len(self.tokens) - 1
        return (self.seconds - self.first_token_seconds) / n if n > 0 else 0.0


def finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Cut at the first eos (kept) or at max_new_tokens; returns (tokens, done)."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA) so that wall times cover the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sliding_window(config) -> tuple[int | None, bool]:
    """(window, per-layer): the target's sliding window (None without one) and whether only some
    layers use it (`layer_types` with "sliding_attention": Gemma-3, gpt-oss) or all (Mistral)."""
    types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if types:
        return (window, True) if window and "sliding_attention" in types else (None, False)
    return (window, False) if window and getattr(config, "use_sliding_window", True) else (None, False)


def target_cache(target: FeatureTarget) -> SlotCache:
    """The target's decoding cache, in the dtype its decoding attention reads
    (`FeatureTarget.decode_attn_implementation`): the model's dtype where that is the model's own
    (fp32 targets; half precision on CUDA: SDPA over a bf16 cache). Where it is the fp32
    `decode_attention` (target/capture.py; half-precision sdpa targets on CPU), the cache is kept in
    fp32, converted once per new entry (`SlotCache(upcast=True)`), unless a plug-in's attention
    reads half-precision entries itself (`keeps_cache_dtype`; accel/cpu: the AMX kernel)."""
    cfg = target.config
    if target.decode_attn_implementation is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return SlotCache()
    dtype = next(target.model.parameters()).dtype
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kept = target.model.device.type == "cpu" and keeps_cache_dtype(target.decoder.config, dtype, head_dim)
    return SlotCache(upcast=not kept)


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


class DecodingBatch:
    """Batched decoding state over a target (and an optional draft head); `run()` decodes."""

    def __init__(self, target: FeatureTarget, draft: DraftHead | None, prompts: list[list[int]], K: int,
                 max_new_tokens: int, eos_ids: set[int], acceptance=None, compact: bool = True,
                 verifier_numerics: bool = False):
        if any(len(p) < 1 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if draft is not None and K < 1:
            raise ValueError(f"speculative decoding needs K >= 1 draft tokens, got {K}")
        self.target, self.draft, self.K = target, draft, K
        self.verifier_numerics = verifier_numerics and draft is None and K > 0
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.acc = acceptance or Greedy()
        self.dev = target.model.device
        self.window, self.per_layer_window = sliding_window(target.config)
        self.eager = getattr(target.config, "_attn_implementation", "sdpa") == "eager"
        self.mask_dtype = next(target.model.parameters()).dtype
        n = len(prompts)
        self.ids = list(range(n))            # original row index of each live row
        self.res = [GenerationResult([]) for _ in range(n)]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.tcache = target_cache(target)
        self.dcache = SlotCache()  # the draft head's real pairs (draft/peagle.py writes into it)
        self.dvalid = torch.zeros(n, 0, dtype=torch.bool, device=self.dev)
        self.dlen = torch.zeros(n, dtype=torch.long, device=self.dev)
        self.compact, self.compactions = compact, 0
        self.holes = False  # whether the target cache may hold a hole (tracked on the host: no device sync)
        self._prefill(prompts)

    # ---- helpers -----------------------------------------------------------------------------
    def _charge(self, attr: str, seconds: float) -> None:
        for i in self.ids:
            setattr(self.res[i], attr, getattr(self.res[i], attr) + seconds / len(self.ids))

    def _timed(self, attr: str, fn, *a, **kw):
        sync(self.dev)
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        sync(self.dev)
        self._charge(attr, time.perf_counter() - t0)
        return out

    def _hf_mask(self, m: torch.Tensor) -> torch.Tensor:
        """[B, n, S] bool → the 4D mask the target's attention takes (bool; additive for eager)."""
        m = m[:, None]
        if self.eager:
            return torch.zeros(m.shape, dtype=self.mask_dtype, device=m.device).masked_fill_(
                ~m, torch.finfo(self.mask_dtype).min)
        return m

    def _target(self, tokens: torch.Tensor, new_valid: torch.Tensor, last_only: bool = False, new_holes: bool = False):
        """One target forward over new slots `tokens` [B, n] (validity new_valid [B, n], with holes
        only if new_holes); returns (TargetOutput, positions [B, n]). The caller records which
        slots stay (`_keep_target`)."""
        pos = _positions(self.tlen, new_valid)
        if not (self.holes or new_holes):
            mask = None  # no hole: the target's own causal (and sliding-window) mask is exact
        else:
            full = _new_mask(self.tvalid, new_valid)
            if self.window:
                kpos = torch.cat([self.tpos, pos], 1)
                near = full & ((pos[:, :, None] - kpos[:, None, :]) < self.window)
                mask = ({"full_attention": self._hf_mask(full), "sliding_attention": self._hf_mask(near)}
                        if self.per_layer_window else self._hf_mask(near))
            else:
                mask = self._hf_mask(full)
        out = self._timed("target_seconds", self.target, tokens, cache=self.tcache, attention_mask=mask,
                          position_ids=pos, last_only=last_only, float_logits=False)
        for i in self.ids:
            self.res[i].target_forwards += 1
        return out, pos

    def _keep_target(self, kept: torch.Tensor, pos: torch.Tensor) -> None:
        self.tvalid = torch.cat([self.tvalid, kept], 1)
        self.tpos = torch.cat([self.tpos, pos], 1)
        self.tlen = self.tlen + kept.sum(1)

    def _prefill(self, prompts: list[list[int]]) -> None:
        P = max(len(p) for p in prompts)
        toks = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], device=self.dev)
        valid = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts], device=self.dev)
        n = len(prompts)
        self.tvalid = torch.zeros(n, 0, dtype=torch.bool, device=self.dev)
        self.tpos = torch.zeros(n, 0, dtype=torch.long, device=self.dev)
        self.tlen = torch.zeros(n, dtype=torch.long, device=self.dev)
        padded = any(len(p) < P for p in prompts)
        out, pos = self._target(toks, valid, last_only=True, new_holes=padded)  # only the last logits are used
        self._keep_target(valid, pos)
        self.holes = padded
        first = self.acc.pick(out.logits[:, -1])
        self.last = first
        # the pairs (x_{i+1}, g_i) of the prompt: tokens shifted left by one, the first token last
        self.pend_tok = torch.cat([toks[:, 1:], first[:, None]], 1)
        self.pend_feat, self.pend_valid = out.aux, valid
        for i, t in enumerate(first.tolist()):
            self.tokens[i] = [t]
            self.res[i].first_token_seconds = self.res[i].seconds = self.res[i].target_seconds
        self._drop_finished()

    def _drop_finished(self) -> None:
        keep = []
        for n, i in enumerate(self.ids):
            toks, done = finish(self.tokens[i], self.max_new_tokens, self.eos_ids)
            if done:
                self.res[i].tokens = toks
            else:
                keep.append(n)
        if len(keep) == len(self.ids):
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.dev)
        self.ids = [self.ids[n] for n in keep]
        if keep:
            self.tcache.batch_select_indices(idx)
            self.dcache.batch_select_indices(idx)
        for name in ("tvalid", "tpos", "tlen", "dvalid", "dlen", "pend_tok", "pend_feat", "pend_valid", "last"):
            setattr(self, name, getattr(self, name)[idx])

    # ---- steps -------------------------------------------------------------------------------
    def _propose(self):
        """The head's K drafts for every live row over its pending pairs (`head.propose`)."""
        valid = self.pend_valid
        prop = self.draft.propose(self.pend_tok, self.pend_feat, _positions(self.dlen, valid),
                                  _new_mask(self.dvalid, valid), self.dcache, self.K, pick=self.acc.draft_pick)
        self.dvalid = torch.cat([self.dvalid, valid], 1)
        self.dlen = self.dlen + valid.sum(1)
        return prop

    def _step_target_alone(self) -> None:
        inp = self.last[:, None]
        one = torch.ones_like(inp, dtype=torch.bool)
        if self.verifier_numerics:  # a verify-shaped forward: the token and K dummies, whose slots are dropped
            out, pos = self._target(inp.expand(-1, self.K + 1), torch.ones(len(self.ids), self.K + 1, dtype=torch.bool,
                                                                           device=self.dev))
            kept = torch.arange(self.K + 1, device=self.dev)[None] < 1
            self._keep_target(kept.expand(len(self.ids), -1), pos)
            if self.compact and len(self.ids) == 1:
                self.tcache.crop(-self.K)
                self.tvalid, self.tpos = self.tvalid[:, :-self.K], self.tpos[:, :-self.K]
            else:
                self.holes = True
            self.last = self.acc.pick(out.logits[:, 0])
        else:
            out, pos = self._target(inp, one)
            self._keep_target(one, pos)
            self.last = self.acc.pick(out.logits[:, -1])
        for n, t in enumerate(self.last.tolist()):
            self.tokens[self.ids[n]].append(t)
        self._drop_finished()

    def step(self) -> None:
        """One round for every live row: draft K (or none: target alone), verify, keep accepted."""
        if self.draft is None:
            self._step_target_alone()
            return
        K = self.K
        prop = self._timed("draft_seconds", self._propose)
        for i in self.ids:
            self.res[i].draft_forwards += prop.forwards
        inp = torch.cat([self.last[:, None], prop.tokens], 1)
        out, pos = self._target(inp, torch.ones_like(inp, dtype=torch.bool))
        j, nxt = self.acc.verify(prop.tokens, prop.logits, out.logits, self.draft)
        kept = torch.arange(K + 1, device=self.dev)[None] <= j[:, None]   # x_n and j drafts
        self._keep_target(kept, pos)
        js = j.tolist()
        if self.compact and len(js) == 1 and K > js[0]:  # one row: its rejected slots end the cache
            cut = K - js[0]
            self.tcache.crop(-cut)
            self.tvalid, self.tpos = self.tvalid[:, :-cut], self.tpos[:, :-cut]
        elif K > min(js):
            self.holes = True
        emitted = torch.cat([prop.tokens, nxt[:, None]], 1).scatter_(1, j[:, None], nxt[:, None])  # [B, K+1]
        # the next pending pairs: the emitted tokens with their features, right-aligned
        M = max(js) + 1
        src = torch.arange(M, device=self.dev)[None] - (M - 1 - j)[:, None]
        self.pend_valid, src = src >= 0, src.clamp_min(0)
        self.pend_tok = emitted.gather(1, src)
        self.pend_feat = out.aux.gather(1, src[..., None].expand(-1, -1, out.aux.shape[-1]))
        self.last = nxt
        for n, (i, row) in enumerate(zip(self.ids, emitted.tolist())):
            self.res[i].accepted.append(js[n])
            self.tokens[i] += row[: js[n] + 1]
        self._drop_finished()
        if self.compact and self.ids:
            self._compact()

    def _compact(self) -> None:
        """Drop the caches' holes once they exceed COMPACT_SLACK (module docstring)."""
        if self.tvalid.shape[1] > int(self.tlen.max()) + COMPACT_SLACK:
            idx, self.tvalid = _compact_index(self.tvalid)
            self.tpos = self.tpos.gather(1, idx)
            self.tcache.set_slots(idx)
            self.compactions += 1
        if self.dvalid.shape[1] > int(self.dlen.max()) + COMPACT_SLACK:
            idx, self.dvalid = _compact_index(self.dvalid)
            self.dcache.set_slots(idx)
            self.compactions += 1

    def run(self) -> list[GenerationResult]:
        while self.ids:
            t0, live = time.perf_counter(), list(self.ids)
            self.step()
            for i in live:  # the step's wall time, shared by the rows that were in it
                self.res[i].seconds += (time.perf_counter() - t0) / len(live)
        return self.res


@torch.no_grad()
def generate(target: FeatureTarget, draft: DraftHead | None, prompts: list[list[int]], num_speculative_tokens: int,
             max_new_tokens: int, eos_ids: set[int], *, temperature: float = 0.0,
             generator: torch.Generator | None = None, acceptance=None, compact: bool = True,
             verifier_numerics: bool = False) -> list[GenerationResult]:
    """Decode a batch of prompts (module docstring).

    draft None: the target alone, one token per forward (greedy or ancestral sampling). A
    PEagleDraft drafts K tokens in one forward (P-EAGLE); an Eagle3Draft in K sequential forwards.
    temperature 0: greedy, the tokens of the target alone (lossless); > 0: rejection sampling with
    `generator` (outputs follow softmax(target logits / T)); `acceptance` overrides both.
    Returns one GenerationResult per prompt, in order, with time shares as in the module docstring.
    compact=False keeps every hole in the caches (the same tokens, slower; for tests).
    verifier_numerics (target alone only): every step runs the verifier's (K+1)-token forward (the
    token, then K dummies whose slots are dropped), so that each token comes from the matmul shapes
    the verifier uses; in bf16 a 1-token forward rounds differently (the reference of lossless).

    Raises:
        ValueError: an empty prompt, or K < 1 with a draft.
    """
    acc = acceptance or make_acceptance(temperature, generator)
    return DecodingBatch(target, draft, prompts, num_speculative_tokens, max_new_tokens, eos_ids, acc, compact,
                  verifier_numerics).run()
