"""experiments/regen_fair.py: the fair regeneration test's arms at equal distinct tokens, and its table,
hand-checked."""

import json

import pytest

import regen_fair  # experiments/ (pytest's pythonpath, pyproject.toml)


def test_equal_token_arms_by_hand():
    # D = min(3 + 5 + 4, 2 + 2 + 2) = 6: arm a keeps 3 (3 + 5 > 6), arm b all three (2 + 2 + 2 = 6)
    assert regen_fair.equal_token_arms([3, 5, 4], [2, 2, 2]) == (1, 3)
    # D = min(10, 10) = 10: both keep all
    assert regen_fair.equal_token_arms([4, 6], [5, 5]) == (2, 2)
    # D = min(9, 8) = 8: a keeps 2 + 2 + 4 (+ 1 > 8), b keeps 7 + 1
    assert regen_fair.equal_token_arms([2, 2, 4, 1], [7, 1]) == (3, 2)
    # D = min(9, 5) = 5: a keeps 2 + 2 (+ 4 > 5), b its one conversation of 5
    assert regen_fair.equal_token_arms([2, 2, 4, 1], [5]) == (2, 1)


def test_cut_to_users_by_hand():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    assert regen_fair.cut_to_users(msgs, 1) == msgs[:3]
    assert regen_fair.cut_to_users(msgs, 2) == msgs
    assert regen_fair.user_turns(msgs) == 2


