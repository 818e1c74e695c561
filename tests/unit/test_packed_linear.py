"""bf16 linears packed once for oneDNN (accel/cpu/packed_linear.py): bit-identical outputs, the same
parameters and state dict, the same decoded tokens; fp32 modules are never packed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from peagle_train.decoding.engine import generate
from peagle_train.accel.cpu.packed_linear import PackedLinear, pack_linears, packing_available, unpack_linears
from peagle_train.evaluation.run import prepare_for_decoding

from ..integration.test_evaluate import small_pair

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")]


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_bit_identical_to_f_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias).to(torch.bfloat16).requires_grad_(False)
    p = PackedLinear(lin)
    assert p.weight is lin.weight and p.bias is lin.bias
    for x in (torch.randn(1, 64), torch.randn(3, 7, 64), torch.randn(2, 64, 5).transpose(1, 2)):  # the last not contiguous
        x = x.bfloat16()
        y = p(x)
        assert y.shape == (*x.shape[:-1], 96) and y.dtype == torch.bfloat16
        assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    # any other dtype falls back to F.linear over the same parameters
    x32 = torch.randn(4, 64)
    assert torch.equal(p.to(torch.float32)(x32), F.linear(x32, lin.weight.float(), None if lin.bias is None else lin.bias.float()))


def test_pack_linears_keeps_logits_state_dict_and_decoded_tokens():
    t, d = small_pair(K=3)
    t.model.to(torch.bfloat16)
    d.to(torch.bfloat16)
    prompts = [[5, 9, 33, 2, 7], [11, 4, 60]]
    ids = torch.tensor([prompts[0]])
    before_logits, before_sd = t(ids).logits, {k: v.clone() for k, v in t.model.state_dict().items()}
    before = [r.tokens for r in generate(t, d, prompts, 3, 24, set())]
    alone = [r.tokens for r in generate(t, None, prompts, 3, 24, set())]

    n_linear = sum(type(m) is nn.Linear for m in t.model.modules())
    assert n_linear == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the lm_head
    n_head = sum(type(m) is nn.Linear for m in d.modules())
    assert n_head == 9  # fc, q, k, v, o, gate, up, down, lm_head
    assert pack_linears(t.model) == n_linear and pack_linears(d) == n_head
    assert not any(type(m) is nn.Linear for m in t.model.modules())
    assert isinstance(t.model.get_output_embeddings(), PackedLinear)
    sd = t.model.state_dict()
    assert sd.keys() == before_sd.keys() and all(torch.equal(sd[k], v) for k, v in before_sd.items())
    assert torch.equal(t(ids).logits, before_logits)
    assert [r.tokens for r in generate(t, d, prompts, 3, 24, set())] == before
    assert [r.tokens for r in generate(t, None, prompts, 3, 24, set())] == alone

    assert unpack_linears(t.model) == n_linear and not any(isinstance(m, PackedLinear) for m in t.model.modules())
    assert torch.equal(t(ids).logits, before_logits)


def test_fp32_modules_are_not_packed_and_decoding_preparation_packs_bf16_only():
    t, d = small_pair(K=3)
    assert pack_linears(t.model) == 0 and pack_linears(d) == 0
    _, (head,) = prepare_for_decoding(t, [d], "fp32")
    assert not any(isinstance(m, PackedLinear) for m in [*t.model.modules(), *head.modules()])
    _, (head,) = prepare_for_decoding(t, [d], "bf16")
    assert isinstance(t.model.get_output_embeddings(), PackedLinear) and isinstance(head.fc, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in d.modules())  # the given head is left as it is
    _, (head,) = prepare_for_decoding(t, [d], "fp32")  # a packed target goes back to fp32 unpacked
    assert t.model.dtype == torch.float32 and not any(isinstance(m, PackedLinear) for m in t.model.modules())



def test_peagle_amx_0_leaves_every_model_on_transformers(monkeypatch):
    """With PEAGLE_AMX=0 decoding preparation swaps nothing in: no packed linear or fused norm, and
    the target's decoding attention is the core's (so its bf16 cache is upcast);
    a target the plug-in accelerated before gets its transformers modules back."""
    from peagle_train.accel.cpu.packed_linear import FusedRMSNorm
    from peagle_train.decoding.engine import target_cache
    from peagle_train.target.capture import DECODE_ATTENTION, decoding_attention

    t, d = small_pair(K=3)
    prepare_for_decoding(t, [d], "bf16")
    assert isinstance(t.model.get_output_embeddings(), PackedLinear)
    monkeypatch.setenv("PEAGLE_AMX", "0")
    _, (head,) = prepare_for_decoding(t, [d], "bf16")
    assert [m for m in [*t.model.modules(), *head.modules()] if isinstance(m, (PackedLinear, FusedRMSNorm))] == []
    assert t.model.dtype == torch.bfloat16
    assert decoding_attention(t.decoder.config) == DECODE_ATTENTION and target_cache(t).layer(0).upcast

def _amx():
    from peagle_train.accel.cpu import amx_linear

    return amx_linear.kernel()


@pytest.mark.skipif(_amx() is None, reason="no Intel AMX here (or the kernel did not build)")
def test_amx_kernel_is_exact_per_row_and_matches_f_linear_at_decoding_shapes():
    """accel/cpu/csrc/amx_linear.cpp against an fp64 product of the same bf16 inputs: one bf16
    rounding per output (fp32 accumulation), with and without bias, for out/in features that are
    not multiples of 64/32 (zero padding); every row equals that row alone, bit for bit, whatever
    the row count (so a 1-row target step and a 6-row verify round alike); and up to 16 rows the
    output is F.linear's (oneDNN's AMX kernel) bit for bit. PackedLinear sends up to MAX_ROWS rows
    to it and more rows to oneDNN."""
    from peagle_train.accel.cpu import amx_linear

    ext = _amx()
    g = torch.Generator().manual_seed(0)
    for N, K in [(96, 64), (100, 577), (576, 576), (1536, 576), (576, 1536)]:
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        b = torch.randn(N, generator=g).bfloat16()
        packed = ext.pack(w)
        assert packed.shape == ((N + 63) // 64, (K + 31) // 32 * 16, 64, 2)
        x = torch.randn(96, K, generator=g).bfloat16()
        for bias in (b, None):
            alone = torch.cat([ext.linear(x[i:i + 1], packed, N, bias) for i in range(96)])
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            assert ((alone.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5).all()
            for M in (1, 6, 16, 17, 40, 96):
                y = ext.linear(x[:M], packed, N, bias)
                assert y.dtype == torch.bfloat16 and torch.equal(y, alone[:M]), (N, K, M)
                if M <= 16:
                    assert torch.equal(y, F.linear(x[:M], w, bias)), (N, K, M)
        assert ext.linear(x[:6].view(2, 3, K), packed, N, None).shape == (2, 3, N)
        with pytest.raises(RuntimeError, match="do not match"):
            ext.linear(x[:, :K - 1] if K % 32 == 0 else x, ext.pack(w[:, :32]), N, None)

    lin = nn.Linear(576, 1536, bias=False).to(torch.bfloat16).requires_grad_(False)
    p = PackedLinear(lin)
    assert p.amx is not None and "AMX" in repr(p)
    calls = []
    real = amx_linear.amx_linear
    try:
        amx_linear.amx_linear = lambda *a: calls.append(a[0].shape) or real(*a)
        small, big = torch.randn(6, 16, 576).bfloat16(), torch.randn(4, 25, 576).bfloat16()
        y = p(small)
        assert torch.equal(y, real(small, p.amx, 1536, None)) and torch.equal(
            p(big), torch.ops.mkldnn._linear_pointwise(big, p.packed, None, "none", [], ""))
        assert torch.equal(y[0], F.linear(small[0], lin.weight))  # each 16-row slice: F.linear's bits
    finally:
        amx_linear.amx_linear = real
    assert calls == [small.shape]  # 96 rows (a batch of 16 verifying 6 tokens): AMX; 100 rows: oneDNN


def test_amx_kernel_is_skipped_when_disabled_or_unbuildable(monkeypatch, caplog):
    """PEAGLE_AMX=0, or a build that fails (no compiler), gives no kernel and a warning that says
    the fix; PackedLinear then keeps oneDNN, bit-identical to F.linear."""
    import logging

    import torch.utils.cpp_extension as cpp

    from peagle_train.accel.cpu import amx_linear

    monkeypatch.setattr(amx_linear, "_state", {})
    monkeypatch.setenv("PEAGLE_AMX", "0")
    assert amx_linear.kernel() is None
    lin = nn.Linear(64, 96, bias=False).to(torch.bfloat16).requires_grad_(False)
    p = PackedLinear(lin)
    x = torch.randn(3, 64).bfloat16()
    assert p.amx is None and torch.equal(p(x), F.linear(x, lin.weight))
    with pytest.raises(RuntimeError, match="not available"):
        amx_linear.amx_linear(x, None, 96, None)

    monkeypatch.setattr(amx_linear, "_state", {})
    monkeypatch.setenv("PEAGLE_AMX", "1")
    monkeypatch.setattr("peagle_train.precision.cpu_bf16_units", lambda: "amx")
    monkeypatch.setattr(amx_linear.platform, "system", lambda: "Linux")
    monkeypatch.setattr(amx_linear.platform, "machine", lambda: "x86_64")

    def no_compiler(**kw):
        raise OSError("g++: not found")

    monkeypatch.setattr(cpp, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="peagle_train.accel.cpu.amx_linear"):
        assert amx_linear.kernel() is None and amx_linear.kernel() is None  # tried once
    assert caplog.text.count("not built (OSError: g++: not found)") == 1 and "Fix: install a C++ compiler" in caplog.text


@pytest.mark.skipif(_amx() is None, reason="no Intel AMX here (or the kernel did not build)")
def test_fused_rms_norm_rounds_like_the_module_and_keeps_its_weight():
    """FusedRMSNorm (csrc/amx_norm.cpp) against the fp64 formula of LlamaRMSNorm with its two bf16
    roundings: within one bf16 rounding of the module's output, equal to it on most elements;
    every row the same bits alone or among others; `fuse_ops` swaps the RMSNorms of a bf16 model
    only (the state dict unchanged) and `unfuse_ops` gives back the original modules."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from peagle_train.accel.cpu import fuse_ops, unfuse_ops
    from peagle_train.accel.cpu.packed_linear import FusedRMSNorm

    from ..conftest import tiny_llama

    g = torch.Generator().manual_seed(0)
    for H in (576, 100):  # 100: a masked tail of the 16-lane loop
        norm = LlamaRMSNorm(H, eps=1e-5).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(H, generator=g))
        fused = FusedRMSNorm(norm)
        x = (torch.randn(7, 3, H, generator=g) * 3).bfloat16()
        y, ref = fused(x), norm(x)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        assert ((y.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-6).all()
        assert (y == ref).float().mean() > 0.95
        assert torch.equal(fused(x[2:3, 1]), y[2:3, 1])
    model = tiny_llama()
    assert fuse_ops(model) == 0  # fp32
    model.to(torch.bfloat16)
    keys = set(model.state_dict())
    originals = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert fuse_ops(model) == len(originals) == 2 * 8 + 1
    assert set(model.state_dict()) == keys and "fused" in repr(model.model.norm)
    assert model.model.norm.weight is originals[-1].weight
    assert unfuse_ops(model) == len(originals)
    assert [m for m in model.modules() if isinstance(m, LlamaRMSNorm)] == originals


@pytest.mark.skipif(_amx() is None, reason="no Intel AMX here (or the kernel did not build)")
def test_fused_ops_patch_nothing_and_keep_transformers_logits():
    """`fuse_ops` and `pack_linears` are module swaps: transformers' apply_rotary_pos_emb stays in
    place, and a packed and fused Llama run through transformers' forward gives its logits."""
    import transformers.models.llama.modeling_llama as llama

    from transformers import LlamaConfig, LlamaForCausalLM

    from peagle_train.accel.cpu import fuse_ops

    original = llama.apply_rotary_pos_emb
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False).to(torch.bfloat16)
    x = torch.tensor([[5, 17, 33, 2]])
    plain = model(x).logits
    fuse_ops(model)
    assert llama.apply_rotary_pos_emb is original and torch.equal(model(x).logits, plain)
    pack_linears(model)
    fuse_ops(model)
    assert llama.apply_rotary_pos_emb is original and torch.equal(model(x).logits, plain)
