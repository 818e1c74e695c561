"""Training step: partitioned gradients equal the unpartitioned ones, FlexAttention equals the dense
fallback, metrics are hand-checked, and a few steps really learn."""

import torch
from torch.nn.attention.flex_attention import create_mask

from peagle_train.algorithms.cod import cod_attention_mask, cod_block_mask, cod_sample
from peagle_train.algorithms.peagle import draft_step
from peagle_train.features.online import packed_row
from peagle_train.algorithms.loss import depth_counts, kl_loss_sum, metrics_from_counts

from .test_decoding import make_draft


def random_row(target_model, seed=0, lengths=(30, 25, 20)):
    from peagle_train.target.capture import FeatureTarget

    g = torch.Generator().manual_seed(seed)
    docs = []
    for L in lengths:
        ids = torch.randint(0, 128, (L,), generator=g).tolist()
        mask = (torch.rand(L, generator=g) < 0.75).long().tolist()
        docs.append((ids, mask))
    return packed_row(FeatureTarget(target_model), docs, torch.arange(0, 128, 2))


def grads_of(draft, row, el, **kw):
    draft.zero_grad()
    loss, count, counts = draft_step(draft, row, el, "kl", 4, **kw)
    return loss, counts, {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}


def test_partitioned_gradients_equal_unpartitioned(target_model):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=2)
    d.train()
    row = random_row(target_model)
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(1))
    loss1, c1, g1 = grads_of(d, row, el, partitions=1)
    for parts in (2, 5):
        lossp, cp, gp = grads_of(d, row, el, partitions=parts)
        assert abs(lossp - loss1) < 1e-5 * max(1.0, abs(loss1))
        assert torch.equal(cp, c1)
        assert g1.keys() == gp.keys() and "mask_hidden" in g1
        for k in g1:
            torch.testing.assert_close(gp[k], g1[k], rtol=1e-4, atol=1e-6, msg=k)


def test_model_output_flex_equals_dense(target_model):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=2)
    row = random_row(target_model, seed=3)
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(2))
    a, dp = el.anchors, el.depths
    tok, f = d.slot_inputs(row.tokens[a], row.features[a], dp > 0)
    pos = (row.pos_ids[a] + dp)[None]
    with torch.no_grad():
        dense, _ = d(tok[None], f[None], pos, cod_attention_mask(a, dp, row.doc_ids)[None])
        flex, _ = d(tok[None], f[None], pos, cod_block_mask(a, dp, row.doc_ids))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_depth_counts_and_eal_hand_checked():
    # anchors 0,1 at depth 0; chains (0,1),(0,2) and (1,1); draft vocab of 3
    anchors = torch.tensor([0, 1, 0, 0, 1])
    depths = torch.tensor([0, 0, 1, 2, 1])
    target = torch.eye(3)[[0, 1, 2, 0, 1]] * 5
    draft = torch.eye(3)[[0, 2, 2, 0, 1]] * 5  # (1,0) wrong, others right
    valid = torch.tensor([True, True, True, True, True])
    c = depth_counts(draft, target, anchors, depths, valid, 3)
    assert c[0].tolist() == [2, 2, 1] and c[1].tolist() == [1, 2, 1]
    # chain: (1,1) follows a wrong (1,0), so only (0,1) and (0,2) count as conditional
    assert c[2].tolist() == [2, 1, 1] and c[3].tolist() == [1, 1, 1]
    m = metrics_from_counts(c)
    assert m["acc"] == [0.5, 1.0, 1.0] and m["cond_acc"] == [0.5, 1.0, 1.0]
    assert m["eal"] == 1 + 0.5 + 0.5 + 0.5


def test_kl_is_zero_iff_distributions_match():
    t = torch.randn(4, 10)
    assert kl_loss_sum(t, t, torch.ones(4, dtype=torch.bool)).abs() < 1e-6
    assert kl_loss_sum(t.flip(-1), t, torch.ones(4, dtype=torch.bool)) > 0.1


