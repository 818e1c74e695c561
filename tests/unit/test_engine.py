"""The decoding engine (decoding/engine.py) against the per-sequence oracle (tests/reference_decoder.py):
`head.propose` equals the oracle's drafting forwards, any mix of target and head dtypes decodes,
batched rejection sampling follows the target's distribution, sliding-window targets and cache
growth keep the oracle's tokens, lossless under bf16 is counted, a killed evaluation resumes, and
the CUDA path (SDPA over a cache in the target's dtype, forced on CPU) keeps the tokens and τ."""

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from peagle_train.decoding.engine import generate
from peagle_train.evaluation.report import per_position_acceptance
from peagle_train.evaluation.run import evaluate_acceptance
from peagle_train.evaluation.settings import EvalSettings
from peagle_train.target.capture import FeatureTarget

from ..reference_decoder import draft_parallel, draft_sequential, speculative_generate, target_generate
from ..integration.test_evaluate import _exact_marginals, small_pair

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]


def _causal(n, cached=0):
    m = torch.ones(n, cached + n, dtype=torch.bool)
    m[:, cached:] = torch.ones(n, n, dtype=torch.bool).tril()
    return m[None]


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_propose_equals_the_oracles_drafting_forward(algorithm):
    """One row: the same K tokens and the same cache of real pairs as the oracle; two rows, one
    left-padded: each row's tokens are its own one-row proposal."""
    t, d = small_pair(algorithm=algorithm, K=4)
    out = t(torch.tensor([[5, 17, 33, 2, 90, 4, 8]]))
    toks, feats = [17, 33, 2, 90, 4, 8, 11], out.aux[0]
    ref = (draft_sequential if algorithm == "eagle3" else draft_parallel)(d, toks, feats, None, 0, 4)
    p = d.propose(torch.tensor([toks]), feats[None], torch.arange(7)[None], _causal(7), None, 4)
    assert p.tokens[0].tolist() == ref[0] and p.forwards == ref[3] == (4 if algorithm == "eagle3" else 1)
    for (k, v), (rk, rv) in zip(p.cache, ref[2]):
        assert k.shape[2] == 7
        torch.testing.assert_close(k, rk)
        torch.testing.assert_close(v, rv)
    # batch: row 1 has 3 pairs, left-padded to 7 (holes masked out, positions from 0)
    valid = torch.tensor([[True] * 7, [False] * 4 + [True] * 3])
    mask = torch.cat([_causal(7), _causal(7)]) & valid[:, None, :] | torch.eye(7, dtype=torch.bool)[None]
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)
    bt = torch.tensor([toks, [0, 0, 0, 0] + toks[-3:]])
    bf = torch.stack([feats, torch.cat([torch.zeros(4, feats.shape[1]), feats[-3:]])])
    pb = d.propose(bt, bf, pos, mask, None, 4)
    one = d.propose(bt[1:, 4:], bf[1:, 4:], torch.arange(3)[None], _causal(3), None, 4)
    assert pb.tokens[0].tolist() == ref[0] and pb.tokens[1].tolist() == one.tokens[0].tolist()
    torch.testing.assert_close(pb.logits[1], one.logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_propose_into_a_preallocated_cache_equals_the_concatenating_one(algorithm):
    """The engine's draft cache (a SlotCache written in place, drafted slots cropped off) against
    per-layer (k, v) pairs concatenated at every forward: over two successive proposals the same
    tokens, logits and cached real pairs (7, then 9), and the drafted slots leave no trace."""
    from peagle_train.draft.kv_cache import SlotCache

    t, d = small_pair(algorithm=algorithm, K=4)
    out = t(torch.tensor([[5, 17, 33, 2, 90, 4, 8, 3, 6]]))
    toks, feats = [17, 33, 2, 90, 4, 8, 11, 9, 21], out.aux[0]
    slots = SlotCache()
    first = [d.propose(torch.tensor([toks[:7]]), feats[None, :7], torch.arange(7)[None], _causal(7), c, 4)
             for c in (None, slots)]
    assert first[1].cache is slots and slots.get_seq_length() == 7
    new = [d.propose(torch.tensor([toks[7:]]), feats[None, 7:], torch.arange(7, 9)[None], _causal(2, 7), c, 4)
           for c in (first[0].cache, slots)]
    for a, b in (first, new):
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(a.logits, b.logits)
    assert slots.get_seq_length() == 9
    for (k, v), layer in zip(new[0].cache, slots.layers):
        assert k.shape[2] == layer.keys.shape[2] == 9
        torch.testing.assert_close(layer.keys, k)
        torch.testing.assert_close(layer.values, v)


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
@pytest.mark.parametrize("target_dtype,head_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_any_mix_of_target_and_head_dtypes_decodes(algorithm, target_dtype, head_dtype):
    """bf16 features into an fp32 head and the reverse (the oracle crashes on the first: `BFloat16
    != float` in the head's fc): greedy output equals the target alone in the same numerics."""
    t, d = small_pair(algorithm=algorithm, K=3)
    t.model.to(target_dtype)
    d.to(head_dtype)
    if target_dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match="dtype"):
            speculative_generate(t, d, [5, 17, 33], 3, 8, set())
    prompts = [[5, 17, 33, 2, 90], [1, 2, 3]]
    spec = generate(t, d, prompts, 3, 20, set())
    base = generate(t, None, prompts, 3, 20, set())
    for s, b in zip(spec, base):
        assert len(s.tokens) == 20 and s.tokens == b.tokens and len(s.accepted) > 0


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_batched_rejection_sampling_matches_the_target_distribution(algorithm):
    """400 copies of a prompt in one batch: tokens 2 and 3 (from rejection sampling against a
    mismatched random head) are within total variation 0.1 of the exact target marginals."""
    T, N, V = 1.0, 400, 32
    t, d = small_pair(vocab=V, K=2, algorithm=algorithm)
    prompt = [5, 17, 3, 2, 9]
    m1, m2 = _exact_marginals(t, prompt, T)
    g = torch.Generator().manual_seed(0)
    out = generate(t, d, [prompt] * N, 2, 3, set(), temperature=T, generator=g)
    c1, c2 = torch.zeros(V), torch.zeros(V)
    for r in out:
        c1[r.tokens[1]] += 1
        c2[r.tokens[2]] += 1
    tv1 = 0.5 * (c1 / N - m1).abs().sum().item()
    tv2 = 0.5 * (c2 / N - m2).abs().sum().item()
    assert tv1 < 0.1 and tv2 < 0.1, (tv1, tv2)
    assert any(r.accepted[0] > 0 for r in out) and any(r.accepted[0] == 0 for r in out)  # both branches ran


def test_sliding_window_target_in_a_ragged_batch():
    """gpt-oss layout (sliding and full layers, window 8) with ragged prompts and rejected drafts:
    every row's tokens are the oracle's target-alone tokens."""
    from peagle_train.jobs.dry_run import tiny_target
    from peagle_train.draft import DraftConfig, make_draft_head

    model = tiny_target("gpt_oss", vocab_size=64, layers=4)
    model.config.sliding_window = 8
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    t = FeatureTarget(model, [0, 1, 2])
    torch.manual_seed(0)
    ids = torch.arange(0, 64, 2)
    cfg = DraftConfig.from_target(model.config, num_layers=1, draft_vocab_size=len(ids), mask_token_id=63,
                                  num_depths=3, aux_layer_ids=[0, 1, 2])
    d = make_draft_head(cfg).eval()
    d.init_from_target(model, ids, ids - torch.arange(len(ids)), torch.zeros(64, dtype=torch.bool).index_fill_(0, ids, True))
    prompts = [[5, 17, 33, 2, 40, 4, 8, 9, 10, 11, 12, 13], [1, 2, 3], [40]]
    spec = generate(t, d, prompts, 3, 20, set())
    for p, s in zip(prompts, spec):
        assert s.tokens == target_generate(t, p, 20, set()).tokens


def test_cache_growth_past_its_first_capacity():
    """A 250-token prompt and 30 new tokens cross the preallocated cache's first 256 slots."""
    t, d = small_pair(K=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (250,), generator=g).tolist(), [3, 4]]
    spec = generate(t, d, prompts, 4, 30, set())
    for p, s in zip(prompts, spec):
        one = speculative_generate(t, d, p, 4, 30, set())
        assert s.tokens == one.tokens == target_generate(t, p, 30, set()).tokens and s.accepted == one.accepted


