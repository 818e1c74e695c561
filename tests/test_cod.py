"""§4: COD sampling and the attention mask on a small packed row with two documents, by hand."""

import math

import torch

from torch.nn.attention.flex_attention import create_mask

from peagle_train.algorithms.cod import cod_attention_mask, cod_block_mask, cod_sample


def brute_force_mask(anchors, depths, doc_of_anchor):
    M = len(anchors)
    m = torch.zeros(M, M, dtype=torch.bool)
    for q in range(M):
        for k in range(M):
            same = doc_of_anchor[anchors[q]] == doc_of_anchor[anchors[k]]
            ctx = depths[k] == 0 and anchors[k] <= anchors[q]
            chain = anchors[k] == anchors[q] and depths[k] <= depths[q]
            m[q, k] = same and (ctx or chain)
    return m


def test_mask_hand_computed():
    # row positions 0,1 in doc 0 and 2,3 in doc 1; elements: depth 0 at 0..3, (0,1), (2,1), (0,2)
    anchors = torch.tensor([0, 1, 2, 3, 0, 2, 0])
    depths = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    doc_ids = torch.tensor([0, 0, 1, 1])
    expected = torch.tensor([
        # keys: 0  1  2  3 (0,1) (2,1) (0,2)
        [1, 0, 0, 0, 0, 0, 0],  # (0,0)
        [1, 1, 0, 0, 0, 0, 0],  # (1,0)
        [0, 0, 1, 0, 0, 0, 0],  # (2,0): doc 1 starts, sees nothing of doc 0
        [0, 0, 1, 1, 0, 0, 0],  # (3,0)
        [1, 0, 0, 0, 1, 0, 0],  # (0,1): context up to anchor 0 + itself, not (1,0)
        [0, 0, 1, 0, 0, 1, 0],  # (2,1)
        [1, 0, 0, 0, 1, 0, 1],  # (0,2): its chain (0,0),(0,1),(0,2)
    ], dtype=torch.bool)
    assert torch.equal(cod_attention_mask(anchors, depths, doc_ids), expected)


def test_dense_and_flex_masks_match_brute_force_on_random_rows():
    g = torch.Generator().manual_seed(0)
    for lengths in ([10, 18, 12], [25, 20, 15], [7, 50, 3]):
        doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
        valid = torch.rand(doc_ids.numel(), generator=g) < 0.7
        el = cod_sample(valid, doc_ids, 6, 0.8, 0.2, None, g)
        M = el.anchors.numel()
        dense = cod_attention_mask(el.anchors, el.depths, doc_ids)
        assert torch.equal(dense, brute_force_mask(el.anchors.tolist(), el.depths.tolist(), doc_ids.tolist()))
        bm = cod_block_mask(el.anchors, el.depths, doc_ids)
        assert torch.equal(create_mask(bm.mask_mod, None, None, M, M, device="cpu")[0, 0], dense)


def test_cod_sample_hand_checked_two_documents():
    # doc 0 = positions 0..3, doc 1 = positions 4..7
    doc_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    valid = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    # S = valid positions whose anchor c-1 is in the same document = {1, 2, 3, 6, 7}; r = 1:
    # m_1 = 4, m_2 = 3, m_3 = 2 (K = 4)
    el = cod_sample(valid, doc_ids, num_depths=4, down_sample_ratio=1.0, down_sample_ratio_min=0.2,
                    generator=torch.Generator().manual_seed(3))
    a, d = el.anchors.tolist(), el.depths.tolist()
    assert a[:8] == list(range(8)) and d[:8] == [0] * 8  # depth 0: every position
    depth1 = [x + 1 for x, y in zip(a, d) if y == 1]  # the chosen positions C_1
    assert len(depth1) == 4 and set(depth1) <= {1, 2, 3, 6, 7}
    dropped = ({1, 2, 3, 6, 7} - set(depth1)).pop()
    # P_2 = {c+1 : c ∈ C_1, c+1 valid and same doc}: from {1,2,3,6,7} minus `dropped`
    p2 = sorted(c + 1 for c in depth1 if c + 1 < 8 and valid[c + 1] and doc_ids[c + 1] == doc_ids[c])
    depth2 = sorted(x + 2 for x, y in zip(a, d) if y == 2)
    assert depth2 == p2  # |P_2| ≤ m_2 = 3, so all of P_2 is taken
    hand_p2 = {1: [3, 7], 2: [2, 7], 3: [2, 3, 7], 6: [2, 3], 7: [2, 3, 7]}[dropped]
    assert depth2 == hand_p2
    p3 = [c + 1 for c in depth2 if c + 1 < 8 and valid[c + 1] and doc_ids[c + 1] == doc_ids[c]]
    depth3 = sorted(x + 3 for x, y in zip(a, d) if y == 3)
    assert depth3 == p3 == ([3] if 2 in depth2 else [])  # m_3 = 2 ≥ |P_3|; only 2→3 continues
    # every element's anchor lies in the document of its target, and its target is loss-valid
    for x, y in zip(a, d):
        if y > 0:
            assert doc_ids[x] == doc_ids[x + y] and valid[x + y]


def test_cod_counts_follow_the_schedule():
    n = 200
    doc_ids = torch.zeros(n, dtype=torch.long)
    valid = torch.ones(n, dtype=torch.bool)
    el = cod_sample(valid, doc_ids, 8, 0.7, 0.2, max_anchors=100, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(el.depths, minlength=8).tolist()
    assert counts[0] == n
    for d in range(1, 8):
        assert counts[d] == math.floor((100 - d) * max(0.7**d, 0.2))
    g1 = torch.Generator().manual_seed(5)
    g2 = torch.Generator().manual_seed(5)
    e1, e2 = cod_sample(valid, doc_ids, 8, generator=g1), cod_sample(valid, doc_ids, 8, generator=g2)
    assert torch.equal(e1.anchors, e2.anchors) and torch.equal(e1.depths, e2.depths)