def test_a_few_steps_learn(target_model):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=3, layers=1)
    d.train()
    row = random_row(target_model, seed=5)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        el = cod_sample(row.valid, row.doc_ids, 3, 0.8, 0.2, None, torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss, _, _ = draft_step(d, row, el, "kl", 3)
        opt.step()
        losses.append(loss)
    assert losses[-1] < 0.3 * losses[0]


def test_part_mask_flex_equals_dense_with_kept_context(target_model):
    """A part's queries (its chains) over keys = kept depth-0 context + those chains: the BlockMask
    equals the dense slice, and the forward through the kept cache gives the same logits.
    (FlexAttention has no backward on CPU; its gradients are exercised on CUDA.)"""
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=2)
    row = random_row(target_model, seed=6)
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(4))
    n = row.tokens.numel()
    a, dp = el.anchors, el.depths  # depth 0 (all n positions) first, then the chains
    M = a.numel()
    bm = cod_block_mask(a, dp, row.doc_ids, q_start=n)
    assert torch.equal(create_mask(bm.mask_mod, None, None, M - n, M, device="cpu")[0, 0],
                       cod_attention_mask(a, dp, row.doc_ids)[n:])
    with torch.no_grad():
        tok, f = d.slot_inputs(row.tokens[a], row.features[a], dp > 0)
        pos = (row.pos_ids[a] + dp)[None]
        _, cache = d(tok[None, :n], f[None, :n], pos[:, :n], cod_attention_mask(a[:n], dp[:n], row.doc_ids)[None])
        dense, _ = d(tok[None, n:], f[None, n:], pos[:, n:], cod_attention_mask(a, dp, row.doc_ids)[n:][None], cache)
        flex, _ = d(tok[None, n:], f[None, n:], pos[:, n:], bm, cache)
        full, _ = d(tok[None], f[None], pos, cod_attention_mask(a, dp, row.doc_ids)[None])
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense, full[:, n:], rtol=1e-5, atol=1e-5)


def test_fused_adamw_matches_the_reference_update():
    """The trainer's fused AdamW (ddp engine) takes the same steps as PyTorch's single-tensor
    implementation, up to rounding; sharded engines (fused=False) keep the default."""
    from peagle_train.training.trainer import adamw

    torch.manual_seed(0)
    w0 = [torch.randn(37, 11), torch.randn(5)]
    grads = [[torch.randn_like(w) for w in w0] for _ in range(4)]
    runs = {}
    for fused in (True, False):
        ps = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = adamw(ps, 1e-2, 0.01, fused=fused)
        assert opt.param_groups[0]["fused"] is (True if fused else None)
        assert opt.param_groups[0]["betas"] == (0.9, 0.95)
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
            opt.step()
        runs[fused] = [p.detach() for p in ps]
    for a, b, w in zip(runs[True], runs[False], w0):
        assert not torch.equal(a, w)  # 4 steps of lr 1e-2 moved every weight
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_depth_weight_gradients_equal_the_weighted_mean_of_per_element_kl(target_model):
    """depth_weight w: the step's loss is Σ w^d · KL_e / Σ w^d over the valid elements of both
    micro-rows, and its gradients equal that expression's, by autograd, unpartitioned and
    partitioned; they differ from the uniform loss's."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch.nn.functional as F

    from peagle_train.algorithms.cod import cod_mask
    from peagle_train.algorithms.peagle import PEagleObjective

    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=2)
    d.train()
    rows = [random_row(target_model, seed=7), random_row(target_model, seed=8, lengths=(40, 12))]
    els = [cod_sample(r.valid, r.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(5 + i))
           for i, r in enumerate(rows)]
    w = 1.5
    d.zero_grad()
    num, den = 0.0, 0.0
    for r, el in zip(rows, els):
        a, dp = el.anchors, el.depths
        logits, _ = d(r.tokens[a][None], r.features[a][None], (r.pos_ids[a] + dp)[None],
                      cod_mask(a, dp, r.doc_ids, "dense", 0), None, is_slot=(dp > 0)[None])
        logp = F.log_softmax(r.target_logits[a + dp].float(), -1)
        kl = (logp.exp() * (logp - F.log_softmax(logits[0].float(), -1))).sum(-1)
        weight = r.valid[a + dp].double() * w ** dp.double()
        num, den = num + (kl.double() * weight).sum(), den + weight.sum()
    assert (den - sum(int(r.valid[e.targets].sum()) for r, e in zip(rows, els))).abs() > 1  # deeper elements count
    ref_loss = num / den
    ref_loss.backward()
    ref_value = float(ref_loss.detach())
    ref = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
    accelerator = SimpleNamespace(reduce=lambda t, op: t, num_processes=1, device="cpu")
    grads = {}
    for weight_, parts in ((w, 1), (w, 3), (1.0, 1)):
        d.zero_grad()
        training = SimpleNamespace(loss="kl", partitions=parts, attention="dense", depth_weight=weight_)
        loss, _ = PEagleObjective(training, 4).step(d, list(zip(rows, els)), accelerator=accelerator,
                                                      amp=nullcontext())
        grads[weight_, parts] = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
        if weight_ == w:
            assert abs(loss - ref_value) < 1e-5 * ref_value
            assert grads[weight_, parts].keys() == ref.keys() and "mask_hidden" in ref
            for k in ref:
                torch.testing.assert_close(grads[weight_, parts][k], ref[k].float(), rtol=1e-4, atol=1e-6, msg=k)
    assert not torch.allclose(grads[1.0, 1]["mask_hidden"], ref["mask_hidden"].float(), rtol=1e-2, atol=0)