def test_per_position_acceptance_hand_computed():
    # steps accepting 0, 1, 3, 2 drafts: ≥1: 3 of 4, ≥2: 2 of 4, ≥3: 1 of 4
    uncond, cond = per_position_acceptance([0, 1, 3, 2], 3)
    assert uncond == pytest.approx([0.75, 0.5, 0.25]) and cond == pytest.approx([0.75, 2 / 3, 0.5])
    assert 1 + sum(uncond) == pytest.approx(sum(a + 1 for a in [0, 1, 3, 2]) / 4)  # τ, vLLM's convention


def test_lossless_is_exact_in_fp32_and_in_bf16_with_the_verifiers_numerics(tmp_path):
    """fp32: every turn equals the target alone. bf16: every turn equals the target alone decoded
    in the verifier's numerics ((K+1)-token forwards); the turns that differ from the 1-token
    target alone are counted, and each difference starts at a near-tie of the target's fp32 logits
    (the two tokens within bf16 rounding of each other)."""
    g = torch.Generator().manual_seed(0)
    prompts = [{"id": i, "category": "c", "input_ids": torch.randint(0, 127, (6,), generator=g).tolist()} for i in range(8)]
    for prec in ("fp32", "bf16"):
        t, d = small_pair(K=3)
        ref = FeatureTarget(small_pair(K=3)[0].model, [0, 1, 2])  # an fp32 copy of the same target
        settings = EvalSettings(num_speculative_tokens=3, max_new_tokens=32, plot=False)
        r = evaluate_acceptance(t, d, None, prompts, settings, out_dir=tmp_path / prec, precision=prec)
        recs = [json.loads(x) for x in (tmp_path / prec / "results.jsonl").read_text().splitlines()]
        by = {(x["id"], x["decoder"]): x["tokens"] for x in recs}
        assert r["precision"] == prec and r["lossless"] is True and r["lossless_mismatches"] == 0
        if prec == "fp32":
            assert "exactly" in r["lossless_definition"] and "mismatches_vs_one_token_target" not in r
            assert all(by[(i, "head")] == by[(i, "target")] for i in range(8)) and (0, "reference") not in by
            continue
        assert "verifier's numerics" in r["lossless_definition"]
        assert all(by[(i, "head")] == by[(i, "reference")] for i in range(8))
        differ = [i for i in range(8) if by[(i, "head")] != by[(i, "target")]]
        assert r["mismatches_vs_one_token_target"] == len(differ)
        for i in differ:
            a, b = by[(i, "head")], by[(i, "target")]
            n = next(k for k in range(len(a)) if a[k] != b[k])
            logits = ref(torch.tensor([prompts[i]["input_ids"] + b[:n]])).logits[0, -1]
            assert abs(logits[a[n]] - logits[b[n]]) <= 2 ** -7 * logits.abs().max() * 4


