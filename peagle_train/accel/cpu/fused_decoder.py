"""A lean decoding forward for bf16 Llama-architecture targets on the AMX kernels.

At batch 1 a small target's decoding step spends most of its time reading its linear weights and,
before this path, a large share more in transformers' per-layer Python (module calls, decorators,
keyword plumbing, the attention-interface lookup) and in small tensor ops between the kernels
(measured in docs/BENCHMARKS.md, "Decoding step costs"). `FusedDecoder.forward` runs the same computation as transformers'
`LlamaModel.forward` with the modules that `pack_linears` and `fuse_ops` (accel/cpu/__init__.py) leave, as one plain loop:

    x = embed(ids)
    per layer:  h = norm₁(x);  q, k, v = split(h · [W_q; W_k; W_v]ᵀ);  q, k = rope(q, k)
                keys, values = cache.update(k, v);  x = x + attention(q, keys, values) · W_oᵀ
                h = norm₂(x);  g, u = split(h · [W_gate; W_up]ᵀ);  x = x + (silu(g) · u) · W_downᵀ
    final = norm(x)

q/k/v and gate/up each become one AMX call over their weights packed side by side. The AMX kernel
computes every output feature from its own weight row with the same fp32 accumulation order,
whatever the other rows packed beside it, so these calls give the bits of the separate linears;
every other op is the one transformers calls (or the fused norm / rotary embedding it was
replaced by), so the forward gives the bits of transformers' forward over the same modules
(tests/test_fused_decoder.py). Forwards of more than `amx_linear.MAX_ROWS` rows (a long prefill),
other attention masks (a sliding window's dict), gradients or inputs it does not take go to
transformers' forward unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from ...target.capture import decode_attention
from . import amx_linear
from .attention import amx_attention_takes
from .packed_linear import FusedRMSNorm, PackedLinear, fused_rotary

LAYER_TYPES = (LlamaDecoderLayer,)  # transformers layers whose forward is the loop of the module docstring


def _packed(linears: list[PackedLinear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The AMX packing of the linears' weights stacked along their outputs, and their biases
    concatenated (None if none has one; zeros for the ones without)."""
    w = torch.cat([m.weight.detach() for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=w.dtype)
                          for m in linears])
    return amx_linear.kernel().pack(w), bias


