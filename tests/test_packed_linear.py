"""bf16 linears packed once for oneDNN (decoding/packed_linear.py): bit-identical outputs, the same
parameters and state dict, the same decoded tokens; fp32 modules are never packed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from peagle_train.decoding.engine import generate
from peagle_train.decoding.packed_linear import PackedLinear, pack_linears, packing_available, unpack_linears
from peagle_train.evaluation.run import prepare_for_decoding

from .test_evaluate import small_pair

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