CHILD = """
import sys, torch
torch.set_num_threads(1)
from tests.integration.test_evaluate import small_pair
from peagle_train.evaluation.run import evaluate_acceptance
from peagle_train.evaluation.settings import EvalSettings
t, d = small_pair(K=3)
_, e3 = small_pair(algorithm="eagle3", K=3, seed=1)
prompts = [{"id": i, "category": "c%d" % (i % 2), "input_ids": torch.randint(0, 127, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist()}
           for i in range(int(sys.argv[2]))]
evaluate_acceptance(t, d, None, prompts, EvalSettings(num_speculative_tokens=3, max_new_tokens=int(sys.argv[3]),
                                                     plot=False, benchmark="random"),
                    out_dir=sys.argv[1], baseline_draft=e3, precision="fp32")
"""

TIMING = ("tokens_per_second", "speedup", "time_shares", "latency", "draft_seconds_per_step",
          "target_only_tokens_per_second")


def _no_timing(r):
    out = {k: v for k, v in r.items() if k not in TIMING and k not in ("baseline", "per_category")}
    out["baseline"] = {k: v for k, v in r["baseline"].items() if k not in TIMING}
    out["per_category"] = {c: {k: v for k, v in x.items() if k not in TIMING} for c, x in r["per_category"].items()}
    return out


