"""The training knobs of the quality ablations: the wsd schedule, the tv loss, masking labels outside
the draft vocabulary and the init scale of mask_hidden, each against a hand-computed value."""

import math

import torch

from peagle_train.features.rows import PackedRow, mask_out_of_vocab
from peagle_train.algorithms.loss import LOSSES, tv_loss_sum
from peagle_train.training.schedule import lr_lambda


def test_wsd_holds_then_decays_linearly_over_the_last_fraction():
    f = lr_lambda(warmup=10, total=110, schedule="wsd", decay_fraction=0.2)
    # warm-up 1/10 .. 10/10; stable through post-warm-up step 80 (t = 0.8); then 1 → 0.1 at 110
    assert [f(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert f(10) == 1.0 and f(50) == 1.0 and f(90) == 1.0
    assert math.isclose(f(95), 1 - 0.9 * 0.25)   # t = 0.85 → 0.25 of the decay
    assert math.isclose(f(110), 0.1) and math.isclose(f(500), 0.1)
    # cosine is unchanged: 0.55 at mid-way
    assert math.isclose(lr_lambda(10, 110, "cosine")(60), 0.55)


def test_every_decay_ends_at_min_lr_ratio():
    """training.min_lr_ratio: cosine, linear and wsd end at that share of lr; 0 is transformers' cosine."""
    for end in (0.0, 0.1, 0.3):
        cos, lin = lr_lambda(10, 110, "cosine", end=end), lr_lambda(10, 110, "linear", end=end)
        wsd = lr_lambda(10, 110, "wsd", decay_fraction=0.2, end=end)
        assert [cos(9), lin(9), wsd(9)] == [1.0, 1.0, 1.0]  # warm-up alike
        assert math.isclose(cos(60), end + (1 - end) * 0.5) and math.isclose(lin(60), end + (1 - end) * 0.5)
        assert math.isclose(cos(35), end + (1 - end) * 0.5 * (1 + math.cos(math.pi / 4)))
        assert math.isclose(wsd(95), 1 - (1 - end) * 0.25)
        for f in (cos, lin, wsd):
            assert math.isclose(f(110), end, abs_tol=1e-12) and math.isclose(f(500), end, abs_tol=1e-12)


def test_tv_loss_value_and_gradient_against_the_plain_expression():
    torch.manual_seed(0)
    x = torch.randn(5, 7, requires_grad=True)
    t = torch.randn(5, 7)
    valid = torch.tensor([True, False, True, True, False])
    got = tv_loss_sum(x, t, valid, chunk=2)
    got.backward()
    g = x.grad.clone()
    x2 = x.detach().clone().requires_grad_()
    ref = 0.5 * (t[valid].softmax(-1) - x2[valid].softmax(-1)).abs().sum()
    ref.backward()
    assert torch.allclose(got, ref, atol=1e-6)
    assert torch.allclose(g, x2.grad, atol=1e-6)
    assert g[~valid].abs().sum() == 0
    # hand value: two one-hot-like distributions over 2 tokens differ by |0.5 - 1/(1+e)| twice
    a, b = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    p1 = 1 / (1 + math.exp(-1))
    assert math.isclose(float(tv_loss_sum(a, b, torch.tensor([True]))), p1 - 0.5, rel_tol=1e-6)
    assert LOSSES["tv"] is tv_loss_sum


def test_mask_out_of_vocab_drops_labels_outside_the_draft_vocabulary():
    # two documents: tokens [5, 9, 2 | 9, 7]; the draft vocabulary is {2, 5, 7}
    tokens = torch.tensor([5, 9, 2, 9, 7])
    doc = torch.tensor([0, 0, 0, 1, 1])
    row = PackedRow(tokens, torch.zeros(5, 3), torch.zeros(5, 4), torch.tensor([True, True, True, True, False]),
                    doc, torch.tensor([0, 1, 2, 0, 1]))
    in_vocab = torch.zeros(10, dtype=torch.bool)
    in_vocab[[2, 5, 7]] = True
    out = mask_out_of_vocab(row, in_vocab)
    # position 0's label is 9 (out), 1's is 2 (in), 2 is doc 0's last (kept), 3's label is 7 (in), 4 was invalid
    assert out.valid.tolist() == [False, True, True, True, False]
    assert row.valid.tolist() == [True, True, True, True, False]  # the input row is unchanged


def test_mask_hidden_init_std_rescales_the_same_draw(target_model):
    from .test_decoding import make_draft

    ids = torch.arange(0, 128, 2)
    _, a = make_draft(target_model, ids, seed=3)
    _, b = make_draft(target_model, ids, seed=3)
    b.init_mask_hidden(1.0)
    assert torch.allclose(b.mask_hidden, a.mask_hidden * 50)
    assert 0.8 < float(b.mask_hidden.detach().std()) < 1.2


def test_linear_init_std_draws_the_layers_from_a_normal_and_keeps_the_random_stream(target_model):
    """draft.linear_init_std=0.02 (Hugging Face's init, speculators'): every linear of the head but
    lm_head is redrawn from N(0, 0.02²) (kurtosis 3, where nn.Linear's uniform has 1.8), lm_head,
    the embeddings and mask_hidden stay as built, and the global random stream after the build is
    the default build's, so the rows and COD draws that follow stay paired."""
    from omegaconf import OmegaConf

    from peagle_train.data.vocab import DraftVocab
    from peagle_train.jobs.builders import build_draft
    from peagle_train.target.capture import FeatureTarget

    t, vocab = FeatureTarget(target_model), DraftVocab.from_ids(torch.arange(0, 128, 2), 128)

    def build(std):
        torch.manual_seed(5)
        head = build_draft(t, OmegaConf.create({"num_layers": 2, "linear_init_std": std}), vocab, 127)
        return head, torch.rand(4)

    def kurtosis(w):
        z = (w - w.mean()) / w.std()
        return float((z ** 4).mean())

    default, after_default = build(None)
    normal, after_normal = build(0.02)
    assert torch.equal(after_default, after_normal)
    for name in ("lm_head.weight", "embed_tokens.weight", "mask_hidden"):
        assert torch.equal(normal.get_parameter(name), default.get_parameter(name)), name
    linears = [n for n, m in normal.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert len(linears) == 1 + 2 * 7  # fc, then q k v o gate up down per layer
    drawn = torch.cat([normal.get_submodule(n).weight.detach().flatten() for n in linears])
    assert abs(float(drawn.std()) - 0.02) < 0.0004 and abs(float(drawn.mean())) < 0.0004
    for n in linears:
        assert not torch.equal(normal.get_submodule(n).weight, default.get_submodule(n).weight), n
    fc_default, fc_normal = default.fc.weight.detach().flatten(), normal.fc.weight.detach().flatten()
    assert kurtosis(fc_default) < 2.0 and kurtosis(fc_normal) > 2.7
