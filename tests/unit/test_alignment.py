"""§2: captured features equal output_hidden_states, and the EAGLE pairing is exactly x_{i+1}/g_i/y_{i+1}/l_{i+1}."""

import torch

from peagle_train.target.aux_layers import AuxLayers
from peagle_train.target.capture import FeatureTarget, align_for_draft
from peagle_train.features.online import packed_row


def test_default_aux_layers():
    assert AuxLayers.default(30) == [2, 15, 27]
    assert AuxLayers.default(8) == [2, 4, 5]


def test_repeated_aux_layers_are_refused(target_model):
    import pytest

    with pytest.raises(ValueError, match="3 distinct layer ids in \\[0, 8\\)"):
        FeatureTarget(target_model, [2, 3, 3])
    with pytest.raises(ValueError, match="3 distinct layer ids in \\[0, 8\\)"):
        FeatureTarget(target_model, [2, 3, 8])  # 8 = the last layer's output: not an input of a layer
    with pytest.raises(ValueError, match=r"not in ascending order.*Fix: target.aux_layer_ids=\[1, 3, 5\]"):
        FeatureTarget(target_model, [5, 1, 3])


def test_capture_equals_output_hidden_states(target_model):
    # vLLM's numbering: aux id k is HF hidden_states[k], the state entering decoder layer k (0 = embeddings)
    t = FeatureTarget(target_model, [1, 2, 4])
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    ref = target_model(ids, output_hidden_states=True)
    out = t(ids)
    H = target_model.config.hidden_size
    for j, layer in enumerate([1, 2, 4]):
        torch.testing.assert_close(out.aux[..., j * H:(j + 1) * H], ref.hidden_states[layer], rtol=0, atol=0)
    t0 = FeatureTarget(target_model, [0, 4, 7])
    out0 = t0(ids)
    for j, layer in enumerate([0, 4, 7]):
        torch.testing.assert_close(out0.aux[..., j * H:(j + 1) * H], ref.hidden_states[layer], rtol=0, atol=0)
    assert not torch.equal(out0.aux[..., :H], ref.hidden_states[1])  # one layer off would differ
    # the final state is *pre*-norm: the model's final norm of it gives the post-norm state
    torch.testing.assert_close(target_model.model.norm(out.final), ref.hidden_states[-1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out.final, ref.hidden_states[-1])
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    draft_ids = torch.tensor([3, 7, 50, 90])
    torch.testing.assert_close(t(ids, draft_ids=draft_ids).logits, ref.logits[..., draft_ids], rtol=1e-5, atol=1e-5)


def test_alignment_hand_checked():
    ids = torch.tensor([10, 11, 12, 13, 14])
    mask = torch.tensor([0, 0, 1, 1, 1])
    aux = torch.arange(5.0)[:, None].repeat(1, 3)  # g_i = i
    logits = 100 + torch.arange(5.0)[:, None]  # y_i = 100 + i
    tok, feat, tl, lm = align_for_draft(ids, mask, aux, logits)
    assert tok.tolist() == [11, 12, 13, 14]  # x_{i+1}
    assert feat[:, 0].tolist() == [0, 1, 2, 3]  # g_i
    assert tl[:, 0].tolist() == [101, 102, 103, 104]  # target from y_{i+1}
    assert lm.tolist() == [0, 1, 1, 1]  # l_{i+1}


def test_packed_row_has_no_cross_document_leak(target_model):
    t = FeatureTarget(target_model)
    a, b = [5, 6, 7, 8], [20, 21, 22, 23, 24, 25]
    row = packed_row(t, [(a, [0, 1, 1, 1]), (b, [0, 0, 1, 1, 1, 1])], torch.arange(128))
    assert row.tokens.tolist() == [6, 7, 8, 21, 22, 23, 24, 25]
    assert row.doc_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert row.pos_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert row.valid.tolist() == [True, True, True, False, True, True, True, True]
    alone = t(torch.tensor([b]))  # doc b on its own: its features must not see doc a
    torch.testing.assert_close(row.features[3:], alone.aux[0, :-1])
    torch.testing.assert_close(row.target_logits[3:], alone.logits[0, 1:])