def test_killed_evaluation_resumes_and_decodes_only_what_is_missing(tmp_path, caplog):
    """SIGKILL a real evaluation process mid-run; the rerun keeps every line written before the
    kill, decodes only the missing (id, turn, decoder) keys, and writes an acceptance.json whose
    figures equal an uninterrupted run's; a third run decodes nothing and rewrites it identically."""
    n, new = 10, 48
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(killed), str(n), str(new)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = killed / "results.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= 7:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = log.read_text()
    kept = before[: before.rfind("\n") + 1]
    assert 7 <= len(kept.splitlines()) < 3 * n and not (killed / "acceptance.json").exists()
    t, d = small_pair(K=3)
    _, e3 = small_pair(algorithm="eagle3", K=3, seed=1)
    prompts = [{"id": i, "category": "c%d" % (i % 2), "input_ids": torch.randint(0, 127, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist()}
               for i in range(n)]
    settings = EvalSettings(num_speculative_tokens=3, max_new_tokens=new, plot=False, benchmark="random")
    kw = dict(settings=settings, baseline_draft=e3, precision="fp32")
    with caplog.at_level(logging.INFO, logger="peagle_train.evaluation.run"):
        resumed = evaluate_acceptance(t, d, None, prompts, out_dir=killed, **kw)
    reused = len(kept.splitlines())
    assert f"decoded {3 * n - reused} results, reused {reused}" in caplog.text
    after = log.read_text()
    assert after.startswith(kept)
    keys = [(x["id"], x["turn"], x["decoder"]) for x in map(json.loads, after.splitlines())]
    assert len(keys) == len(set(keys)) == 3 * n
    full = evaluate_acceptance(t, d, None, prompts, out_dir=whole, **kw)
    assert _no_timing(resumed) == _no_timing(full)
    tok = lambda p: {(x["id"], x["decoder"]): x["tokens"] for x in map(json.loads, p.read_text().splitlines())}  # noqa: E731
    assert tok(log) == tok(whole / "results.jsonl")
    first = (killed / "acceptance.json").read_text()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="peagle_train.evaluation.run"):
        evaluate_acceptance(t, d, None, prompts, out_dir=killed, **kw)
    assert f"decoded 0 results, reused {3 * n}" in caplog.text
    assert (killed / "acceptance.json").read_text() == first
    caplog.clear()  # other settings: the old results are moved aside, never mixed in
    with caplog.at_level(logging.INFO, logger="peagle_train.evaluation.run"):
        evaluate_acceptance(t, d, None, prompts[:2], out_dir=killed, **{**kw, "settings": dataclasses.replace(settings, max_new_tokens=8)})
    assert "max_new_tokens" in caplog.text and "decoded 6 results, reused 0" in caplog.text
    assert (killed / "results.stale.jsonl").read_text() == after


