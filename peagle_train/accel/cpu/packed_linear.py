"""bf16 linear layers with their weights packed once for oneDNN, and fused small ops, for decoding on CPU.

At decoding shapes (1 to ~100 rows) a bf16 `F.linear` on CPU spends most of its time re-laying
out the weight for oneDNN at every call, most of a 1-row forward's time (docs/BENCHMARKS.md,
"Decoding step costs"). `pack_linears` replaces every `nn.Linear` of a bf16 CPU module by a `PackedLinear`
that calls the same oneDNN kernel on a pre-packed copy of the weight (what torch.compile's
freezing pass does for CPU linears, `torch.ops.mkldnn._linear_pointwise`), so the outputs are
bit-identical to `F.linear`'s (tests/unit/test_packed_linear.py) and lossless checks are unaffected.

On a CPU with Intel AMX, up to `amx_linear.MAX_ROWS` rows go to the AMX kernel of
amx_linear.py instead (its own packing of the same weight): it reads each weight at the
memory's speed where oneDNN's small-row kernels often take twice as long. Its output equals
`F.linear`'s bit for bit up to 16 rows (tested) and rounds each row alike whatever the row count.

With the AMX extension built, `fuse_ops` (accel/cpu/__init__.py) also replaces the target's and
heads' RMSNorms by `FusedRMSNorm` (one AVX-512 call, csrc/amx_norm.cpp, instead of ~9 tensor ops).
A fused norm can differ from the module in the last bit (its own order for the sum of squares) and
normalises each row by itself. It is a module swap: transformers' functions are never patched.

fp32 modules are left alone: the packed fp32 kernel is faster too but rounds differently from
MKL's, and fp32 keeps the exact lossless check. The dense weight stays the module's parameter
(state dicts, fingerprints, tied embeddings and `.weight` readers see no change); the packed copy
is a plain attribute, so it costs the weights' memory once more (twice with AMX) and is not saved.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F
from torch import nn

from . import amx_linear

logger = logging.getLogger(__name__)


def packing_available() -> bool:
    """Whether this torch build has the oneDNN linear ops that `PackedLinear` calls, and this CPU
    oneDNN's bf16 path (AVX512BW/VL/DQ or AVX-NE-CONVERT: a CPU with AVX2 alone has none, and the
    weight reorder raises there)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


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
    return n


# transformers' RMSNorm classes computing `weight * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)`, by
# modeling module: a model whose norms are one of them has imported that module already
NORM_CLASSES = {"transformers.models.llama.modeling_llama": "LlamaRMSNorm",
                "transformers.models.mistral.modeling_mistral": "MistralRMSNorm",
                "transformers.models.qwen2.modeling_qwen2": "Qwen2RMSNorm",
                "transformers.models.qwen3.modeling_qwen3": "Qwen3RMSNorm",
                "transformers.models.qwen3_moe.modeling_qwen3_moe": "Qwen3MoeRMSNorm"}


def norm_types() -> tuple[type, ...]:
    """The `NORM_CLASSES` types of the modeling modules imported in this process (a type check: a
    subclass or a same-named class of another module is not taken)."""
    mods = ((sys.modules.get(m), c) for m, c in NORM_CLASSES.items())
    return tuple(getattr(m, c) for m, c in mods if m is not None and hasattr(m, c))


class FusedRMSNorm(nn.Module):
    """A transformers RMSNorm of a `NORM_CLASSES` type (bf16, CPU) computed by one AVX-512 call
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
