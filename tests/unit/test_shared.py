"""The batched decoding engine (decoding/engine.py) gives the tokens and acceptances of
one-row decoding, with ragged prompts, ragged acceptance and rows finishing at different steps."""

import pytest
import torch

from ..reference_decoder import speculative_generate, target_generate
from peagle_train.decoding.engine import generate as shared_generate

from ..integration.test_evaluate import small_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def repeating_pair(algorithm: str, c: int):
    """A tiny target whose layers add nothing (every hidden state is the token's embedding) and whose
    head is its embedding ×20, so greedy repeats the last token; a head that proposes the token of
    its feature at depth 1 and token `c` at every mask slot. P-EAGLE then accepts K drafts on rows
    repeating c and 1 elsewhere: acceptance differs between rows."""
    t, d = small_pair(algorithm=algorithm, K=4, draft_every=1)
    m = t.model
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.copy_(m.model.embed_tokens.weight * 20)
        d.lm_head.weight.copy_(m.lm_head.weight)
        for layer in d.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        H = d.fc.weight.shape[0]
        d.fc.weight.zero_()
        d.fc.weight[:, :H] = torch.eye(H)
        if algorithm == "peagle":
            d.mask_hidden.copy_(m.model.embed_tokens.weight[c].repeat(3).view(1, 1, -1))
    return t, d


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_shared_equals_one_row_with_ragged_acceptance(algorithm):
    c = 7
    t, d = repeating_pair(algorithm, c)
    prompts = [[3, 9, c], [5, 11], [2, 4, 6, 8, 10, 12, c], [1, 20]]
    assert target_generate(t, [5, 11], 4, set()).tokens == [11] * 4  # the rig: greedy repeats
    eos = {20}  # row 3 stops at its first token
    shared = shared_generate(t, d, prompts, 4, 19, eos)
    accepted = []
    for p, s in zip(prompts, shared):
        one = speculative_generate(t, d, p, 4, 19, eos)
        assert s.tokens == one.tokens == target_generate(t, p, 19, eos).tokens
        assert s.accepted == one.accepted
        accepted.append(tuple(s.accepted))
    if algorithm == "peagle":  # rows repeating c accept all 4 drafts, the row repeating 11 accepts 1
        assert accepted[0][1:] == (4,) * len(accepted[0][1:]) and set(accepted[1][1:]) == {1}
    else:  # sequential drafting repeats the feature's token at every step: all 4 accepted
        assert set(accepted[0][1:]) == {4}
    assert shared[3].tokens == [20] and shared[3].accepted == []
    assert len(shared[0].tokens) == len(shared[1].tokens) == 19


@pytest.mark.parametrize("algorithm", [None, "peagle", "eagle3"])
def test_shared_random_head_and_target_alone(algorithm):
    t, d = small_pair(algorithm=algorithm or "peagle", K=3)
    prompts = [[5, 17, 33, 2, 90], [1, 2, 3], [40]]
    shared = shared_generate(t, None if algorithm is None else d, prompts, 3, 16, set())
    for p, s in zip(prompts, shared):
        assert s.tokens == target_generate(t, p, 16, set()).tokens
        if algorithm:
            assert s.accepted == speculative_generate(t, d, p, 3, 16, set()).accepted
        assert 0 < s.target_seconds <= s.seconds
    total = sum(s.seconds for s in shared)
    assert sum(s.target_seconds + s.draft_seconds for s in shared) <= total


def test_compact_index_moves_kept_slots_right_in_order():
    from peagle_train.decoding.engine import _compact_index
    from peagle_train.draft.kv_cache import gather_slots
    valid = torch.tensor([[0, 1, 0, 1, 1, 0],
                          [1, 0, 0, 0, 0, 1],
                          [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    idx, new_valid = _compact_index(valid)
    # row 0 keeps slots 1, 3, 4; row 1 keeps 0, 5 behind one hole; row 2 keeps nothing
    assert idx[0].tolist() == [1, 3, 4] and idx[1, 1:].tolist() == [0, 5]
    assert new_valid.tolist() == [[True] * 3, [False, True, True], [False] * 3]
    assert not valid[1, idx[1, 0]] and not valid[2, idx[2]].any()  # holes point at holes
    kv = torch.arange(3 * 6, dtype=torch.float).view(3, 1, 6, 1).expand(3, 2, 6, 4)
    out = gather_slots(kv, idx)
    assert out.shape == (3, 2, 3, 4)
    assert out[0, 1, :, 0].tolist() == [1.0, 3.0, 4.0] and out[1, 0, 1:, 2].tolist() == [6.0, 11.0]


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_compaction_keeps_tokens_and_bounds_the_cache(algorithm, monkeypatch):
    """A random head accepts almost nothing, so most verify slots are holes: with compaction the
    target cache stays within COMPACT_SLACK + K + 1 slots of the longest row, and the tokens and
    acceptances are those of the uncompacted run."""
    from peagle_train.decoding import engine as sh
    t, d = small_pair(algorithm=algorithm, K=4)
    prompts = [[5, 17, 33, 2, 90, 4, 4, 8], [1, 2, 3], [40]]
    monkeypatch.setattr(sh, "COMPACT_SLACK", 8)
    states = [sh.DecodingBatch(t, d, prompts, 4, 24, set(), None, compact) for compact in (False, True)]
    with torch.no_grad():
        plain, packed = (s.run() for s in states)
    assert [s.tokens for s in packed] == [s.tokens for s in plain]
    assert [s.accepted for s in packed] == [s.accepted for s in plain]
    assert states[0].compactions == 0 and states[1].compactions > 0
    longest = max(len(p) + len(s.tokens) for p, s in zip(prompts, plain))
    assert states[0].tcache.get_seq_length() > 2 * longest  # the holes the compaction removes
    assert states[1].tcache.get_seq_length() <= longest + 8 + 5  # at most K + 1 slots since the last one