def test_decode_attention_accumulates_in_fp32():
    """bf16 decoding attention (target/capture.py `decode_attention`) against an fp64 SDPA over
    the repeated kv heads of the same bf16 inputs: within one bf16 rounding of the output (fp32
    scores, softmax and sum), for 1 and 6 queries over a cache (S > n), with a validity mask with
    holes, an additive mask, and no mask (causal over the new slots); fp32 tensors go to
    transformers' SDPA unchanged."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from peagle_train.target.capture import decode_attention

    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    g = torch.Generator().manual_seed(0)
    for n, kind in [(1, "none"), (1, "bool"), (6, "bool"), (6, "float"), (6, "none")]:
        q = torch.randn(3, 4, n, 16, generator=g)
        k, v = torch.randn(3, 2, 37, 16, generator=g), torch.randn(3, 2, 37, 16, generator=g)
        causal = torch.ones(n, 37, dtype=torch.bool).tril(37 - n)[None, None].expand(3, 1, n, 37)
        holes = (torch.rand(3, 1, n, 37, generator=g) > 0.3) & causal
        holes[..., -n:] |= torch.eye(n, dtype=torch.bool)  # every query sees itself
        seen = {"none": causal, "bool": holes, "float": holes}[kind]
        mask = {"none": None, "bool": holes,
                "float": torch.zeros(3, 1, n, 37).masked_fill(~holes, torch.finfo(torch.float32).min)}[kind]
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        out, _ = decode_attention(module, qb, kb, vb, mask, scaling=0.25)
        assert out.dtype == torch.bfloat16 and out.shape == (3, n, 4, 16)
        exact = F.scaled_dot_product_attention(qb.double(), kb.repeat_interleave(2, 1).double(),
                                               vb.repeat_interleave(2, 1).double(), attn_mask=seen,
                                               scale=0.25).transpose(1, 2)
        assert ((out.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all(), kind  # one rounding per element
        fp32, _ = decode_attention(module, q, k, v, mask, scaling=0.25)
        same, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
        assert torch.equal(fp32, same)


def test_bf16_decoding_runs_decode_attention_and_restores_sdpa(monkeypatch):
    """A bf16 target's cached (decoding) forwards run `decode_attention`; forwards without a cache
    (training features) and fp32 targets keep `sdpa`; the config is restored afterwards."""
    from transformers import AttentionInterface

    from peagle_train.target import capture as features

    from ..conftest import tiny_llama

    calls = []
    real = features.decode_attention

    def spy(module, query, *a, **kw):
        calls.append(query.dtype)
        return real(module, query, *a, **kw)

    AttentionInterface.register(features.DECODE_ATTENTION, spy)
    try:
        for dtype, expect in [(torch.float32, 0), (torch.bfloat16, 8 * 5)]:  # 8 layers × (prefill + 4 steps)
            calls.clear()
            t = FeatureTarget(tiny_llama().to(dtype))
            t(torch.tensor([[1, 2, 3]]))  # no cache: a training-feature forward
            assert calls == []
            out = generate(t, None, [[5, 6, 7, 8]], 5, 5, set())
            assert len(out[0].tokens) == 5 and len(calls) == expect and set(calls) <= {torch.bfloat16}
            assert t.config._attn_implementation == "sdpa"
    finally:
        AttentionInterface.register(features.DECODE_ATTENTION, real)


def test_an_upcast_target_cache_stores_fp32_and_decodes_the_same_tokens(monkeypatch):
    """`SlotCache(upcast=True)` (the bf16 target's cache): entries written in bf16 are stored and
    returned in fp32 with the same values; `decode_attention` over them equals it over the bf16
    entries bit for bit (it upcasts them itself), and its transformers fallback gets them back in
    the query's dtype; a bf16 target decodes the same tokens with and without the upcast cache."""
    from types import SimpleNamespace

    from peagle_train.decoding import engine as engine_mod
    from peagle_train.draft.kv_cache import SlotCache
    from peagle_train.target.capture import decode_attention

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 9, 16, generator=g).bfloat16(), torch.randn(2, 2, 9, 16, generator=g).bfloat16()
    up, plain = SlotCache(upcast=True), SlotCache()
    ku, vu = up.update(k, v, 0)
    kp, vp = plain.update(k, v, 0)
    assert ku.dtype == vu.dtype == torch.float32 and kp.dtype == torch.bfloat16
    assert torch.equal(ku, k.float()) and torch.equal(vu, v.float()) and up.layer(1).upcast
    ku, vu = up.update(k[:, :, :3], v[:, :, :3], 0)  # appended entries are upcast too
    assert ku.shape[2] == 12 and torch.equal(ku[:, :, 9:], k[:, :, :3].float())

    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    q = torch.randn(2, 4, 3, 16, generator=g).bfloat16()
    a, _ = decode_attention(module, q, k.float(), v.float(), None, scaling=0.25)
    b, _ = decode_attention(module, q, k, v, None, scaling=0.25)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    per_head = torch.rand(2, 4, 3, 9, generator=g) > 0.3  # a per-head mask goes to transformers' SDPA
    per_head[..., 0] = True
    c, _ = decode_attention(module, q, k.float(), v.float(), per_head, scaling=0.25)
    d, _ = decode_attention(module, q, k, v, per_head, scaling=0.25)
    assert c.dtype == torch.bfloat16 and torch.equal(c, d)

    t, head = small_pair(K=3)
    t.model.to(torch.bfloat16)
    head.to(torch.bfloat16)
    prompts = [[5, 17, 33, 2, 90], [1, 2, 3]]
    made = []

    def cache(upcast=False):
        made.append(upcast)
        return SlotCache(upcast=upcast)

    monkeypatch.setattr(engine_mod, "SlotCache", cache)
    with_upcast = [(r.tokens, r.accepted) for r in generate(t, head, prompts, 3, 20, set())]
    assert made[0] is True  # the target's cache: bf16 sdpa target
    monkeypatch.setattr(engine_mod, "SlotCache", lambda upcast=False: SlotCache())
    assert [(r.tokens, r.accepted) for r in generate(t, head, prompts, 3, 20, set())] == with_upcast


