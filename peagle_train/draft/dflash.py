"""The DFlash draft head (DFlash, arXiv 2602.06036, as vLLM serves it: `DFlashDraftModel`,
vllm/model_executor/models/qwen3_dflash.py).

A block drafter conditioned on the target's aux hidden states through attention, not through its
input. For a verified prefix x_0..x_{p-1} with target features g_0..g_{p-1}:
    context      c_i = hidden_norm(fc(g_i)) at position i; every layer projects c_i to its own keys
                 and values (k_norm, RoPE), so the features enter every layer as keys and values
    block        queries [x_p, m, .., m] (the anchor, the last verified token, then K mask tokens
                 m = `mask_token_id`) at positions p .. p+K, embedded by `embed_tokens`
    layers[i]    Qwen3-style decoder layers (q_norm/k_norm per head) whose queries attend to the
                 visible context and to the block itself, non-causally (or causally with
                 `block_causal`); with `sliding_window` W a query at position q sees only keys at
                 positions > q - W (vLLM's sliding-window layers)
    norm, lm_head final RMSNorm, Linear(H → V_draft); slot j = 1..K predicts x_{p+j}
    d2t, t2d      draft-vocabulary buffers (data.vocab.DraftVocab)
Module names follow vLLM's DFlash loader (it prefixes every name but lm_head with `model.`).

In the row layout of training (target/capture.py `align_for_draft`: row position i holds x_{i+1}
and g_i at position i), the block anchored at row position a reads the context of row positions
≤ a of its document and the anchor token tokens[a] at position pos_ids[a] + 1; slot j's label is
the target distribution of row position a + j - 1. The decoder's pending pairs (x_{i+1}, g_i) at
position i give the same picture: the cache holds the context, the last pair's token is the anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from .base import DraftHead, DraftMLP, Proposal, flex_attention_for
from .head_config import DraftConfig
from .kv_cache import SlotCache


@dataclass
class ContextStates:
    """The context before its per-layer projection: states [B, S, H] (`hidden_norm(fc(features))`)
    and their RoPE cos/sin [B, S, head_dim]. A layer projects it to its keys and values inside its
    own forward, so a sharded engine (FSDP2 shards each layer) has gathered the layer's weights."""

    states: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class DFlashAttention(nn.Module):
    """GQA attention of one DFlash layer: queries from the block, keys/values from the context and
    the block. Every projection reads H (no 2H input as in P-EAGLE's first layer)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(H, self.kvh * self.d, bias=False)
        self.v_proj = nn.Linear(H, self.kvh * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, H, bias=False)
        self.q_norm = LlamaRMSNorm(self.d, eps=cfg.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.d, eps=cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values of x [B, N, H] at cos/sin [B, N, head_dim]:
        each [B, kv_heads, N, head_dim]."""
        B, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, N, self.kvh, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.kvh, self.d).transpose(1, 2)
        return apply_rotary_pos_emb(k, k, cos, sin)[0], v

    def forward(self, x, cos, sin, context_kv, mask):
        """x [B, N, H] block hidden states; cos/sin [B, N, head_dim]; context_kv: (k, v) [B, kv_heads,
        S, head_dim] each (`kv` of the context); mask [B, N, S+N] bool (True = attend; keys are the
        S context entries, then the N block entries) or a FlexAttention BlockMask over [N, S+N].
        Returns [B, N, H]."""
        B, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, N, self.h, self.d)).transpose(1, 2)
        q = apply_rotary_pos_emb(q, q, cos, sin)[0]
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([context_kv[0].to(k.dtype), k], 2), torch.cat([context_kv[1].to(v.dtype), v], 2)
        if isinstance(mask, BlockMask):
            out = flex_attention_for(q.device)(q, k, v, block_mask=mask, enable_gqa=True)
        else:
            rep = self.h // self.kvh
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                                 attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(B, N, self.h * self.d))


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer (Qwen3's) whose attention also reads the context keys/values."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H = cfg.hidden_size
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)

    def forward(self, h, cos, sin, context, mask):
        """h [B, N, H]; context: this layer's (k, v) of the context (decoding keeps them cached) or
        the ContextStates it projects itself (training); mask as DFlashAttention's."""
        kv = self.self_attn.kv(context.states, context.cos, context.sin) if isinstance(context, ContextStates) else context
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def block_visibility(K: int, cfg: DraftConfig, device) -> torch.Tensor:
    """[K+1, K+1] bool: which block entries each block query sees: all (non-causal), those up to
    itself (`block_causal`), and with `sliding_window` W only those fewer than W slots behind."""
    s = torch.arange(K + 1, device=device)
    vis = torch.ones(K + 1, K + 1, dtype=torch.bool, device=device)
    if cfg.block_causal:
        vis &= s[None, :] <= s[:, None]
    if cfg.sliding_window is not None:
        vis &= (s[:, None] - s[None, :]) < cfg.sliding_window
    return vis


