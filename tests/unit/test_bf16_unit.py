"""tests/bf16_unit.py: bf16 products computed as fp32 GEMMs of the bf16 operands equal PyTorch's own
bf16 products (a bf16 unit's where the CPU has one) up to the order of the fp32 sums."""

import contextlib

import torch

from tests.bf16_unit import Bf16AsOnAUnit


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _within_one_rounding(native, emulated):
    """Every element within one bf16 spacing (2^-7 of its magnitude) and almost all equal."""
    gap = (native.float() - emulated.float()).abs()
    assert bool((gap <= emulated.float().abs() * 2 ** -7 + 1e-30).all())
    assert float((gap == 0).float().mean()) > 0.95


def test_each_product_is_the_fp32_gemm_of_the_bf16_operands_rounded_once():
    a, b, bias = _bf16(33, 96, seed=0), _bf16(96, 40, seed=1), _bf16(40, seed=2)
    x, y = _bf16(3, 33, 96, seed=3), _bf16(3, 96, 40, seed=4)
    cases = {"mm": (torch.mm, (a, b), (a.float() @ b.float())),
             "addmm": (torch.addmm, (bias, a, b), (bias.float() + a.float() @ b.float())),
             "bmm": (torch.bmm, (x, y), (x.float() @ y.float())),
             "baddbmm": (torch.baddbmm, (bias.expand(3, 33, 40), x, y), (bias.float() + x.float() @ y.float()))}
    for name, (op, args, exact) in cases.items():
        with Bf16AsOnAUnit():
            emulated = op(*args)
        assert emulated.dtype == torch.bfloat16 and torch.equal(emulated, exact.bfloat16()), name
        _within_one_rounding(op(*args), emulated)
    with Bf16AsOnAUnit():  # fp32 products run as they are
        assert torch.equal(a.float() @ b.float(), torch.mm(a.float(), b.float()))


def test_autocast_linear_forward_and_backward_go_through_the_fp32_gemm():
    """Under CPU bf16 autocast a Linear's output and both gradients are bf16 products: under the
    mode they are the rounded fp32 GEMMs, and within one rounding of PyTorch's own."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(20, 64, requires_grad=True)
    def run(mode):
        lin.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), mode:
            out = lin(x)
        out.float().pow(2).sum().backward()
        return out.detach(), lin.weight.grad, x.grad

    native, emulated = run(contextlib.nullcontext()), run(Bf16AsOnAUnit())
    xb, wb = x.detach().bfloat16().float(), lin.weight.detach().bfloat16().float()
    assert torch.equal(emulated[0], (lin.bias.detach().bfloat16().float() + xb @ wb.T).bfloat16())
    g = (2 * emulated[0].float()).bfloat16().float()  # d(sum out²)/d out, rounded to bf16 by the cast's backward
    assert torch.equal(emulated[1], (g.T @ xb).bfloat16().float())  # the backward's products too
    assert torch.equal(emulated[2], (g @ wb).bfloat16().float())
    for n, e in zip(native, emulated):
        assert n.dtype == e.dtype
        if n.dtype == torch.bfloat16:
            _within_one_rounding(n, e)
        else:  # fp32 master gradients of bf16 products: within a bf16 rounding of each other
            assert torch.allclose(n, e, rtol=2 ** -6, atol=1e-3)