def test_greedy_picks_the_first_maximum_in_bf16_without_an_fp32_copy():
    from peagle_train.decoding.acceptance import Greedy, first_argmax

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 1000, generator=g).to(torch.bfloat16)
    logits[0, 0, [7, 900]] = 9.0       # a tie: the lower id wins, as argmax
    logits[1, 2, [3, 4, 5]] = 9.0
    assert first_argmax(logits).tolist() == logits.float().argmax(-1).tolist()
    assert first_argmax(logits)[0, 0] == 7 and first_argmax(logits)[1, 2] == 3
    drafts = logits.float().argmax(-1)[:, :3].clone()
    drafts[2, 1] += 1                   # row 2 keeps one draft, rows 0 and 1 all three
    j, nxt = Greedy().verify(drafts, None, logits, None)
    assert j.tolist() == [3, 3, 1]
    assert nxt.tolist() == [int(logits[0, 3].float().argmax()), int(logits[1, 3].float().argmax()),
                            int(logits[2, 1].float().argmax())]


def test_the_engine_keeps_half_precision_logits(monkeypatch):
    t, _ = small_pair(vocab=64)
    t.model.to(torch.bfloat16)
    seen = []
    forward = FeatureTarget.forward

    def spy(self, *a, **kw):
        out = forward(self, *a, **kw)
        seen.append(out.logits.dtype)
        return out

    monkeypatch.setattr(FeatureTarget, "forward", spy)
    monkeypatch.setattr(FeatureTarget, "__call__", spy)
    generate(t, None, [[1, 2, 3]], 3, 4, set())
    assert seen and set(seen) == {torch.bfloat16}
    assert t(torch.tensor([[1, 2, 3]])).logits.dtype == torch.float32  # training and features still get fp32


class AttentionCalls:
    """Counts the decoding forwards' attention calls: `torch.nn.functional.scaled_dot_product_attention`
    by caller (transformers' `sdpa_attention_forward`: the target; anything else: the draft head)
    with the dtypes of its query, key and value, and `decode_attention` (target/capture.py)."""

    def __init__(self, monkeypatch):
        import sys

        from transformers import AttentionInterface

        from peagle_train.target import capture

        self.sdpa, self.decode = {"target": [], "head": []}, 0
        real_sdpa, real_decode = torch.nn.functional.scaled_dot_product_attention, capture.decode_attention

        def sdpa(q, k, v, *a, **kw):
            who = "target" if sys._getframe(1).f_code.co_name == "sdpa_attention_forward" else "head"
            self.sdpa[who].append((q.dtype, k.dtype, v.dtype))
            return real_sdpa(q, k, v, *a, **kw)

        def decode(*a, **kw):
            self.decode += 1
            return real_decode(*a, **kw)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        capture.register_attention()
        AttentionInterface.register(capture.DECODE_ATTENTION, decode)
        self.restore = lambda: AttentionInterface.register(capture.DECODE_ATTENTION, real_decode)

    def clear(self):
        self.sdpa, self.decode = {"target": [], "head": []}, 0


@pytest.fixture
def attention_calls(monkeypatch):
    calls = AttentionCalls(monkeypatch)
    yield calls
    calls.restore()


