"""A preallocated KV cache for the target (an HF `Cache`) and the draft head: one buffer per layer written in place.

HF's DynamicCache concatenates every layer's keys and values with the new ones at every forward,
which copies the whole cache once per layer per step. `SlotCache` keeps one buffer per layer
[B, kv_heads, capacity, head_dim] and writes the new entries into it; the model reads a view of
the first `n` slots. Capacity grows by doubling (amortised O(1) per token). Dropping rejected
drafts (`crop`) only moves the length; `batch_select_indices` drops finished rows and
`set_slots` writes a compacted cache back (decoding/engine.py). The draft head's attention writes
into the same layers (`SlotCache.layer(i)`, draft/peagle.py `DraftAttention`) when it decodes.

`SlotCache(upcast=True)` stores half-precision keys and values in fp32 buffers (converted once,
when written): on CPU the target's decoding attention (target/capture.py `decode_attention`)
computes in fp32 and would otherwise convert the whole cache of every layer at every step. Where a
plug-in's attention reads bf16 entries itself (accel/cpu: the AMX kernel), and on CUDA (SDPA in
the model's dtype), the cache stays bf16 (decoding/engine.py `target_cache`). It lives beside the heads so that draft/ imports nothing of
decoding/.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer

CAPACITY = 256  # initial slots per layer; doubled whenever a forward needs more


def gather_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Slots `idx` [B, S'] of a cache tensor [B, heads, S, head_dim] → [B, heads, S', head_dim]."""
    return t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


class SlotLayer(DynamicLayer):
    """One layer of `SlotCache`: `keys`/`values` are views [B, kv_heads, n, head_dim] of buffers."""

    def __init__(self, upcast: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.n, self.upcast = 0, upcast

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        B, h, _, d = key_states.shape
        dtype = torch.float32 if self.upcast and key_states.dtype in (torch.bfloat16, torch.float16) else key_states.dtype
        self.kbuf = key_states.new_empty(B, h, CAPACITY, d, dtype=dtype)
        self.vbuf = value_states.new_empty(B, value_states.shape[1], CAPACITY, value_states.shape[3], dtype=dtype)
        self.is_initialized = True

    def _views(self) -> None:
        self.keys, self.values = self.kbuf[:, :, :self.n], self.vbuf[:, :, :self.n]

    def _reserve(self, need: int) -> None:
        cap = self.kbuf.shape[2]
        if need > cap:
            cap = max(need, 2 * cap)
            for name in ("kbuf", "vbuf"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
                new[:, :, :self.n] = old[:, :, :self.n]
                setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new entries [B, kv_heads, N, head_dim] after the first n; return the views of n + N
        (fp32 for half-precision entries with `upcast`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        need = self.n + key_states.shape[-2]
        self._reserve(need)
        self.kbuf[:, :, self.n:need] = key_states
        self.vbuf[:, :, self.n:need] = value_states
        self.n = need
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` entries (a negative count, as DynamicLayer.crop)."""
        if tokens_to_remove > 0:
            raise ValueError(f"SlotLayer.crop takes a negative count of entries to drop, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self.n = max(self.n + tokens_to_remove, 0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
            self._views()

    def set_slots(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the cached entries by `keys`/`values` [B, kv_heads, S', head_dim] (S' ≤ n)."""
        S = keys.shape[2]
        self.kbuf[:, :, :S] = keys
        self.vbuf[:, :, :S] = values
        self.n = S
        self._views()


class SlotCache(Cache):
    """An HF cache of `SlotLayer`s, created lazily per layer at the first forward; upcast: store
    half-precision entries in fp32 (module docstring)."""

    def __init__(self, upcast: bool = False):
        super().__init__(layer_class_to_replicate=functools.partial(SlotLayer, upcast=upcast))

    def layer(self, i: int) -> SlotLayer:
        """Layer `i`, created (empty) with any missing layers before it (the draft head's layers
        are not created by an HF forward)."""
        while len(self.layers) <= i:
            self.layers.append(self.layer_class_to_replicate())
        return self.layers[i]

    def set_slots(self, idx: torch.Tensor) -> None:
        """Keep slots `idx` [B, S'] of every layer, in that order (compaction)."""
        for layer in self.layers:
            layer.set_slots(gather_slots(layer.keys, idx), gather_slots(layer.values, idx))

    def crop(self, max_length: int) -> None:
        """Drop the last `-max_length` entries of every layer (negative, as DynamicCache.crop)."""
        for layer in self.layers:
            layer.crop(max_length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)
