"""The AMX decoding attention (accel/cpu/csrc/amx_attention.cpp): one bf16 rounding from the exact
attention, each query's output independent of the other queries, the batch and masked slots, and
through it a bf16 target decodes a batch with holes exactly as it decodes each prompt alone."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from peagle_train.accel.cpu import amx_linear
from peagle_train.accel.cpu.attention import amx_decode_attention as decode_attention, use_amx_attention
from peagle_train.decoding.engine import generate, target_cache
from peagle_train.accel.cpu.packed_linear import pack_linears
from peagle_train.draft import DraftConfig, make_draft_head
from peagle_train.target.capture import FeatureTarget

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(amx_linear.kernel() is None, reason="no Intel AMX here (or the kernel did not build)")]


def _exact(q, k, v, seen, scale):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.double(), k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double(),
                                          attn_mask=seen, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("H,kvh,d", [(9, 3, 64), (4, 1, 32), (2, 2, 128), (4, 2, 256)])
def test_amx_attention_is_within_one_bf16_rounding_of_exact(H, kvh, d):
    """Against an fp64 SDPA over the repeated kv heads of the same bf16 inputs: within one bf16
    rounding per output element, for 1 and 6 queries (18 = g·n lanes: two chunks) over a cache
    whose length is not a multiple of 16, causal (no mask) and with a validity mask with holes."""
    g = torch.Generator().manual_seed(0)
    for n, S in [(1, 37), (6, 45), (3, 16)]:
        q = torch.randn(2, H, n, d, generator=g).bfloat16()
        k, v = torch.randn(2, kvh, S, d, generator=g).bfloat16(), torch.randn(2, kvh, S, d, generator=g).bfloat16()
        causal = torch.ones(n, S, dtype=torch.bool).tril(S - n)[None, None].expand(2, 1, n, S)
        holes = (torch.rand(2, 1, n, S, generator=g) > 0.3) & causal
        holes[..., -n:] |= torch.eye(n, dtype=torch.bool)
        for mask, seen in ((None, causal), (holes, holes)):
            out = amx_linear.amx_attention(q, k, v, mask, d ** -0.5)
            assert out.dtype == torch.bfloat16 and out.shape == (2, n, H, d)
            exact = _exact(q, k, v, seen, d ** -0.5)
            assert ((out.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5).all(), (n, S, mask is None)


def test_amx_attention_rounds_each_query_as_alone():
    """A query's output is the same bits whether it is decoded alone (n = 1) or first of 6 new
    slots, and whether its row is alone or in a batch of 3 with 7 masked slots (holes) spread
    between its visible ones; a query that sees nothing gets zeros."""
    g = torch.Generator().manual_seed(1)
    H, kvh, d, S = 9, 3, 64, 120
    q = torch.randn(1, H, 6, d, generator=g).bfloat16()
    k, v = torch.randn(1, kvh, S, d, generator=g).bfloat16(), torch.randn(1, kvh, S, d, generator=g).bfloat16()
    six = amx_linear.amx_attention(q, k, v, None, 0.125)
    one = amx_linear.amx_attention(q[:, :, :1], k[:, :, :S - 5], v[:, :, :S - 5], None, 0.125)
    assert torch.equal(six[:, :1], one)
    holes = [3, 4, 40, 41, 42, 90, 126]
    keep = [i for i in range(S + 7) if i not in holes]
    k3, v3 = torch.randn(3, kvh, S + 7, d, generator=g).bfloat16(), torch.randn(3, kvh, S + 7, d, generator=g).bfloat16()
    k3[1][:, keep], v3[1][:, keep] = k[0], v[0]
    mask = torch.rand(3, 1, 6, S + 7, generator=g) > 0.5
    mask[1] = False
    mask[1, 0][:, keep] = torch.ones(6, S, dtype=torch.bool).tril(S - 6)
    mask[2, 0, 4] = False  # sees no slot
    q3 = torch.randn(3, H, 6, d, generator=g).bfloat16()
    q3[1] = q[0]
    out = amx_linear.amx_attention(q3, k3, v3, mask, 0.125)
    assert torch.equal(out[1:2], six)
    assert torch.equal(out[2, 4], torch.zeros(H, d, dtype=torch.bfloat16))


def test_decode_attention_uses_the_kernel_for_bf16_bool_masks_only(monkeypatch):
    """`decode_attention` sends bf16 inputs with no mask or a bool [B, 1, n, S] mask to the kernel
    (the same bits); an additive float mask, fp32 entries (an upcast cache) and head sizes that are
    not multiples of 32 keep the fp32 matmul path."""
    from types import SimpleNamespace

    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    calls = []
    real = amx_linear.amx_attention
    monkeypatch.setattr(amx_linear, "amx_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 3, 32, generator=g).bfloat16()
    k, v = torch.randn(2, 2, 9, 32, generator=g).bfloat16(), torch.randn(2, 2, 9, 32, generator=g).bfloat16()
    mask = torch.ones(2, 1, 3, 9, dtype=torch.bool).tril(6)
    for m in (None, mask):
        out, _ = decode_attention(module, q, k, v, m, scaling=0.25)
        assert torch.equal(out, real(q, k, v, m, 0.25))
    additive = torch.zeros(2, 1, 3, 9).masked_fill(~mask, torch.finfo(torch.float32).min)
    decode_attention(module, q, k, v, additive, scaling=0.25)
    decode_attention(module, q, k.float(), v.float(), mask, scaling=0.25)
    decode_attention(module, q[..., :16], k[..., :16], v[..., :16], mask, scaling=0.25)
    assert calls == [q.shape, q.shape]


def _target(head_dim: int = 32) -> FeatureTarget:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    return FeatureTarget(model.to(torch.bfloat16), [0, 1, 2])


def random_bf16_head(t: FeatureTarget):
    """A random 1-layer bf16 P-EAGLE head (K_train 3) over every second id of a 128-token target."""
    ids = torch.arange(0, 128, 2)
    cfg = DraftConfig.from_target(t.model.config, num_layers=1, draft_vocab_size=len(ids), mask_token_id=127,
                                  num_depths=3, aux_layer_ids=[0, 1, 2], algorithm="peagle")
    head = make_draft_head(cfg).eval()
    head.init_from_target(t.model, ids, ids - torch.arange(len(ids)), torch.zeros(128, dtype=torch.bool).index_fill_(0, ids, True))
    return head.to(torch.bfloat16)


def test_bf16_batch_with_holes_decodes_each_prompt_as_alone():
    """A bf16 target (head_dim 32: the AMX attention) with packed linears keeps a bf16 cache, and
    its speculative decoding of 3 prompts in one batch (a random head: most drafts rejected, so
    the cache holds holes) gives, for every prompt, the tokens of the target alone decoding that
    prompt by itself: attention and linears round each row as alone."""
    t = _target()
    assert pack_linears(t.model) > 0 and use_amx_attention(t.model)
    cache = target_cache(t)
    t(torch.tensor([[1, 2, 3]]), cache=cache)
    assert cache.layers[0].keys.dtype == torch.bfloat16
    head = random_bf16_head(t)
    prompts = [[5, 17, 33, 2, 90, 7, 7, 81], [1, 2, 3], [64, 9, 9, 100, 12]]
    batch = generate(t, head, prompts, 3, 24, set())
    assert sum(a > 0 for r in batch for a in r.accepted) < sum(len(r.accepted) for r in batch)  # holes were made
    for p, r in zip(prompts, batch):
        assert r.tokens == generate(t, None, [p], 3, 24, set())[0].tokens


def test_bf16_target_logits_of_a_token_do_not_depend_on_the_forward_around_it():
    """The whole bf16 target (AMX attention and linears): the logits of a new token are the same
    bits when it is forwarded alone, as the first of 6 new tokens (a verify), and as a row of a
    batch whose other row is longer (left padding: masked slots in its cache)."""
    t = _target()
    pack_linears(t.model)
    use_amx_attention(t.model)
    p, new = [5, 17, 33, 2, 90], [7, 81, 3, 3, 12, 40]

    def alone(n):
        cache = target_cache(t)
        t(torch.tensor([p]), cache=cache)
        return t(torch.tensor([new[:n]]), cache=cache, float_logits=False).logits

    one, six = alone(1), alone(6)
    assert torch.equal(six[:, :1], one)
    other = [9, 4, 4, 60, 61, 62, 1, 2, 8]
    P = len(other)
    toks = torch.tensor([other, [0] * (P - len(p)) + p])
    valid = torch.tensor([[True] * P, [False] * (P - len(p)) + [True] * len(p)])
    causal = torch.ones(P, P, dtype=torch.bool).tril()
    mask = (causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool)[None]
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)
    cache = target_cache(t)
    t(toks, cache=cache, attention_mask=mask[:, None], position_ids=pos)
    n = 6
    full = torch.cat([valid[:, None, :].expand(-1, n, -1), torch.ones(n, n, dtype=torch.bool).tril()[None].expand(2, -1, -1)], 2)
    step_pos = valid.sum(1, keepdim=True) + torch.arange(n)[None]
    out = t(torch.tensor([new, new]), cache=cache, attention_mask=full[:, None], position_ids=step_pos,
            float_logits=False).logits
    assert torch.equal(out[1:], six)
