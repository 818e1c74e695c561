"""The P-EAGLE draft head (DESIGN.md §3; P-EAGLE arXiv 2602.01469 §3, EAGLE-3 arXiv 2503.01840).

Layout (module names follow transformers' Llama so exports load in vLLM / speculators):
    fc            Linear(3H → H, no bias) over the concatenated aux hidden states (options:
                  `input_norm` over all 3H, `fc_norm` per aux chunk, as speculators names them)
    layers[0]     input = cat(input_layernorm(embed(token)), hidden_norm(fc(feature))) : 2H,
                  q/k/v take 2H, o_proj gives H; residual = fc(feature)
    layers[1..]   ordinary Llama decoder layers
    norm, lm_head final RMSNorm, Linear(H → V_draft)
    embed_tokens  full target vocabulary, initialised from the target: every row trainable, or only
                  the mask token's row (`train_embeddings`, draft/embedding.py)
    mask_hidden   [1, 1, 3H] learnable feature fed at every depth ≥ 1 slot (before fc)
    d2t, t2d      draft-vocabulary buffers (see data.vocab.DraftVocab)

One forward takes any set of elements with explicit position ids and a boolean attention mask,
which serves both the COD training axis (algorithms/cod.py) and the decoder's KV-cached drafting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from .base import DraftHead, DraftMLP, Proposal, flex_attention_for
from .head_config import DraftConfig
from .kv_cache import SlotCache, SlotLayer


MASK_HIDDEN_STD = 0.02  # the constructor's init of mask_hidden (`PEagleDraft.init_mask_hidden` rescales it)


class DraftAttention(nn.Module):
    """GQA self-attention with an explicit mask and an optional KV cache.

    x: [B, N, in_size]; cos/sin: [B, N, head_dim]; mask: [B, N, S] bool (True = may attend),
    S = cached + N, a FlexAttention BlockMask over [N, S], or an object whose `attend(q, k, v)`
    computes the masked attention itself (the sparse COD plan, algorithms/cod_attention.py).
    cache: None; a (k, v) pair [B, kv_heads, cached, head_dim] each, concatenated with the new
    entries (differentiable: training's TTT steps); or a `SlotLayer` (decoding), into whose
    preallocated buffers the new entries are written in place.
    Returns [B, N, H] and the (k, v) attended over, each [B, kv_heads, S, head_dim].
    """

    def __init__(self, cfg: DraftConfig, in_size: int):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(in_size, self.kvh * self.d, bias=False)
        self.v_proj = nn.Linear(in_size, self.kvh * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = LlamaRMSNorm(self.d, eps=cfg.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.d, eps=cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, mask, cache=None):
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, self.h, self.d)
        k = self.k_proj(x).view(B, N, self.kvh, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.kvh, self.d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if isinstance(cache, SlotLayer):
            k, v = cache.update(k, v)
        elif cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        if isinstance(mask, BlockMask):
            out = flex_attention_for(q.device)(q, k, v, block_mask=mask, enable_gqa=True)
        elif hasattr(mask, "attend"):  # a sparse plan (algorithms/cod_attention.py CODSparseMask)
            out = mask.attend(q, k, v)
        else:
            rep = self.h // self.kvh
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask[:, None]
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, N, self.h * self.d)), (k, v)


class DraftLayer(nn.Module):
    """A Llama decoder layer; layer 0 reads [embedding, feature] (2H) with `hidden_norm`."""

    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        self.first = first
        H = cfg.hidden_size
        self.self_attn = DraftAttention(cfg, 2 * H if first else H)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual
        if first:
            self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)

    def forward(self, h, cos, sin, mask, cache=None, embeds=None):
        if self.first:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, x = h, self.input_layernorm(h)
        a, kv = self.self_attn(x, cos, sin, mask, cache)
        h = residual + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


class Eagle3Draft(DraftHead):
    """The EAGLE-3 head (arXiv 2503.01840), the base of P-EAGLE's: the layout of the module docstring
    without `mask_hidden` and the mask token. It drafts sequentially: step j ≥ 1 reads the token
    drafted at step j-1 and its own pre-norm output hidden state (bypassing fc), so K tokens cost K
    draft forwards. Trained with test-time training steps (algorithms/eagle3.py)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        H = cfg.hidden_size
        T = cfg.target_hidden_size or H
        if cfg.norm_before_fc:
            self.input_norm = LlamaRMSNorm(3 * T, eps=cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(T, eps=cfg.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * T, H, bias=False)
        self.layers = nn.ModuleList(DraftLayer(cfg, i == 0) for i in range(cfg.num_hidden_layers))
        self.add_output_layers()

    def hidden_states(self, tokens, features, position_ids, mask, cache=None, project: bool = True):
        """The last layer's output before the final norm. Shapes as in `forward`; with
        project=False, `features` are [B, N, H] hidden states that bypass fc (EAGLE-3 feeds its own
        output back this way). cache: None, a list of per-layer (k, v) or a SlotCache (decoding;
        written in place and returned). Returns (hidden [B, N, H], new cache list or the SlotCache)."""
        if project:
            if self.config.norm_before_fc:
                features = self.input_norm(features)
            if self.config.fc_norm:
                features = torch.cat([norm(c) for norm, c in zip(self.fc_norm, features.chunk(3, dim=-1))], dim=-1)
            features = self.fc(features)
        h = features
        embeds = self.embed_tokens(tokens)
        cos, sin = self.rotary_emb(h, position_ids)
        slots = isinstance(cache, SlotCache)
        per_layer = ([cache.layer(i) for i in range(len(self.layers))] if slots
                     else cache if cache is not None else [None] * len(self.layers))
        new_cache = []
        ckpt = self.config.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer, c in zip(self.layers, per_layer):
            if ckpt:  # activation checkpointing: recompute the layer in backward
                h, kv = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, mask, c, embeds, use_reentrant=False)
            else:
                h, kv = layer(h, cos, sin, mask, c, embeds=embeds)
            new_cache.append(kv)
        return h, cache if slots else new_cache

    def forward(self, tokens, features, position_ids, mask, cache=None):
        """Draft logits over the draft vocabulary.

        tokens [B, N] int64 (target ids); features [B, N, 3H]; position_ids [B, N] int64; mask [B, N, S] bool with S = cached length + N (True = attend)
        or a BlockMask (algorithms/cod.py); cache: None or a list of per-layer (k, v).
        Returns (logits [B, N, V_draft], new cache list).
        """
        h, cache = self.hidden_states(tokens, features, position_ids, mask, cache)
        return self.logits(h), cache

    @torch.no_grad()
    def propose(self, tokens, features, position_ids, mask, cache, K: int, pick=None) -> Proposal:
        """K draft tokens per row from K sequential forwards (EAGLE-3): the new real pairs, then
        K-1 one-token forwards that each read the previous draft token and the head's own pre-norm
        hidden state (bypassing fc), at positions last + 1 .. last + K-1.

        Arguments and result as `PEagleDraft.propose`; the returned cache holds the real pairs only
        (the sequential steps' entries are dropped) and the forward count is K.
        """
        B, M = tokens.shape
        h, keep = self.hidden_states(tokens, features.to(self.fc.weight.dtype), position_ids, mask, cache)
        hid, vis, last = h[:, -1:], mask[:, -1:], position_ids[:, -1:]
        c, toks, all_logits = keep, [], []
        for j in range(K):
            if j:
                vis = torch.cat([vis, vis.new_ones(B, 1, 1)], 2)
                hid, c = self.hidden_states(toks[-1][:, None], hid, last + j, vis, c, project=False)
            logits = self.logits(hid)
            idx = logits.argmax(-1) if pick is None else pick(logits)
            toks.append(self.draft_to_target(idx[:, 0]))
            all_logits.append(logits)
        if isinstance(keep, SlotCache):  # the cache passed in: drop the K-1 sequential steps' entries
            keep.crop(-(K - 1))
        return Proposal(torch.stack(toks, 1), torch.cat(all_logits, 1), keep, K)


class PEagleDraft(Eagle3Draft):
    """The P-EAGLE draft head: EAGLE-3's layout plus `mask_hidden` (built last, so a seed's init
    of the shared layers is EAGLE-3's) and the mask token at depth ≥ 1 slots; all K draft tokens
    come from one forward. See the module docstring for its layout."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        T = cfg.target_hidden_size or cfg.hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * T) * MASK_HIDDEN_STD)

    @torch.no_grad()
    def init_mask_hidden(self, std: float) -> None:
        """Make the freshly built `mask_hidden` [1, 1, 3H] a draw of N(0, std²): the constructor's
        N(0, MASK_HIDDEN_STD²) draw rescaled, so the random stream is the same whatever `std`.
        speculators, SpecForge and NeMo Automodel use std 1, the scale of the target's hidden
        states; the layers' own init uses 0.02."""
        self.mask_hidden.mul_(std / MASK_HIDDEN_STD)

    def slot_inputs(self, tokens: torch.Tensor, features: torch.Tensor, is_slot: torch.Tensor):
        """Replace depth ≥ 1 slots by the mask token and `mask_hidden`.

        tokens [B, N] int; features [B, N, 3H]; is_slot [B, N] bool. Returns (tokens, features).
        """
        tokens = torch.where(is_slot, torch.full_like(tokens, self.config.mask_token_id), tokens)
        features = torch.where(is_slot[..., None], self.mask_hidden.reshape(-1).to(features.dtype), features)
        return tokens, features

    def forward(self, tokens, features, position_ids, mask, cache=None, is_slot=None):
        """Draft logits as `Eagle3Draft.forward`; features [B, N, 3H] with `mask_hidden` already
        substituted, or pass is_slot [B, N] bool to substitute the mask token and `mask_hidden` here
        (`slot_inputs` inside forward, so sharded engines (ZeRO-3, FSDP) gather `mask_hidden`).
        Returns (logits [B, N, V_draft], new cache list)."""
        if is_slot is not None:
            tokens, features = self.slot_inputs(tokens, features, is_slot)
        return super().forward(tokens, features, position_ids, mask, cache)

    @torch.no_grad()
    def propose(self, tokens, features, position_ids, mask, cache, K: int, pick=None) -> Proposal:
        """K draft tokens per row from one forward over the new real pairs plus K-1 slots (mask
        token, `mask_hidden`) (DESIGN.md §5; vLLM parallel drafting).

        tokens [B, M] int64: the new real pairs' tokens x_{i+1} (left-padding holes allowed);
        features [B, M, 3H] their target features g_i, any float dtype (cast to the head's);
        position_ids [B, M]; mask [B, M, S+M] bool, the real pairs' visibility over S cached slots
        and themselves (position M-1 must be a real pair in every row); cache: the SlotCache of
        the S cached real pairs (written in place; the slots' entries are cropped again), per-layer
        (k, v) [B, kv_heads, S, head_dim], or None. pick: draft-vocabulary logits [B, N, V_draft] →
        indices [B, N] (default argmax; a sampler for speculative sampling).
        Slot d sees what the last real pair sees plus slots 1..d, at position last + d.
        Returns a Proposal: target ids [B, K], their draft logits [B, K, V_draft], the cache of the
        real pairs only (S + M slots; the slots are dropped) and 1 draft forward.
        """
        B, M = tokens.shape
        S = mask.shape[-1] - M
        features = features.to(self.fc.weight.dtype)
        n = K - 1
        if n:
            dev = tokens.device
            tokens = torch.cat([tokens, torch.full((B, n), self.config.mask_token_id, dtype=tokens.dtype, device=dev)], 1)
            features = torch.cat([features, self.mask_hidden.to(features.dtype).expand(B, n, -1)], 1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, K, device=dev)], 1)
            slots = torch.cat([mask[:, -1:].expand(-1, n, -1),
                               torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(B, -1, -1)], 2)
            mask = torch.cat([torch.cat([mask, mask.new_zeros(B, M, n)], 2), slots], 1)
        logits, new_cache = self(tokens, features, position_ids, mask, cache)
        logits = logits[:, M - 1:]
        idx = logits.argmax(-1) if pick is None else pick(logits)
        if isinstance(new_cache, SlotCache):
            new_cache.crop(-n)
            keep = new_cache
        else:
            keep = [(k[:, :, :S + M], v[:, :, :S + M]) for k, v in new_cache]
        return Proposal(self.draft_to_target(idx), logits, keep, 1)
