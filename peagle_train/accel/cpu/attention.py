"""The AMX decoding attention hooked into transformers' attention interface.

`use_amx_attention` registers `amx_decode_attention` under its own name (`AMX_DECODE_ATTENTION`)
in `AttentionInterface` (and the masks `sdpa` gets in `AttentionMaskInterface`) and names it in a
target's config (`peagle_decode_attention`), so that the target's decoding forwards
(target/capture.py `decoding_attention`) select it as their attn_implementation. Nothing of
transformers is patched, and importing this module registers nothing. Inputs the kernel does not
take go to the core's `decode_attention`.
"""

from __future__ import annotations

import torch
from torch import nn

from ...target.capture import decode_attention
from . import amx_linear

AMX_DECODE_ATTENTION = "peagle_amx_decode"


def amx_attention_available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `amx_decode_attention` runs on the AMX kernel (amx_linear.py `amx_attention`)
    for a target of this dtype and head size: bf16, head_dim a multiple of 32 up to 256, and the
    kernel built on this CPU."""
    if dtype != torch.bfloat16 or head_dim % 32 or head_dim > 256:
        return False
    return amx_linear.kernel() is not None


def amx_attention_takes(query, key, value, mask) -> bool:
    """Whether the AMX kernel takes these decoding attention inputs: CPU, key and value in the
    query's dtype with a contiguous last dim, no mask or a bool [B|1, 1, n, S] mask, and
    `amx_attention_available` for the dtype and head size."""
    n, S = query.shape[2], key.shape[2]
    return (query.device.type == "cpu" and key.dtype == query.dtype and value.dtype == query.dtype
            and key.stride(-1) == 1 and value.stride(-1) == 1
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                                  and mask.shape[2] == n and mask.shape[3] == S))
            and amx_attention_available(query.dtype, query.shape[-1]))


def amx_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """`decode_attention` (target/capture.py) with bf16 entries on the AMX kernel.

    query [B, heads, n, d], key/value [B, kv_heads, S, d]. bf16 entries (the cache is then kept in
    bf16, decoding/engine.py `target_cache`) with no mask or a bool mask, head_dim a multiple of 32
    up to 256, no dropout, softcap or attention sinks go to `amx_attention` (amx_linear.py): the
    same fp32 accumulation, half the cache's bytes read, and each query rounded as if alone, so
    that a batch with holes decodes each row as the row alone would. Returns ([B, n, heads, d],
    None); everything else is `decode_attention`'s."""
    H, kvh = query.shape[1], key.shape[1]
    if (not dropout and not H % kvh and kw.get("softcap") is None and kw.get("s_aux") is None
            and amx_attention_takes(query, key, value, attention_mask)):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return amx_linear.amx_attention(query, key, value, attention_mask, scale), None
    return decode_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)


amx_decode_attention.keeps_cache_dtype = amx_attention_available  # read by target/capture.py `keeps_cache_dtype`


def register_amx_attention() -> None:
    """Register `amx_decode_attention` as AMX_DECODE_ATTENTION in transformers' attention interface
    (with the masks `sdpa` gets: causal, sliding window). `use_amx_attention` calls it before it
    names the function in a config; importing this module registers nothing."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(AMX_DECODE_ATTENTION, amx_decode_attention)
    AttentionMaskInterface.register(AMX_DECODE_ATTENTION, sdpa_mask)


def _configs(model: nn.Module) -> list:
    configs = [model.config] if hasattr(model, "config") else []
    if hasattr(model, "get_decoder") and model.get_decoder().config is not model.config:
        configs.append(model.get_decoder().config)
    return configs


def use_amx_attention(model: nn.Module) -> bool:
    """Name `AMX_DECODE_ATTENTION` as the decoding attention of a target `model` (an HF causal LM)
    when the AMX kernel is built; returns whether it did. `drop_amx_attention` undoes it."""
    if amx_linear.kernel() is None or not hasattr(model, "get_decoder"):
        return False
    register_amx_attention()
    for cfg in _configs(model):
        cfg.peagle_decode_attention = AMX_DECODE_ATTENTION
    return True


def drop_amx_attention(model: nn.Module) -> None:
    """Give the decoding forwards of `model` the core's `decode_attention` again."""
    for cfg in _configs(model):
        if getattr(cfg, "peagle_decode_attention", None) == AMX_DECODE_ATTENTION:
            del cfg.peagle_decode_attention