def _tau_of(results):
    steps = [a for r in results for a in r.accepted]
    return 1 + sum(steps) / len(steps)


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_sdpa_decoding_in_fp32_is_todays_path_lossless_in_a_ragged_batch(algorithm, attention_calls):
    """fp32 with SDPA forced (`FeatureTarget.sdpa_decoding`, the CUDA default) decodes a ragged
    batch (padded prompts, rejected-draft holes) with the same tokens, accepted counts and τ as
    today's CPU path, each row the target's own greedy text (the per-sequence oracle); every
    attention call is SDPA in fp32, 4 target layers per engine target forward and 1 head layer per
    draft forward, and `decode_attention` is never called."""
    t, d = small_pair(algorithm=algorithm, K=3)
    prompts = [[5, 17, 33, 2, 90], [1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14]]
    today = generate(t, d, prompts, 3, 24, set())
    t.sdpa_decoding = True
    attention_calls.clear()
    sdpa = generate(t, d, prompts, 3, 24, set())
    assert [(r.tokens, r.accepted) for r in sdpa] == [(r.tokens, r.accepted) for r in today]
    assert _tau_of(sdpa) == _tau_of(today) > 1  # some drafts accepted, so the drafts' positions matter
    calls = attention_calls
    assert calls.decode == 0
    assert len(calls.sdpa["target"]) == 4 * max(r.target_forwards for r in sdpa)  # the longest row is in every forward
    assert len(calls.sdpa["head"]) == max(r.draft_forwards for r in sdpa)
    assert {c for v in calls.sdpa.values() for c in v} == {(torch.float32,) * 3}
    for p, r in zip(prompts, sdpa):
        assert r.tokens == target_generate(t, p, 24, set()).tokens


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_sdpa_decoding_in_bf16_over_a_bf16_cache_is_lossless(algorithm, attention_calls):
    """bf16 target and head on CPU with SDPA forced (the CUDA path): the target's cache is bf16
    (`target_cache`: no upcast), every target and head attention call is SDPA over bf16 query, keys
    and values (`decode_attention` is never called), and each prompt's output equals the target
    alone in the same precision and path, decoded in the verifier's numerics (the lossless reference
    below fp32, evaluation/run.py)."""
    from peagle_train.decoding.engine import target_cache

    t, d = small_pair(algorithm=algorithm, K=3)
    t.model.to(torch.bfloat16)
    d.to(torch.bfloat16)
    assert target_cache(t).layer(0).upcast  # today's CPU path: fp32 attention over an fp32 cache
    t.sdpa_decoding = True
    assert t.decode_attn_implementation is None and not target_cache(t).layer(0).upcast
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(6):
        p = torch.randint(0, 127, (6,), generator=g).tolist()
        attention_calls.clear()
        spec = generate(t, d, [p], 3, 32, set())[0]
        assert attention_calls.decode == 0
        assert len(attention_calls.sdpa["target"]) == 4 * spec.target_forwards
        assert len(attention_calls.sdpa["head"]) == spec.draft_forwards
        assert {c for v in attention_calls.sdpa.values() for c in v} == {(torch.bfloat16,) * 3}
        ref = generate(t, None, [p], 3, 32, set(), verifier_numerics=True)[0]
        assert len(spec.tokens) == 32 and spec.tokens == ref.tokens
        accepted += sum(spec.accepted)
    assert accepted > 0


def test_half_precision_targets_decode_with_sdpa_and_their_own_cache_dtype_on_cuda(monkeypatch):
    """The decoding attention and cache by device and precision: an fp32 target runs its own SDPA
    over an fp32 cache everywhere; a bf16 one runs `decode_attention` over an fp32 cache on CPU and
    its own SDPA over a bf16 cache on CUDA (the device is faked: the rule only reads it);
    `sdpa_decoding` False forces the fp32 attention on CUDA too."""
    from peagle_train.decoding.engine import target_cache
    from peagle_train.target.capture import DECODE_ATTENTION

    t, _ = small_pair()
    assert t.decode_attn_implementation is None and not target_cache(t).layer(0).upcast
    t.model.to(torch.bfloat16)
    assert t.decode_attn_implementation == DECODE_ATTENTION and target_cache(t).layer(0).upcast
    monkeypatch.setattr(type(t.model), "device", property(lambda self: torch.device("cuda", 0)))
    assert t.decode_attn_implementation is None and not target_cache(t).layer(0).upcast
    t.sdpa_decoding = False
    assert t.decode_attn_implementation == DECODE_ATTENTION and target_cache(t).layer(0).upcast
