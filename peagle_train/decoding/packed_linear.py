"""bf16 linear layers with their weights packed once for oneDNN, and fused small ops, for decoding on CPU.

At decoding shapes (1 to ~100 rows) a bf16 `F.linear` on CPU spends most of its time re-laying
out the weight for oneDNN at every call, most of a 1-row forward's time (docs/BENCHMARKS.md,
"Decoding step costs"). `pack_linears` replaces every `nn.Linear` of a bf16 CPU module by a `PackedLinear`
that calls the same oneDNN kernel on a pre-packed copy of the weight (what torch.compile's
freezing pass does for CPU linears, `torch.ops.mkldnn._linear_pointwise`), so the outputs are
bit-identical to `F.linear`'s (tests/test_packed_linear.py) and lossless checks are unaffected.

On a CPU with Intel AMX, up to `amx_linear.MAX_ROWS` rows go to the AMX kernel of
decoding/amx_linear.py instead (its own packing of the same weight): it reads each weight at the
memory's speed where oneDNN's small-row kernels often take twice as long. Its output equals
`F.linear`'s bit for bit up to 16 rows (tested) and rounds each row alike whatever the row count.

With the AMX extension built, `fuse_ops` also replaces the target's and heads' RMSNorms by
`FusedRMSNorm` (one AVX-512 call, csrc/amx_norm.cpp, instead of ~9 tensor ops) and runs the rotary
embedding of Llama-family targets as one call (`fused_rotary`). The rotary embedding gives transformers' bits; a fused norm can differ
from the module in the last bit (its own order for the sum of squares) and normalises each row by
itself.

fp32 modules are left alone: the packed fp32 kernel is faster too but rounds differently from
MKL's, and fp32 keeps the exact lossless check. The dense weight stays the module's parameter
(state dicts, fingerprints, tied embeddings and `.weight` readers see no change); the packed copy
is a plain attribute, so it costs the weights' memory once more (twice with AMX) and is not saved.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from . import amx_linear

logger = logging.getLogger(__name__)


def packing_available() -> bool:
    """Whether this torch build has the oneDNN linear ops that `PackedLinear` calls."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """An `nn.Linear` (bf16, CPU) whose forward uses a weight packed once for oneDNN.

    Holds the original `weight` [out, in] and `bias` [out] parameters (the same tensors, so a tied
    lm_head stays tied) and `packed`, their oneDNN layout. forward: x [..., in] → [..., out],
    bit-identical to `F.linear(x, weight, bias)`; any other dtype or device (e.g. after `.to()`),
    and a non-contiguous x with a bias (which `F.linear` adds after the product, rounding twice),
    fall back to `F.linear`. `amx` is the AMX kernel's packing of the weight (None without AMX);
    inputs of at most `amx_linear.MAX_ROWS` rows use it.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        ext = amx_linear.kernel()
        self.amx = ext.pack(linear.weight.detach()) if ext is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu" or w.device.type != "cpu"
                or (self.bias is not None and not x.is_contiguous())):  # F.linear adds such a bias unfused
            return F.linear(x, w, self.bias)
        if self.amx is not None and x.numel() <= amx_linear.MAX_ROWS * self.in_features:
            return amx_linear.amx_linear(x, self.amx, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed{' (oneDNN + AMX)' if self.amx is not None else ''}")


def _linears(model: nn.Module, cls):
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is cls:
                yield parent, name, child


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` (in place) by a `PackedLinear` when the model's weights
    are bf16 on CPU and this torch has the oneDNN ops; returns how many were packed (0 otherwise:
    fp32, CUDA, or no oneDNN). Packing takes ~0.5 s for a 135M-parameter model."""
    first = next(model.parameters(), None)
    if first is None or first.dtype != torch.bfloat16 or first.device.type != "cpu" or not packing_available():
        return 0
    n = 0
    for parent, name, child in list(_linears(model, nn.Linear)):
        if child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
            setattr(parent, name, PackedLinear(child))
            n += 1
    if n:
        logger.info("packed %d bf16 linear layers of %s for oneDNN%s", n, type(model).__name__,
                    f" and the AMX kernel (up to {amx_linear.MAX_ROWS} rows)" if amx_linear.kernel() else "")
    return n


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears`: every `PackedLinear` becomes an `nn.Linear` over the same parameters;
    returns how many."""
    n = 0
    for parent, name, child in list(_linears(model, PackedLinear)):
        lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                        device="meta", dtype=child.weight.dtype)
        lin.weight, lin.bias = child.weight, child.bias
        setattr(parent, name, lin)
        n += 1
    if n:
        model.peagle_fused_decoder = None  # its packed weights are the old ones
    return n


# transformers modeling modules whose `apply_rotary_pos_emb` is q·cos + rotate_half(q)·sin
ROPE_MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"))


def fused_rotary(original):
    """`original` (a transformers `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`) with
    bf16 CPU inputs computed by one kernel call (csrc/amx_norm.cpp `rope`) instead of ~14 tensor
    ops: q, k [B, heads, n, d] (d a multiple of 32), cos, sin [B|1, n, d]; every element rounded
    as transformers rounds it in bf16, so the outputs are the same bits. Inputs that need
    gradients, other dtypes, shapes and devices go to `original`, and so does every call outside
    `fused_rotary_scope` (another model in the process keeps transformers' own code)."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (unsqueeze_dim == 1 and q.device.type == "cpu" and q.dim() == k.dim() == 4 and cos.dim() == 3
                and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.bfloat16 and q.shape[-1] % 32 == 0
                and q.stride(-1) == 1 and k.stride(-1) == 1
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
                and _rotary_scope):
            ext = amx_linear.kernel()
            if ext is not None:
                return tuple(ext.rope(q, k, cos, sin))
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.fused = True
    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


_rotary_scope: list = []  # non-empty while a model that `fuse_ops` fused runs a forward


@contextmanager
def fused_rotary_scope(model: nn.Module):
    """Within this block, forwards of `model` use the fused rotary embedding if `fuse_ops` fused
    it (target/features.py `FeatureTarget.forward` enters it for every forward)."""
    if not getattr(model, "peagle_fused_rotary", False):
        yield
        return
    _rotary_scope.append(model)
    try:
        yield
    finally:
        _rotary_scope.pop()


# RMSNorm modules computing `weight * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)` (transformers)
NORM_CLASSES = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm"}


class FusedRMSNorm(nn.Module):
    """A transformers RMSNorm of the `NORM_CLASSES` kind (bf16, CPU) computed by one AVX-512 call
    (csrc/amx_norm.cpp) instead of ~9 tensor ops: the same fp32 arithmetic and the two bf16
    roundings of the module, with the sum of squares in the kernel's own (fixed, per-row) order,
    so an output can differ from the module's in the last bit and never depends on other rows.
    Holds the module's `weight` parameter and eps; x [..., H] → [..., H]. Other dtypes and devices
    fall back to the module's formula."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon
        object.__setattr__(self, "original", norm)  # not a submodule: the state dict keeps `weight` only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and x.device.type == "cpu":
            return amx_linear.kernel().rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, fused ({type(self.original).__name__})"


def fuse_ops(model: nn.Module) -> int:
    """Fuse a bf16 CPU model's small decoding ops where the AMX extension is built: every RMSNorm
    of a `NORM_CLASSES` kind becomes a `FusedRMSNorm` (in place), and the rotary embedding of the
    modeling modules in `ROPE_MODULES` that the model uses runs as one call (`fused_rotary`).
    Returns how many norms were fused (0 otherwise)."""
    first = next(model.parameters(), None)
    if first is None or first.dtype != torch.bfloat16 or first.device.type != "cpu" or amx_linear.kernel() is None:
        return 0
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in NORM_CLASSES and hasattr(child, "variance_epsilon"):
                setattr(parent, name, FusedRMSNorm(child))
                n += 1
    for mod in {type(m).__module__ for m in model.modules()} & set(ROPE_MODULES):
        module = sys.modules[mod]
        if not getattr(module.apply_rotary_pos_emb, "fused", False):
            module.apply_rotary_pos_emb = fused_rotary(module.apply_rotary_pos_emb)
        model.peagle_fused_rotary = True
    if hasattr(model, "get_decoder"):  # a target: its decoding forward as one loop (decoding/fused_decoder.py)
        from .fused_decoder import fuse_decoder

        fuse_decoder(model)
    return n


def unfuse_ops(model: nn.Module) -> int:
    """Undo `fuse_ops`' norms: every `FusedRMSNorm` gives back its original module (the same
    weight parameter) and its forwards use transformers' rotary embedding again; returns how many
    norms."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedRMSNorm):
                child.original.weight = child.weight
                setattr(parent, name, child.original)
                n += 1
    model.peagle_fused_rotary = False
    model.peagle_fused_decoder = None
    return n
