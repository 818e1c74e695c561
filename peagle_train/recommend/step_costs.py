"""Measure the costs the K cost model needs: one draft step and one verify forward at (batch, K).

Shapes follow the reference decoder (decoder.py) in steady state, batched: the draft's KV cache and
the target's KV cache hold `context` positions; the step drafts from 1 new real pair.
- P-EAGLE draft: one forward over [B, K] (1 real pair + K-1 mask slots), logits of the K
  proposing positions, argmax, draft→target ids.
- EAGLE-3 draft: 1 forward over the real pair, then K-1 one-token forwards reading the draft's own
  hidden state (project=False), argmax after each.
- verify: the target (with its aux-feature hooks) over [B, K+1] with its KV cache, full-vocabulary
  argmax; the cache is cropped back to `context` after each repeat.
- target alone: the same with 1 token.
Times are means over `repeats` after `warmup` runs, in milliseconds (CUDA synchronised): the mean,
not the median, because throughput is total tokens over total time, interruptions included.
Values of tokens and features do not change the cost, so they are random.
"""

from __future__ import annotations

import statistics
import time

import torch
from ..draft import DraftHead, Eagle3Draft, PEagleDraft
from ..target.capture import FeatureTarget
from ..target.load import kv_values_per_token
from ..decoding.acceptance import first_argmax
from ..decoding.engine import target_cache
from ..draft.kv_cache import SlotCache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_ms(fn, device: torch.device, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.fmean(times)


def _mask(batch: int, n_new: int, cached: int, device) -> torch.Tensor:
    """[B, n_new, cached + n_new] bool: all cached entries, causal among the new ones."""
    m = torch.ones(n_new, cached + n_new, dtype=torch.bool, device=device)
    m[:, cached:] = torch.ones(n_new, n_new, dtype=torch.bool, device=device).tril()
    return m[None].expand(batch, -1, -1)


def estimate_bytes(target_config, draft: DraftHead, batch: int, K: int, context: int, dtype_bytes: int = 4) -> int:
    """Rough peak bytes of one verify step at (batch, K) beyond the weights: the target's KV cache
    over context + K + 1 positions, full-vocabulary logits (fp32) and 4 hidden-size activations per
    layer, plus the draft's KV cache. Used to refuse batch sizes before they run out of memory."""
    tc = target_config
    layers = tc.num_hidden_layers
    n = context + K + 1
    kv = kv_values_per_token(tc) * n * batch * dtype_bytes
    logits = batch * (K + 1) * tc.vocab_size * 4
    act = 4 * layers * batch * (K + 1) * max(tc.hidden_size, getattr(tc, "intermediate_size", 0)) * dtype_bytes
    dc = draft.config
    dkv = 2 * dc.num_hidden_layers * dc.num_key_value_heads * dc.head_dim * (context + K) * batch * 4
    return int(kv + logits + act + dkv)


def available_bytes(device: torch.device) -> int | None:
    """Free accelerator memory (CUDA) or available host memory (CPU, via psutil); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available


def is_oom(err: BaseException) -> bool:
    """True for an out-of-memory error of any device (CUDA OOM, CPU allocator failure)."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


@torch.no_grad()
def time_draft(draft: DraftHead, batch: int, K: int, context: int, repeats: int = 5, warmup: int = 1,
               sequential: bool | None = None) -> float:
    """Mean ms of one drafting step proposing K tokens for each of `batch` sequences.

    The step is the head's `propose` over one new real pair with a cache of `context` pairs.
    sequential: None = by head type (EAGLE-3 heads sequential, P-EAGLE parallel); True times
    EAGLE-3-style K forwards with any head. Raises ValueError when K < 1 or batch < 1."""
    if K < 1 or batch < 1:
        raise ValueError(f"time_draft needs K >= 1 and batch >= 1, got K={K}, batch={batch}")
    cfg = draft.config
    dev = next(draft.parameters()).device
    dtype = next(draft.parameters()).dtype
    seq = not draft.config.parallel if sequential is None else sequential
    T = cfg.target_hidden_size or cfg.hidden_size
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    cache = SlotCache()  # the decoding engine's preallocated draft cache, holding `context` pairs
    for i in range(cfg.num_hidden_layers):
        cache.layer(i).update(torch.randn(shape, device=dev, dtype=dtype), torch.randn(shape, device=dev, dtype=dtype))
    g = torch.Generator(device="cpu").manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g).to(dev)
    feat = torch.randn(batch, 1, 3 * T, generator=g).to(dev, dtype)

    mask = _mask(batch, 1, context, dev)
    pos = torch.full((batch, 1), context, device=dev)
    propose = (Eagle3Draft.propose if seq else PEagleDraft.propose).__get__(draft)

    def step():
        tokens = propose(tok, feat, pos, mask, cache, K).tokens
        cache.crop(-1)  # back to `context` pairs
        return tokens

    return _mean_ms(step, dev, repeats, warmup)


@torch.no_grad()
def time_verify(target: FeatureTarget, batch: int, n_tokens: int, context: int, repeats: int = 5,
                warmup: int = 1) -> float:
    """Mean ms of one target forward over [batch, n_tokens] new tokens with a KV cache already
    holding `context` positions (n_tokens = K + 1 to verify K drafts; 1 = the target alone).
    The prefill that builds the cache is not timed. Raises ValueError on sizes < 1."""
    if n_tokens < 1 or batch < 1 or context < 1:
        raise ValueError(f"time_verify needs batch, n_tokens, context >= 1, got {batch}, {n_tokens}, {context}")
    dev = target.model.device
    V = target.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    cache = target_cache(target)  # the decoding engine's preallocated cache
    target(torch.randint(0, V, (batch, context), generator=g).to(dev), cache=cache)
    new = torch.randint(0, V, (batch, n_tokens), generator=g).to(dev)

    def step():  # as the engine verifies: logits in the model's dtype, the greedy pick
        out = target(new, cache=cache, float_logits=False)
        first_argmax(out.logits)
        cache.crop(-n_tokens)  # transformers 5: a negative count of entries to drop

    return _mean_ms(step, dev, repeats, warmup)
