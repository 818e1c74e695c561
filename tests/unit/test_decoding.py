"""§5: the reference decoder is lossless, and its drafting positions are exactly right."""

import pytest
import torch

from ..reference_decoder import speculative_generate, target_generate
from peagle_train.draft.peagle import DraftConfig, PEagleDraft
from peagle_train.target.capture import FeatureTarget


def make_draft(target_model, vocab_ids, K=5, layers=2, seed=0):
    torch.manual_seed(seed)
    t = FeatureTarget(target_model)
    cfg = DraftConfig.from_target(target_model.config, num_layers=layers, draft_vocab_size=len(vocab_ids),
                                  mask_token_id=127, num_depths=K, aux_layer_ids=t.aux_layer_ids)
    d = PEagleDraft(cfg).eval()
    d.init_from_target(target_model, vocab_ids, vocab_ids - torch.arange(len(vocab_ids)),
                       torch.zeros(128, dtype=torch.bool).index_fill_(0, vocab_ids, True))
    return t, d


class OracleDraft(PEagleDraft):
    """Proposes the target's own greedy continuation: position p (pair x_{p+1}, g_p) → x_{p+2}.

    If the decoder mis-placed positions or features by one, its proposals would be rejected.
    """

    def __init__(self, cfg, sequence: list[int], wrong: bool = False):
        super().__init__(cfg)
        self.sequence, self.wrong = sequence, wrong

    def forward(self, tokens, features, position_ids, mask, cache=None):
        V = self.config.draft_vocab_size
        logits = torch.zeros(*tokens.shape, V)
        for i, p in enumerate(position_ids[0].tolist()):
            nxt = self.sequence[p + 2] if p + 2 < len(self.sequence) else 0
            logits[0, i, (nxt + 1) % V if self.wrong else nxt] = 1.0
        return logits, [(torch.zeros(1, 1, position_ids[0, -1] + 1, 1),) * 2]


@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_is_lossless_with_a_random_draft(target_model, K):
    t, d = make_draft(target_model, torch.arange(0, 128, 2), K=K)
    g = torch.Generator().manual_seed(K)
    for _ in range(3):
        prompt = torch.randint(0, 128, (9,), generator=g).tolist()
        base = target_generate(t, prompt, 40, eos_ids=set())
        spec = speculative_generate(t, d, prompt, K, 40, eos_ids=set())
        assert spec.tokens == base.tokens
        assert len(spec.tokens) == 40
        assert spec.draft_forwards == len(spec.accepted) == spec.target_forwards - 1


def test_oracle_draft_is_fully_accepted(target_model):
    t, _ = make_draft(target_model, torch.arange(128))
    prompt = [5, 17, 33, 2, 90]
    base = target_generate(t, prompt, 31, eos_ids=set())
    cfg = DraftConfig.from_target(target_model.config, num_layers=1, draft_vocab_size=128, mask_token_id=127,
                                  num_depths=5, aux_layer_ids=t.aux_layer_ids)
    oracle = OracleDraft(cfg, prompt + base.tokens)  # d2t = 0: draft id == target id
    spec = speculative_generate(t, oracle, prompt, 5, 31, eos_ids=set())
    assert spec.tokens == base.tokens
    # 1 token from prefill, then 6 per step (5 accepted + bonus): 5 steps give 31 tokens
    assert spec.accepted == [5, 5, 5, 5, 5]
    wrong = OracleDraft(cfg, prompt + base.tokens, wrong=True)
    spec = speculative_generate(t, wrong, prompt, 5, 31, eos_ids=set())
    assert spec.tokens == base.tokens and spec.accepted == [0] * 30


def test_eos_stops_both_decoders(target_model):
    t, d = make_draft(target_model, torch.arange(0, 128, 2))
    prompt = [1, 2, 3, 4]
    base = target_generate(t, prompt, 30, eos_ids=set())
    eos = base.tokens[6]
    stop = base.tokens.index(eos)
    b2 = target_generate(t, prompt, 30, eos_ids={eos})
    s2 = speculative_generate(t, d, prompt, 4, 30, eos_ids={eos})
    assert b2.tokens == s2.tokens == base.tokens[: stop + 1]


def test_training_forward_equals_parallel_drafting_forward(target_model):
    """For one anchor, the COD training forward at depths 0..K-1 gives the same logits as the
    inference forward (real pairs through the KV cache, then K-1 mask slots), within 1e-5 fp32."""
    from peagle_train.algorithms.cod import CODElements, cod_attention_mask

    K = 4
    t, d = make_draft(target_model, torch.arange(0, 128, 2), K=K, layers=2)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(7))
    out = t(ids)
    tokens, feats = ids[0, 1:], out.aux[0, :-1]  # aligned row, n = 15
    n, a = 15, 9
    anchors = torch.cat([torch.arange(n), torch.full((K - 1,), a)])
    depths = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, K)])
    el = CODElements(anchors, depths)
    tok, f = d.slot_inputs(tokens[el.anchors], feats[el.anchors], el.depths > 0)
    mask = cod_attention_mask(el.anchors, el.depths, torch.zeros(n, dtype=torch.long))
    train_logits, _ = d(tok[None], f[None], (el.anchors + el.depths)[None], mask[None])
    train_chain = torch.cat([train_logits[0, a:a + 1], train_logits[0, n:]])  # (a,0), (a,1..K-1)
    # inference: context pairs 0..a-3 first (cached), then pairs a-2..a plus K-1 slots
    c = a - 2
    _, cache = d(tokens[None, :c], feats[None, :c], torch.arange(c)[None], torch.ones(c, c).tril().bool()[None])
    m = a + 1 - c
    toks = torch.cat([tokens[c:a + 1], torch.full((K - 1,), d.config.mask_token_id)])
    fe = torch.cat([feats[c:a + 1], d.mask_hidden[0].expand(K - 1, -1)])
    N = m + K - 1
    mk = torch.ones(N, c + N, dtype=torch.bool)
    mk[:, c:] = torch.ones(N, N).tril().bool()
    inf_logits, _ = d(toks[None], fe[None], torch.arange(c, c + N)[None], mk[None], cache)
    torch.testing.assert_close(inf_logits[0, m - 1:], train_chain, rtol=1e-5, atol=1e-5)