def test_arms_written_at_equal_tokens(tmp_path, chatml_tokenizer):
    """Three originals answered again: the regenerated answers are short, so the original arm keeps the
    prefix whose tokens stay within the regenerated arm's total; the original of a two-turn record is cut
    to the one turn regenerated; an id without an original is counted."""
    from peagle_train.data.template import tokenize_conversation

    chatml_tokenizer.save_pretrained(tmp_path / "tok")
    long = "hello there, how are you today? I am fine, thank you. " * 4
    originals = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "What is two plus two?"},
                                                  {"from": "gpt", "value": long},
                                                  {"from": "human", "value": "hello there"},
                                                  {"from": "gpt", "value": long}]} for i in range(3)]
    regen = [{"id": f"c{i}", "messages": [{"role": "user", "content": "What is two plus two?"},
                                          {"role": "assistant", "content": "The answer is 4."}]} for i in range(3)]
    regen.append({"id": "stray", "messages": regen[0]["messages"]})
    # a fourth original answered in one word: under min_supervised_tokens (4 here), training would drop it
    # from the regenerated arm alone, so the pair leaves both arms
    originals.append({"id": "short", "conversations": originals[0]["conversations"]})
    regen.append({"id": "short", "messages": [regen[0]["messages"][0], {"role": "assistant", "content": "4"}]})
    (tmp_path / "regen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in regen))
    (tmp_path / "orig.json").write_text(json.dumps(originals))
    args = regen_fair.Args(command="arms", regenerated=str(tmp_path / "regen.jsonl"), data=str(tmp_path / "orig.json"),
                           out=str(tmp_path / "arms"), max_length=640, target=str(tmp_path / "tok"),
                           min_supervised_tokens=4)
    counts = regen_fair.make_arms(args)

    one_orig = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": long}]
    t_orig = len(tokenize_conversation(chatml_tokenizer, one_orig, 640).input_ids)
    t_regen = len(tokenize_conversation(chatml_tokenizer, regen[0]["messages"], 640).input_ids)
    assert t_orig > t_regen  # so D = 3 · t_regen and the original arm keeps floor(D / t_orig) conversations
    n_orig = 3 * t_regen // t_orig
    assert sum(tokenize_conversation(chatml_tokenizer, regen[0]["messages"], 640).loss_mask) >= 4
    assert sum(tokenize_conversation(chatml_tokenizer, regen[-1]["messages"], 640).loss_mask) < 4
    assert counts["pairs"] == 3 and counts["without_original"] == 1 and counts["pairs_under_min_supervised_tokens"] == 1
    assert counts["regen"]["conversations"] == 3 and counts["regen"]["tokens"] == 3 * t_regen
    assert counts["orig"]["conversations"] == n_orig and counts["orig"]["tokens"] == n_orig * t_orig
    assert counts["orig"]["all_pairs_tokens"] == 3 * t_orig
    orig_rows = [json.loads(x) for x in (tmp_path / "arms" / "orig.jsonl").read_text().splitlines()]
    assert [r["id"] for r in orig_rows] == [f"c{i}" for i in range(n_orig)]
    assert all(r["messages"] == one_orig for r in orig_rows)
    regen_rows = [json.loads(x) for x in (tmp_path / "arms" / "regen.jsonl").read_text().splitlines()]
    assert regen_rows == regen[:3]  # not "stray" (no original), not "short"
    assert json.loads((tmp_path / "arms" / "arms.json").read_text()) == counts


def _eval(run, bench, step, head, baseline):
    d = run / f"eval-{bench}" / "base__regen" / f"step_{step:06d}" / "eval"
    d.mkdir(parents=True)
    acc = {"acceptance_length": head[0], "acceptance_length_stderr": head[1], "per_position_acceptance": head[2],
           "baseline": {"acceptance_length": baseline[0], "acceptance_length_stderr": baseline[1],
                        "per_position_acceptance": baseline[2]}}
    (d / "acceptance.json").write_text(json.dumps(acc))


def test_report_by_hand(tmp_path):
    run = tmp_path / "run"
    counts = {"pairs": 10, "without_original": 0, "max_length": 640, "pairs_under_min_supervised_tokens": 3,
              "min_supervised_tokens": 16,
              "orig": {"conversations": 4, "tokens": 2000, "supervised_tokens": 1500, "all_pairs_tokens": 5000},
              "regen": {"conversations": 9, "tokens": 2010, "supervised_tokens": 1200, "all_pairs_tokens": 2010}}
    (run / "arms").mkdir(parents=True)
    (run / "arms" / "arms.json").write_text(json.dumps(counts))
    for arm, tokens in (("base", 491_000), ("regen", 489_000)):
        (run / arm).mkdir()
        (run / arm / "train_log.jsonl").write_text(json.dumps({"step": 240, "tokens": tokens}) + "\n")
    _eval(run, "mt_bench", 240, (1.30, 0.01, [0.25, 0.05, 0.0]), (1.36, 0.012, [0.30, 0.06, 0.01]))
    _eval(run, "humaneval", 240, (1.20, 0.02, [0.18, 0.02, 0.0]), (1.15, 0.02, [0.14, 0.01, 0.0]))
    (run / "regenerate").mkdir()
    (run / "regenerate" / "regenerated.jsonl.manifest").write_text(json.dumps({
        "settings": {"regenerated_by": "pkg:smollm2", "backend": "vllm", "temperature": 0.2, "top_p": 0.9,
                     "max_new_tokens": 512, "max_turns": 1, "drop_cut": False},
        "conversations": 1020, "dropped": {"exact duplicate of a conversation in the output": 3}}))
    out = tmp_path / "R.md"
    out.write_text("# R\n")
    text = regen_fair.report(regen_fair.Args(command="report", run_dir=str(run), out=str(out)))
    lines = text.splitlines()
    assert "| base | 240 | 0.49M | 1.300 ± 0.010 |  | 0.250 | 0.050 | 0.000 | 0.20 |" in lines
    assert "| regen | 240 | 0.49M | 1.360 ± 0.012 | +0.060 | 0.300 | 0.060 | 0.010 | 0.20 |" in lines
    assert "| regen | 240 | 0.49M | 1.150 ± 0.020 | -0.050 | 0.140 | 0.010 | 0.000 | 0.07 |" in lines
    assert "(`regen`); 3 pairs left out, under 16 supervised tokens in an arm: 2,000 / 2,010 distinct tokens " \
           "(1,500 / 1,200 supervised)" in text
    assert ("Regenerated through vllm by pkg:smollm2: temperature 0.2, top_p 0.9, at most 512 new tokens, the first 1 "
            "user turn(s), answers cut at that limit kept; 1,020 conversations written, dropped: exact duplicate of a "
            "conversation in the output: 3.") in text
    assert out.read_text().count(regen_fair.HEADING) == 1
    with pytest.raises(Exception, match="arms.json not found"):
        regen_fair.report(regen_fair.Args(command="report", run_dir=str(tmp_path / "none")))