class DFlashDraft(DraftHead):
    """The DFlash draft head. See the module docstring for its layout."""

    def __init__(self, cfg: DraftConfig):
        if cfg.algorithm != "dflash":
            raise ValueError(f"DFlashDraft needs algorithm='dflash', got {cfg.algorithm!r}")
        super().__init__(cfg)
        H = cfg.hidden_size
        T = cfg.target_hidden_size or H
        self.fc = nn.Linear(len(cfg.aux_layer_ids or [0, 0, 0]) * T, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.add_output_layers()

    def context_states(self, features: torch.Tensor, position_ids: torch.Tensor) -> ContextStates:
        """The context of features [B, S, 3H] (the target's aux hidden states) at position_ids [B, S]."""
        c = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(c, position_ids)
        return ContextStates(c, cos, sin)

    def context_kv(self, features: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of the context (decoding; outside any sharded engine):
        features [B, S, 3H] at position_ids [B, S] → [(k, v) each [B, kv_heads, S, head_dim]]."""
        ctx = self.context_states(features, position_ids)
        return [layer.self_attn.kv(ctx.states, ctx.cos, ctx.sin) for layer in self.layers]

    def block_hidden(self, tokens, position_ids, context, mask) -> torch.Tensor:
        """The last layer's output before the final norm, [B, N, H], for block tokens [B, N] (mask
        tokens already in place) at position_ids [B, N], given the context (a ContextStates every
        layer projects, or per layer its (k, v)) and mask [B, N, S+N] bool or a BlockMask."""
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary_emb(h, position_ids)
        ckpt = self.config.gradient_checkpointing and self.training and torch.is_grad_enabled()
        per_layer = [context] * len(self.layers) if isinstance(context, ContextStates) else context
        for layer, kv in zip(self.layers, per_layer):
            if ckpt:  # activation checkpointing: recompute the layer in backward
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, kv, mask, use_reentrant=False)
            else:
                h = layer(h, cos, sin, kv, mask)
        return h

    def forward(self, features, context_position_ids, tokens, position_ids, mask, logits_at=None):
        """Draft logits over the draft vocabulary for a set of blocks over one shared context.

        features [B, S, 3H] and context_position_ids [B, S]: the context; tokens [B, N] int64 and
        position_ids [B, N]: the blocks (anchor tokens and mask tokens); mask [B, N, S+N] bool
        (algorithms/dflash.py `dflash_mask`) or a BlockMask; logits_at [M] int64: the block entries
        whose logits are wanted (training skips the anchors'), None for all. Returns logits
        [B, N, V_draft] ([B, M, V_draft] with logits_at).
        """
        ctx = self.context_states(features, context_position_ids)
        h = self.block_hidden(tokens, position_ids, ctx, mask)
        return self.logits(h if logits_at is None else h[:, logits_at])

    def context_visibility(self, seen: torch.Tensor, last_pos: torch.Tensor, K: int) -> torch.Tensor:
        """[B, K+1, S] bool: what each of the block's K + 1 queries sees of the S context entries,
        given `seen` [B, S] bool, the entries the last real pair sees (its row's pairs 0..p-1, in
        order: entry positions are their ranks), and that pair's position `last_pos` [B] (= p - 1).
        With `sliding_window` W, query s (position p + s) sees entries at positions > p + s - W.
        Raises ValueError when a row's visible entries are not its pairs 0..p-1."""
        vis = seen[:, None, :].expand(-1, K + 1, -1)
        W = self.config.sliding_window
        if W is None:
            return vis
        rank = seen.long().cumsum(-1) - 1                                        # [B, S] entry positions
        if not torch.equal(rank[:, -1], last_pos):
            raise ValueError(f"DFlash sliding window: the last pair sees {(rank[:, -1] + 1).tolist()} entries but "
                             f"sits at positions {last_pos.tolist()}; a windowed head needs each row's pairs 0..p-1")
        q = last_pos[:, None] + 1 + torch.arange(K + 1, device=seen.device)  # [B, K+1]
        return vis & ((q[:, :, None] - rank[:, None, :]) < W)

    @torch.no_grad()
    def propose(self, tokens, features, position_ids, mask, cache, K: int, pick=None) -> Proposal:
        """K draft tokens per row from one forward over the block [x_p, m × K] (vLLM's DFlash
        proposer, `sample_from_anchor` false).

        tokens [B, M] int64: the new real pairs' tokens x_{i+1}; features [B, M, 3H] their target
        features g_i; position_ids [B, M] (pair i at position i); mask [B, M, S+M] bool, the real
        pairs' visibility over S cached pairs and themselves (position M-1 must be a real pair in
        every row: its token is the anchor, its row of `mask` the context the block sees). cache:
        the SlotCache of the S cached pairs' context keys/values (written in place), per-layer
        (k, v) [B, kv_heads, S, head_dim], or None. pick: draft logits [B, K, V_draft] → indices
        [B, K] (default argmax).
        The anchor sits at position (last pair's) + 1 and slot j at + 1 + j; the block attends to
        itself non-causally (causally with `block_causal`); with `sliding_window`, `context_visibility`
        and `block_visibility` keep each query's keys within its window.
        Returns a Proposal: target ids [B, K], their draft logits [B, K, V_draft], the cache of the
        context (S + M entries) and 1 draft forward.
        """
        B, M = tokens.shape
        dev = tokens.device
        new = self.context_kv(features, position_ids)
        if isinstance(cache, SlotCache):
            kv = [cache.layer(i).update(k, v) for i, (k, v) in enumerate(new)]
            keep = cache
        elif cache is not None:
            kv = [(torch.cat([c[0], k], 2), torch.cat([c[1], v], 2)) for c, (k, v) in zip(cache, new)]
            keep = kv
        else:
            kv = keep = new
        block = torch.cat([tokens[:, -1:], torch.full((B, K), self.config.mask_token_id, dtype=tokens.dtype,
                                                      device=dev)], 1)
        pos = position_ids[:, -1:] + 1 + torch.arange(K + 1, device=dev)
        vis = torch.cat([self.context_visibility(mask[:, -1], position_ids[:, -1], K),
                         block_visibility(K, self.config, dev).expand(B, -1, -1)], 2)
        logits = self.logits(self.block_hidden(block, pos, kv, vis))[:, 1:]
        idx = logits.argmax(-1) if pick is None else pick(logits)
        return Proposal(self.draft_to_target(idx), logits, keep, 1)