class FusedLayer:
    """One decoder layer's weights as `FusedDecoder` uses them: the layer's own norms, o_proj and
    down_proj modules, and the packed [W_q; W_k; W_v] [(H + 2·kv_heads)·d, hidden] and
    [W_gate; W_up] [2·intermediate, hidden] weights."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.attn, self.o_proj, self.down_proj = attn, attn.o_proj, mlp.down_proj
        self.head_dim, self.scaling, self.layer_idx = attn.head_dim, attn.scaling, attn.layer_idx
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        self.heads, self.kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.qkv, self.qkv_bias = _packed([attn.q_proj, attn.k_proj, attn.v_proj])
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up, self.gate_up_bias = _packed([mlp.gate_proj, mlp.up_proj])


def _fusable(model: nn.Module) -> bool:
    """Whether every decoder layer of `model` is of a `LAYER_TYPES` type whose linears are packed
    for the AMX kernel, whose norms are fused, whose activation is SiLU, and whose attention is
    plain (no sliding window; any attention bias is a linear bias)."""
    decoder = model.get_decoder()
    cfg = decoder.config
    if getattr(cfg, "sliding_window", None) or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    for layer in decoder.layers:
        if type(layer) not in LAYER_TYPES:
            return False
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(isinstance(m, PackedLinear) and m.amx is not None for m in linears):
            return False
        if not all(isinstance(n, FusedRMSNorm) for n in (layer.input_layernorm, layer.post_attention_layernorm, decoder.norm)):
            return False
    return True


class FusedDecoder:
    """The decoding forward of the module docstring over a fused model's decoder.

    Built by `fuse_decoder`; `FeatureTarget.forward` (target/capture.py) calls it for decoding
    forwards it `takes`. Holds a second AMX packing of the q/k/v and gate/up weights (two thirds of
    the decoder layers' linear weights once more: 139 MB for SmolLM2-135M); the modules and their
    parameters are not changed.
    """

    def __init__(self, model: nn.Module):
        self.decoder = model.get_decoder()
        self.layers = [FusedLayer(layer) for layer in self.decoder.layers]

    def takes(self, input_ids: torch.Tensor, cache, kw: dict) -> bool:
        """Whether `forward` computes this forward: a cache, at most MAX_ROWS new tokens, no
        gradients, the model still bf16 on CPU, an attention mask that is None or a bool
        [B|1, 1, n, S], and no keyword besides attention_mask and position_ids."""
        mask, w = kw.get("attention_mask"), self.decoder.embed_tokens.weight
        return (cache is not None and input_ids.numel() <= amx_linear.MAX_ROWS and not torch.is_grad_enabled()
                and w.dtype == torch.bfloat16 and w.device.type == "cpu"
                and set(kw) <= {"attention_mask", "position_ids"}
                and (mask is None or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4)))

    def forward(self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, capture: tuple[int, ...] = ()):
        """input_ids [B, n]; cache: the HF cache the new keys and values are written to;
        attention_mask None (causal over the cache and the new slots) or bool [B|1, 1, n, S]
        (True = attend, S = cached + n slots); position_ids [B, n] (default: continuing the
        cache's length). Returns (final normed hidden states [B, n, hidden], {i: output of layer i
        [B, n, hidden] for i in capture; -1: the embeddings}), the bits of transformers' forward over the same modules."""
        ext = amx_linear.kernel()
        x = self.decoder.embed_tokens(input_ids)
        B, n = input_ids.shape
        if position_ids is None:
            position_ids = (torch.arange(n, device=x.device) + cache.get_seq_length())[None]
        captured = {-1: x} if -1 in capture else {}  # the embeddings (aux id 0)
        cos, sin = self.decoder.rotary_emb(x, position_ids=position_ids)
        rope = fused_rotary(_transformers_rotary())  # the kernel where it takes the shapes
        on_amx = None
        for i, L in enumerate(self.layers):
            h = L.input_norm(x)
            qkv = ext.linear(h, L.qkv, L.q_size + 2 * L.kv_size, L.qkv_bias).view(B, n, -1, L.head_dim)
            q = qkv[:, :, :L.heads].transpose(1, 2)
            k = qkv[:, :, L.heads:L.heads + L.kv_heads].transpose(1, 2)
            v = qkv[:, :, L.heads + L.kv_heads:].transpose(1, 2)
            q, k = rope(q, k, cos, sin)
            keys, values = cache.update(k, v, L.layer_idx)
            if on_amx is None:  # the same dtypes, strides and mask at every layer
                on_amx = amx_attention_takes(q, keys, values, attention_mask)
            if on_amx:
                att = amx_linear.amx_attention(q, keys, values, attention_mask, L.scaling)
            else:
                att = decode_attention(L.attn, q, keys, values, attention_mask, scaling=L.scaling)[0]
            x = x + L.o_proj(att.reshape(B, n, -1))
            h = L.post_norm(x)
            gate_up = ext.linear(h, L.gate_up, 2 * L.intermediate, L.gate_up_bias)
            x = x + L.down_proj(F.silu(gate_up[..., :L.intermediate]) * gate_up[..., L.intermediate:])
            if i in capture:
                captured[i] = x
        return self.decoder.norm(x), captured


def _transformers_rotary():
    """transformers' own `apply_rotary_pos_emb` of the Llama module (for head sizes the fused
    kernel does not take)."""
    from transformers.models.llama import modeling_llama

    return modeling_llama.apply_rotary_pos_emb


def fuse_decoder(model: nn.Module) -> bool:
    """Give a model whose linears `pack_linears` packed for the AMX kernel and whose norms
    `fuse_ops` fused its `FusedDecoder` (`model.peagle_fused_decoder`, the hook that
    `FeatureTarget.forward` looks for), where every layer is of a kind it computes (`LAYER_TYPES`,
    SiLU, no sliding window); returns whether it did."""
    model.peagle_fused_decoder = FusedDecoder(model) if amx_linear.kernel() is not None and _fusable(model) else None
    return model.peagle_fused_decoder is not None
