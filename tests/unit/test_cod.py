"""§4: COD sampling and the attention mask on a small packed row with two documents, by hand."""

import math

import pytest
import torch

from torch.nn.attention.flex_attention import create_mask

from peagle_train.algorithms import cod
from peagle_train.algorithms.cod import (BlockMaskBuildError, block_mask_build_counts, cod_attention_mask,
                                         cod_block_mask, cod_mask, cod_sample)


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


# The block mask's compiled build (CUDA), driven on CPU with the device check made to treat CPU as CUDA.

BLOCK_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                "full_q_num_blocks", "full_q_indices")


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """cod_block_mask takes its CUDA path (the process's compiled builder) on CPU, from a fresh builder."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(cod, "BLOCK_MASK_COMPILED_ON", ("cuda", "cpu"))
    monkeypatch.setattr(cod, "_block_mask_builder", None)
    for key in cod.BLOCK_MASK_BUILDS:
        monkeypatch.setitem(cod.BLOCK_MASK_BUILDS, key, 0)
    yield
    torch._dynamo.reset()


def _row(n: int, seed: int, dtype=torch.long):
    """A row of n positions in 2 documents, its COD elements (K = 4, all anchors) and doc_ids."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = (torch.arange(n) >= n // 3).long()
    el = cod_sample(torch.rand(n, generator=g) < 0.9, doc_ids, 4, 0.8, 0.2, None, g)
    return el.anchors.to(dtype), el.depths.to(dtype), doc_ids.to(dtype)


def _eager_block_mask(a, d, doc_ids, q_start):
    return cod._build_cod_block_mask(a, d, doc_ids[a], q_start)


def _assert_same_block_mask(bm, ref, a, d, doc_ids, q_start):
    assert bm.seq_lengths == ref.seq_lengths == (a.numel() - q_start, a.numel())
    for name in BLOCK_TABLES:
        assert torch.equal(getattr(bm, name), getattr(ref, name)), name
    dense = cod_attention_mask(a, d, doc_ids)[q_start:]
    assert torch.equal(create_mask(bm.mask_mod, None, None, *bm.seq_lengths, device="cpu")[0, 0], dense)


def test_block_mask_compiled_once_for_rows_of_any_length(compiled_on_cpu, monkeypatch):
    # Dynamo traces the real build; its "eager" backend runs the traced graph (inductor's code is checked
    # below): one builder, one compile for every row length and q_start past one 128-query block
    monkeypatch.setattr(cod, "BLOCK_MASK_BACKEND", "eager")
    made = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kw: made.append(kw) or real_compile(*args, **kw))
    rows = [(60, 0, 0), (97, 1, 0), (150, 2, 150), (80, 3, 80), (203, 4, 0), (130, 5, 17)]
    for n, seed, q_start in rows:
        a, d, doc_ids = _row(n, seed)
        assert a.numel() - q_start > 128
        bm = cod_mask(a, d, doc_ids, "flex", q_start)
        _assert_same_block_mask(bm, _eager_block_mask(a, d, doc_ids, q_start), a, d, doc_ids, q_start)
    assert len(made) == 1 and made[0]["dynamic"] and made[0]["fullgraph"]
    assert block_mask_build_counts() == {"builders": 1, "compiles": 1, "builds": 6, "recompiles": 0}
    # rows of one block of queries, and of a single query (a part's padding element), recompile once
    # per regime, and no more however many follow: far below Dynamo's recompile limit (8)
    for n, seed, q_start in [(20, 6, 0), (30, 7, 0), (25, 8, 24), (40, 9, 39), (35, 10, 34), (90, 11, 260)]:
        a, d, doc_ids = _row(n, seed)
        q_start = min(q_start, a.numel() - 1)
        bm = cod_mask(a, d, doc_ids, "flex", q_start)
        _assert_same_block_mask(bm, _eager_block_mask(a, d, doc_ids, q_start), a, d, doc_ids, q_start)
    assert block_mask_build_counts() == {"builders": 1, "compiles": 3, "builds": 12, "recompiles": 2}


def test_block_mask_refuses_past_the_recompile_limit(compiled_on_cpu, monkeypatch):
    # a second dtype recompiles the build; past Dynamo's limit it would run eagerly: refused instead
    monkeypatch.setattr(cod, "BLOCK_MASK_BACKEND", "eager")
    with torch._dynamo.config.patch(recompile_limit=1):
        cod_block_mask(*_row(60, 0))
        with pytest.raises(BlockMaskBuildError, match=r"recompile_limit=1 .*training\.attention=sparse"):
            cod_block_mask(*_row(60, 0, torch.int32))
    assert block_mask_build_counts()["compiles"] == 1


def test_block_mask_refuses_when_compiling_fails(compiled_on_cpu, monkeypatch):
    def no_compiler(gm, example_inputs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cod, "BLOCK_MASK_BACKEND", no_compiler)
    a, d, doc_ids = _row(300, 0)
    M = a.numel()
    with pytest.raises(BlockMaskBuildError, match=rf"\({M} queries × {M} keys\): torch.compile of its build failed "
                                                  r"\(.*no C\+\+ compiler.*training\.attention=sparse") as e:
        cod_block_mask(a, d, doc_ids)
    assert "\n" not in str(e.value)


def test_block_mask_refuses_when_dynamo_is_off(compiled_on_cpu):
    with torch._dynamo.config.patch(disable=True), pytest.raises(BlockMaskBuildError, match="TORCHDYNAMO_DISABLE=1"):
        cod_block_mask(*_row(60, 0))
    assert block_mask_build_counts()["builds"] == 0


def test_block_mask_stays_eager_on_cpu(monkeypatch):
    monkeypatch.setattr(cod, "_block_mask_builder", None)
    monkeypatch.setitem(cod.BLOCK_MASK_BUILDS, "builders", 0)
    a, d, doc_ids = _row(80, 0)
    _assert_same_block_mask(cod_block_mask(a, d, doc_ids, 5), _eager_block_mask(a, d, doc_ids, 5), a, d, doc_ids, 5)
    assert cod._block_mask_builder is None and block_mask_build_counts()["builders"] == 0


def test_block_mask_inductor_build_equals_the_eager_one(compiled_on_cpu):
    # the real compiled build (inductor, C++ on CPU): one compile, block tables equal to the eager build's
    for n, seed, q_start in [(300, 0, 0), (517, 1, 0), (400, 2, 400)]:
        a, d, doc_ids = _row(n, seed)
        bm = cod_block_mask(a, d, doc_ids, q_start)
        _assert_same_block_mask(bm, _eager_block_mask(a, d, doc_ids, q_start), a, d, doc_ids, q_start)
    assert block_mask_build_counts() == {"builders": 1, "compiles": 1, "builds": 3, "recompiles": 0}
