"""CPU acceleration for bf16 decoding, as a plug-in: Intel AMX kernels (csrc/*.cpp, compiled at
first use by amx_linear.py), packed linears and fused RMSNorms (packed_linear.py) and the AMX
decoding attention (attention.py), under transformers' own forward.

It hooks into a model from outside: linears and norms by module swap, attention through
transformers' attention interface (a registered function that the model's config names). The core
never imports this package; evaluation makes one call, `accelerate_for_decoding(model)`. Without
it, or with PEAGLE_AMX=0, everything decodes through transformers' modules.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from . import amx_linear
from .attention import drop_amx_attention, use_amx_attention
from .packed_linear import FusedRMSNorm, norm_types, pack_linears, unpack_linears

__all__ = ["accelerate_for_decoding", "fuse_ops", "unfuse_ops", "pack_linears", "unpack_linears"]


def accelerate_for_decoding(model: nn.Module) -> bool:
    """Put a model (an HF target or a draft head, already in its decoding dtype and device) on the
    CPU kernels, in place: undo any earlier acceleration (its packed weights would be stale), then,
    unless PEAGLE_AMX=0, pack its bf16 linears (`pack_linears`: oneDNN, and AMX up to
    `amx_linear.MAX_ROWS` rows), fuse its RMSNorms (`fuse_ops`), and select the AMX decoding
    attention for a target
    (`use_amx_attention`). fp32 models and other devices are left as transformers runs them.
    Returns whether anything was swapped in."""
    unpack_linears(model)
    unfuse_ops(model)
    drop_amx_attention(model)
    if os.environ.get("PEAGLE_AMX", "1") == "0":
        return False
    packed = pack_linears(model)
    fused = fuse_ops(model)
    first = next(model.parameters(), None)
    attention = (first is not None and first.dtype == torch.bfloat16 and first.device.type == "cpu"
                 and use_amx_attention(model))
    return bool(packed or fused or attention)


def fuse_ops(model: nn.Module) -> int:
    """Fuse a bf16 CPU model's RMSNorms where the AMX extension is built: every RMSNorm of a
    `packed_linear.NORM_CLASSES` type becomes a `FusedRMSNorm` (in place). Returns how many norms
    were fused (0 otherwise)."""
    first = next(model.parameters(), None)
    if first is None or first.dtype != torch.bfloat16 or first.device.type != "cpu" or amx_linear.kernel() is None:
        return 0
    n = 0
    types = norm_types()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in types and hasattr(child, "variance_epsilon"):
                setattr(parent, name, FusedRMSNorm(child))
                n += 1
    return n


def unfuse_ops(model: nn.Module) -> int:
    """Undo `fuse_ops`: every `FusedRMSNorm` gives back its original module (the same weight
    parameter); returns how many norms."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedRMSNorm):
                child.original.weight = child.weight
                setattr(parent, name, child.original)
                n += 1
    return n
