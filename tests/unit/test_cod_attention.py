"""Sparse COD attention (algorithms/cod_attention.py) equals the dense reference mask: outputs and
gradients on a 2-document packed row, fp32, for the kernel, the head (1 and 2 layers) and the
training step (partitions 1 and 2); and it never builds an M×M tensor."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from peagle_train.algorithms.cod import attention_kind, cod_attention_mask, cod_mask, cod_sample
from peagle_train.algorithms.cod_attention import CODSparseMask

from .test_decoding import make_draft
from .test_training import grads_of, random_row


def two_doc_row(lengths=(23, 17), K=5, seed=0, max_anchors=None):
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    valid = torch.rand(doc_ids.numel(), generator=g) < 0.8
    el = cod_sample(valid, doc_ids, K, 0.8, 0.2, max_anchors, g)
    return el.anchors, el.depths, doc_ids


def qkv(M, Nq, h=4, kvh=2, dh=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n_heads, L, dh, generator=g, dtype=torch.float64).float().requires_grad_()
            for n_heads, L in ((h, Nq), (kvh, M), (kvh, M))]


def dense_reference(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)


@pytest.mark.parametrize("q_start_kind", ["all", "slots"])
@pytest.mark.parametrize("block,spread", [(256, 256), (4, 3)])
@pytest.mark.parametrize("keep_factor", [8.0, 0.0])  # keep the gathered keys, or recompute (checkpoint)
def test_kernel_outputs_and_gradients_equal_dense(q_start_kind, block, spread, keep_factor):
    a, d, doc_ids = two_doc_row()
    n, M = doc_ids.numel(), a.numel()
    q_start = 0 if q_start_kind == "all" else n
    plan = CODSparseMask(a, d, doc_ids, q_start, block=block, max_spread=spread, keep_factor=keep_factor)
    assert plan.recompute == (keep_factor == 0.0)
    if block == 4:
        assert len(plan.blocks) > 10  # many blocks, some cut by the spread, none across documents
    assert all(int(doc_ids[qa[0]]) == int(doc_ids[qa[-1]]) for *_, qa, qd, ka, kd in plan.blocks)
    dense_mask = cod_attention_mask(a, d, doc_ids)[q_start:]
    q, k, v = qkv(M, M - q_start)
    out = plan.attend(q, k, v)
    gout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), gout)
    ref = dense_reference(q, k, v, dense_mask)
    ref_grads = torch.autograd.grad(ref, (q, k, v), gout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=name)


def test_plan_counts_only_visible_pairs_plus_block_slack():
    a, d, doc_ids = two_doc_row((60, 50), K=6)
    dense = cod_attention_mask(a, d, doc_ids)
    plan = CODSparseMask(a, d, doc_ids, block=8, max_spread=4)
    visible = int(dense.sum())
    # every visible pair is computed once; the slack is the part of a block's prefix past each
    # query's own anchor (≤ spread) and the other chains of the block (≤ block)
    assert visible <= plan.visible_pairs() <= visible + (a.numel() - doc_ids.numel()) * (4 + 8)
    assert plan.visible_pairs() < 0.5 * a.numel() ** 2


@pytest.mark.parametrize("layers", [1, 2])
def test_head_outputs_equal_dense(target_model, layers):
    _, dr = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=layers)
    row = random_row(target_model, seed=3, lengths=(30, 25))
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(2))
    a, dp = el.anchors, el.depths
    tok, f = dr.slot_inputs(row.tokens[a], row.features[a], dp > 0)
    pos = (row.pos_ids[a] + dp)[None]
    with torch.no_grad():
        dense, _ = dr(tok[None], f[None], pos, cod_mask(a, dp, row.doc_ids, "dense"))
        sparse, _ = dr(tok[None], f[None], pos, cod_mask(a, dp, row.doc_ids, "sparse"))
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("partitions", [1, 2])
def test_step_gradients_equal_dense(target_model, layers, partitions):
    _, dr = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=layers)
    dr.train()
    row = random_row(target_model, seed=1, lengths=(40, 33))  # a 2-document packed row
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(4))
    loss_d, c_d, g_d = grads_of(dr, row, el, partitions=partitions, attention="dense")
    loss_s, c_s, g_s = grads_of(dr, row, el, partitions=partitions, attention="sparse")
    assert abs(loss_s - loss_d) < 1e-5 * max(1.0, abs(loss_d))
    assert torch.equal(c_s, c_d)
    assert g_s.keys() == g_d.keys() and "mask_hidden" in g_d and "layers.0.self_attn.q_proj.weight" in g_d
    for k in g_d:
        torch.testing.assert_close(g_s[k], g_d[k], rtol=1e-5, atol=1e-5, msg=k)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_sparse_step_builds_no_dense_mask(target_model):
    _, dr = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=1)
    dr.train()
    row = random_row(target_model, seed=5, lengths=(150, 150, 150))
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(0))
    M = el.anchors.numel()
    sizes = {}
    for attention in ("dense", "sparse"):
        dr.zero_grad()
        with _LargestTensor() as rec:
            grads_of(dr, row, el, attention=attention)
        sizes[attention] = rec.largest
    width = row.features.shape[-1]  # 3H = 192
    assert sizes["dense"] >= M * M > 5 * M * width  # the reference holds the M×M mask
    # sparse: the largest tensors are the features gathered on the axis [M, 3H]; attention's own
    # (a block's mask, ≤ 256 × its keys) stay below that
    assert sizes["sparse"] == M * width, (sizes, M)


def test_attention_kind_and_layout_errors():
    assert attention_kind("auto", "cpu") == "sparse"
    assert attention_kind("auto", "cuda") == "flex"
    assert attention_kind("dense", "cpu") == "dense" and attention_kind("sparse", "cpu") == "sparse"
    with pytest.raises(ValueError, match="no backward on CPU"):
        attention_kind("flex", "cpu")
    with pytest.raises(ValueError, match="training.attention='fast'"):
        attention_kind("fast", "cpu")
    a, d, doc_ids = two_doc_row()
    with pytest.raises(ValueError, match="must start with depth 0"):
        CODSparseMask(a.flip(0), d.flip(0), doc_ids)
    with pytest.raises(ValueError, match="q_start=3"):
        CODSparseMask(a, d, doc_ids, q_start=3)
    interleaved = torch.tensor([0, 1, 0, 1] * 10)
    el = cod_sample(torch.ones(40, dtype=torch.bool), interleaved, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="one contiguous run"):
        CODSparseMask(el.anchors, el.depths, interleaved)
