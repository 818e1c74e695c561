"""The EAGLE-3 baseline: TTT training equals sequential decoding, decoding is lossless, it learns."""

import torch

from ..reference_decoder import propose_sequential, speculative_generate, target_generate
from peagle_train.draft.peagle import DraftConfig, Eagle3Draft
from peagle_train.target.capture import FeatureTarget
from peagle_train.algorithms.eagle3 import eagle3_forward, eagle3_step, ttt_anchors

from .test_training import random_row


def make_eagle3(target_model, K=4, layers=2, seed=0):
    torch.manual_seed(seed)
    t = FeatureTarget(target_model)
    ids = torch.arange(0, 128, 2)
    cfg = DraftConfig.from_target(target_model.config, num_layers=layers, draft_vocab_size=64, mask_token_id=127,
                                  num_depths=K, aux_layer_ids=t.aux_layer_ids, algorithm="eagle3")
    d = Eagle3Draft(cfg).eval()
    d.init_from_target(target_model, ids, ids - torch.arange(64), torch.zeros(128, dtype=torch.bool).index_fill_(0, ids, True))
    return t, d


def test_eagle3_has_no_mask_hidden(target_model):
    _, d = make_eagle3(target_model)
    assert "mask_hidden" not in d.state_dict()


def test_ttt_training_logits_equal_sequential_drafting(target_model):
    """Anchor a's TTT chain (steps 0..K-1, teacher-forced tokens) gives the same logits as the
    decoder's sequential drafting fed with the same tokens, within 1e-5 fp32."""
    K = 4
    t, d = make_eagle3(target_model, K=K)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    out = t(ids)
    from peagle_train.features.rows import PackedRow
    n = 19
    row = PackedRow(ids[0, 1:], out.aux[0, :-1], out.logits[0, 1:], torch.ones(n, dtype=torch.bool),
                    torch.zeros(n, dtype=torch.long), torch.arange(n))
    a = 10
    with torch.no_grad():
        steps = eagle3_forward(d, row, torch.tensor([a]), K)
    train_chain = [steps[0][2][a]] + [s[2][0] for s in steps[1:]]
    # inference: pairs 0..a (cached in two chunks), then K-1 sequential steps fed the true tokens
    with torch.no_grad():
        h, c = d.hidden_states(row.tokens[None, :5], row.features[None, :5], torch.arange(5)[None],
                               torch.ones(5, 5).tril().bool()[None])
        m = a + 1 - 5
        mk = torch.ones(m, 5 + m, dtype=torch.bool)
        mk[:, 5:] = torch.ones(m, m).tril().bool()
        h, c = d.hidden_states(row.tokens[None, 5:a + 1], row.features[None, 5:a + 1], torch.arange(5, a + 1)[None], mk[None], c)
        inf = [d.logits(h[0, -1])]
        hid = h[:, -1:]
        for j in range(1, K):
            S = a + j
            h, c = d.hidden_states(row.tokens[a + j].view(1, 1), hid, torch.tensor([[S]]),
                                   torch.ones(1, 1, S + 1, dtype=torch.bool), c, project=False)
            hid = h
            inf.append(d.logits(h[0, -1]))
    torch.testing.assert_close(torch.stack(inf), torch.stack(train_chain), rtol=1e-5, atol=1e-5)
    # and the decoder's own proposer drafts the argmax chain of those logits
    with torch.no_grad():
        prop, _, nf = propose_sequential(d, row.tokens[: a + 1].tolist(), row.features[: a + 1], None, 0, 1)
    assert nf == 1 and prop == [int(d.draft_to_target(inf[0].argmax()))]


def test_eagle3_decoding_is_lossless_and_sequential(target_model):
    t, d = make_eagle3(target_model, K=4)
    prompt = [7, 1, 88, 42, 3, 3]
    base = target_generate(t, prompt, 40, set())
    spec = speculative_generate(t, d, prompt, 4, 40, set())
    assert spec.tokens == base.tokens
    assert spec.draft_forwards == 4 * len(spec.accepted)  # K draft forwards per verify step


def test_eagle3_ttt_learns(target_model):
    _, d = make_eagle3(target_model, K=3, layers=1)
    d.train()
    row = random_row(target_model, seed=4)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        anchors = ttt_anchors(row.valid, row.doc_ids, None)
        opt.zero_grad()
        loss, count, counts = eagle3_step(d, row, anchors, 3, 0.8, "kl")
        opt.step()
        losses.append(loss)
    assert losses[-1] < 0.3 * losses[0]
    assert counts[0, 1] > 0 and counts[0, 2] > 0  # steps 1 and 2 were trained


def test_eagle3_validation_counts_equal_the_training_step(target_model):
    """Held-out validation (no backward) reports the chain counts `eagle3_step` computes for the
    same row and anchors, and the loss sum of its undecayed steps; the weights are untouched."""
    from types import SimpleNamespace

    from peagle_train.algorithms.eagle3 import Eagle3Objective
    from peagle_train.algorithms.loss import LOSSES

    _, d = make_eagle3(target_model, K=3, layers=1)
    row = random_row(target_model, seed=5)
    obj = Eagle3Objective(SimpleNamespace(max_anchors=6, loss="kl", ttt_decay=0.8), 3)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    loss, count, counts = obj.validate_row(d, row, torch.Generator().manual_seed(3))
    anchors = obj.sample(row, torch.Generator().manual_seed(3))
    assert anchors.numel() == 6
    _, n_valid, ref = eagle3_step(d, row, anchors, 3, 0.8, "kl")
    torch.testing.assert_close(counts, ref)
    assert counts[0, 1] > 0 and counts[0, 2] > 0
    with torch.no_grad():
        steps = eagle3_forward(d, row, anchors, 3)
    want = sum(float(LOSSES["kl"](lg, row.target_logits[a + j], row.valid[a + j])) for j, (a, _, lg) in enumerate(steps))
    assert abs(loss - want) < 1e-4 * max(1.0, abs(want))
    assert count == sum(float(row.valid[a + j].sum()) for j, (a, _, _) in enumerate(steps)) == n_valid
    assert all(torch.equal(v, before[k]) for k, v in d.state_dict().items())
