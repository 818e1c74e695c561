"""The lean decoding forward of bf16 Llama targets (accel/cpu/fused_decoder.py): the bits of
transformers' forward over the same packed and fused modules, for prefills, 1-token steps,
verifies and ragged batches with holes; the forwards it does not take go to transformers; the
tokens decoded are unchanged."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from peagle_train.accel.cpu import amx_linear, fuse_ops, fused_decoder, unfuse_ops
from peagle_train.accel.cpu.attention import use_amx_attention
from peagle_train.accel.cpu.packed_linear import pack_linears, unpack_linears
from peagle_train.decoding.engine import generate, target_cache
from peagle_train.target.capture import FeatureTarget

from .test_amx_attention import random_bf16_head

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(amx_linear.kernel() is None, reason="no Intel AMX here (or the kernel did not build)")]


def _llama(head_dim: int = 32, bias: bool = False) -> FeatureTarget:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_bias=bias, mlp_bias=bias,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False).to(torch.bfloat16)
    if bias:  # transformers initialises biases to zero: make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.5)
    t = FeatureTarget(model, [0, 1, 2])
    pack_linears(t.model)
    fuse_ops(t.model)
    use_amx_attention(t.model)
    return t


def _forwards(t: FeatureTarget, fused: bool):
    """A prefill, a 1-token step, a 6-token verify, and a 2-row step over a cache with a hole
    (bool mask, explicit positions); returns every TargetOutput."""
    saved = t.model.peagle_fused_decoder
    t.model.peagle_fused_decoder = saved if fused else None
    try:
        cache, outs = target_cache(t), []
        outs.append(t(torch.tensor([[5, 17, 33, 2, 90, 3, 4]]), cache=cache, float_logits=False))
        outs.append(t(torch.tensor([[7]]), cache=cache, float_logits=False))
        outs.append(t(torch.tensor([[7, 81, 3, 3, 12, 40]]), cache=cache, float_logits=False))
        cache.batch_select_indices(torch.tensor([0, 0]))
        S = cache.get_seq_length() + 3
        mask = torch.ones(2, 1, 3, S, dtype=torch.bool).tril(S - 3)
        mask[1, ..., 4] = False  # a hole in the second row
        pos = torch.tensor([[14, 15, 16], [13, 14, 15]])
        outs.append(t(torch.tensor([[1, 2, 3], [9, 8, 7]]), cache=cache, attention_mask=mask, position_ids=pos,
                      float_logits=False))
        return outs
    finally:
        t.model.peagle_fused_decoder = saved


@pytest.fixture
def lean_calls(monkeypatch):
    """The input shapes of every `FusedDecoder.forward` call made while the test runs."""
    used = []
    real = fused_decoder.FusedDecoder.forward
    monkeypatch.setattr(fused_decoder.FusedDecoder, "forward",
                        lambda self, *a, **kw: used.append(a[0].shape) or real(self, *a, **kw))
    return used


@pytest.mark.parametrize("head_dim,bias", [(32, False), (32, True), (16, False)])
def test_fused_forward_gives_the_bits_of_transformers_forward(head_dim, bias, lean_calls):
    """head_dim 32: the AMX attention and the fused rotary kernel; 16: transformers' rotary
    formula and the fp32 decoding attention; with biases on every linear (q/k/v and gate/up
    biases concatenated)."""
    t = _llama(head_dim, bias)
    assert isinstance(t.model.peagle_fused_decoder, fused_decoder.FusedDecoder)
    fused = _forwards(t, True)
    assert lean_calls == [(1, 7), (1, 1), (1, 6), (2, 3)]  # every forward took the lean path
    plain = _forwards(t, False)
    assert len(lean_calls) == 4  # and none of the reference ones
    for a, b in zip(fused, plain):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final)
    assert not torch.equal(fused[3].logits[0], fused[3].logits[1])


def test_forwards_it_does_not_take_go_to_transformers(lean_calls):
    """More than MAX_ROWS new tokens (a long prefill), no cache, or a 2D padding mask:
    transformers' forward; the outputs are the same either way."""
    t = _llama()
    long = torch.arange(amx_linear.MAX_ROWS + 1)[None] % 128
    out = t(long, cache=target_cache(t), float_logits=False)
    t(long[:, :8])  # no cache: a training / features forward
    padded = t(long[:, :8], cache=target_cache(t), attention_mask=torch.ones(1, 8, dtype=torch.long), float_logits=False)
    assert lean_calls == []
    assert torch.equal(padded.logits, t(long[:, :8], cache=target_cache(t), float_logits=False).logits)
    assert lean_calls == [(1, 8)]
    t.model.peagle_fused_decoder = None
    assert torch.equal(t(long, cache=target_cache(t), float_logits=False).logits, out.logits)


def test_fuse_decoder_only_for_packed_bf16_llama_layers():
    """fp32 (nothing packed), unpacked, sliding-window (Mistral) and heads get no fused decoder;
    unpack_linears and unfuse_ops drop it (its packed weights would be stale)."""
    torch.manual_seed(0)
    t = _llama()
    assert fused_decoder.fuse_decoder(t.model)
    unfuse_ops(t.model)
    assert t.model.peagle_fused_decoder is None
    fuse_ops(t.model)
    assert t.model.peagle_fused_decoder is not None
    unpack_linears(t.model)
    assert t.model.peagle_fused_decoder is None and not fused_decoder.fuse_decoder(t.model)
    cfg = MistralConfig(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=16, tie_word_embeddings=False)
    mistral = MistralForCausalLM(cfg).eval().requires_grad_(False).to(torch.bfloat16)
    pack_linears(mistral)
    fuse_ops(mistral)
    assert mistral.peagle_fused_decoder is None
    fp32 = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    pack_linears(fp32), fuse_ops(fp32)
    assert getattr(fp32, "peagle_fused_decoder", None) is None
    head = random_bf16_head(t)
    pack_linears(head), fuse_ops(head)
    assert getattr(head, "peagle_fused_decoder", None) is None


def test_speculative_decoding_on_the_fused_forward_keeps_every_token():
    """A P-EAGLE head and a batch of 3 ragged prompts (holes from rejected drafts): the same tokens
    with and without the lean forward, and each prompt's tokens equal the target alone decoding
    it by itself."""
    t = _llama()
    head = random_bf16_head(t)
    prompts = [[5, 17, 33, 2, 90, 7, 7, 81], [1, 2, 3], [64, 9, 9, 100, 12]]
    fast = [r.tokens for r in generate(t, head, prompts, 3, 24, set())]
    alone = [generate(t, None, [p], 3, 24, set())[0].tokens for p in prompts]
    saved, t.model.peagle_fused_decoder = t.model.peagle_fused_decoder, None
    plain = [r.tokens for r in generate(t, head, prompts, 3, 24, set())]
    t.model.peagle_fused_decoder = saved
    assert fast == plain == alone
