"""bf16 matrix products as a bf16 unit computes them, at fp32 speed, for CPUs without one.

A bf16 unit (AMX, AVX512-BF16, a GPU's tensor cores) multiplies bf16 operands exactly and sums the
products in fp32, rounding the result to bf16 once. A CPU without one (AVX2 only) runs PyTorch's
emulated bf16 GEMM instead, far slower than its fp32 one. Under `Bf16AsOnAUnit` each bf16
`mm`, `addmm`, `bmm` and `baddbmm` (forward and backward, autocast's included) takes its operands'
exact fp32 values, runs the fp32 GEMM and rounds the result to bf16: the same numbers up to the
order of the fp32 sums (tests/unit/test_bf16_unit.py). Every other op runs as it is.
"""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peagle_train.precision import cpu_bf16_units

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class Bf16AsOnAUnit(TorchDispatchMode):
    """The bf16 matrix products inside the `with` block as fp32 GEMMs of the bf16 operands, the
    result [.., M, N] rounded to bf16; other ops and other dtypes unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            exact = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
            return func(*exact, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def bf16_as_on_a_unit_without_one():
    """`Bf16AsOnAUnit()` on a CPU without a bf16 unit (`cpu_bf16_units` None), else a context that
    changes nothing."""
    return Bf16AsOnAUnit() if cpu_bf16_units() is None else contextlib.nullcontext()
