"""Data: truncated-file recovery, role normalisation, bad input, template loss mask, draft vocab, mask token."""

import json

import pytest
import torch

from peagle_train.data.conversations import DataFileError, NormalizeStats, normalize_messages, read_records
from peagle_train.data.prepare import prepare_data
from peagle_train.data.template import tokenize_conversation
from peagle_train.data.vocab import DraftVocab, build_draft_vocab, choose_mask_token, validate_mask_token


def conv(*turns, rid="x"):
    return {"id": rid, "conversations": [{"from": r, "value": v} for r, v in turns]}


def write_array(path, records, cut: int | None = None):
    text = json.dumps(records, indent=2)
    path.write_text(text[:cut] if cut else text)


def test_truncated_array_recovers_every_complete_record(tmp_path):
    recs = [conv(("human", f"q{i}"), ("gpt", f"a{i}"), rid=str(i)) for i in range(4)]
    f = tmp_path / "sg.json"
    full = json.dumps(recs, indent=2)
    cut = full.index('"3"') + 10  # inside the last record
    f.write_text(full[:cut])
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "1", "2"]
    assert rep.truncated and rep.lost_bytes > 0 and rep.records == 3
    assert "truncated" in rep.summary()


def test_malformed_middle_record_is_skipped_and_named(tmp_path):
    recs = [conv(("human", "q"), ("gpt", "a"), rid=str(i)) for i in range(3)]
    text = json.dumps(recs, indent=2).replace('"id": "1"', '"id": "1" "oops": 1', 1)
    f = tmp_path / "sg.json"
    f.write_text(text)
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "2"]
    assert len(rep.bad_records) == 1 and "record 1" in rep.bad_records[0] and not rep.truncated


def test_jsonl_bad_line_counted(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{bad\n')
    got, rep = read_records(f)
    assert len(got) == 1 and rep.bad_records == ["line 2: Expecting property name enclosed in double quotes"]


def test_missing_or_empty_file_names_the_file(tmp_path):
    with pytest.raises(DataFileError, match="nope.json"):
        read_records(tmp_path / "nope.json")
    (tmp_path / "empty.json").write_text("[\n")
    with pytest.raises(DataFileError, match="empty.json"):
        read_records(tmp_path / "empty.json")


def test_normalisation_rules():
    st = NormalizeStats()
    assert normalize_messages(conv(("system", "s"), ("human", "q"), ("chatgpt", "a"), ("user", "q2"), ("bard", "b")), st) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]
    # starts with the assistant: that turn is dropped; trailing user turn removed
    assert normalize_messages(conv(("gpt", "hello"), ("human", "q"), ("bing", "a"), ("human", "unanswered")), st) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    # consecutive same-role turns merged with a blank line
    assert normalize_messages(conv(("human", "a"), ("human", "b"), ("gpt", "c")), st)[0]["content"] == "a\n\nb"
    # an empty message truncates before it; nothing left → no assistant turn
    assert normalize_messages(conv(("human", "q"), ("gpt", "a"), ("human", ""), ("gpt", "z")), st) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert normalize_messages(conv(("human", "q"), ("gpt", "  ")), st) is None
    assert normalize_messages(conv(("human", "q"), ("robot", "a")), st) is None
    assert normalize_messages(conv(("human", "only a question")), st) is None
    assert st.dropped == {"no assistant turn": 2, "unknown role 'robot'": 1}
    assert st.changed["leading assistant turn dropped"] == 1
    assert st.changed["consecutive same-role turns merged"] == 1
    assert st.changed["truncated at an empty message"] == 2


def test_chatml_loss_mask_is_exactly_the_generated_tokens(chatml_tokenizer):
    tok = chatml_tokenizer
    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "I am fine"},
            {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "The answer is 4."}]
    row = tokenize_conversation(tok, msgs)
    masked = tok.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m])
    assert masked == "I am fine<|im_end|>The answer is 4.<|im_end|>"
    # the unmasked text is everything else, including the newline after each <|im_end|>
    text = tok.decode(row.input_ids)
    assert text == tok.apply_chat_template(msgs, tokenize=False)
    assert row.loss_mask[-1] == 0 and tok.decode(row.input_ids[-1:]) == "\n"
    short = tokenize_conversation(tok, msgs, max_length=7)
    assert short.input_ids == row.input_ids[:7] and short.loss_mask == row.loss_mask[:7]


def test_draft_vocab_hand_checked():
    ids = [[1, 5, 5, 9, 9, 9, 2], [5, 7, 7]]
    masks = [[0, 1, 1, 1, 1, 1, 0], [0, 1, 1]]
    v = build_draft_vocab(ids, masks, 3, 12)
    # supervised counts: 9→3, 5→2, 7→2; top 3 sorted by id
    assert v.draft_ids.tolist() == [5, 7, 9]
    assert v.d2t.tolist() == [5, 6, 7]
    assert v.t2d.nonzero().flatten().tolist() == [5, 7, 9]
    assert v.coverage == 1.0
    v2 = build_draft_vocab(ids, masks, 2, 12)
    assert v2.draft_ids.tolist() == [5, 9] and v2.coverage == pytest.approx(5 / 7)  # tie 5/7 → smaller id
    assert DraftVocab.from_ids(torch.tensor([9, 5]), 12).d2t.tolist() == [5, 8]


def test_mask_token_is_unused_and_validated(chatml_tokenizer):
    tok = chatml_tokenizer
    V = len(tok)
    used = set(range(V - 3, V))
    mt = choose_mask_token(tok, used, V)
    assert mt == V - 4 and mt not in tok.all_special_ids
    with pytest.raises(ValueError, match="appears in the training data"):
        validate_mask_token(V - 1, V, used, set())
    with pytest.raises(ValueError, match="outside"):
        validate_mask_token(V, V, used, set())


def test_prepare_data_counts_every_drop(tmp_path, chatml_tokenizer):
    recs = [conv(("human", "hello there"), ("gpt", "I am fine, thank you. The answer is 4."), rid="ok"),
            conv(("human", "hello"), ("robot", "x"), rid="badrole"),
            conv(("human", "hello"), rid="noanswer"),
            conv(("human", "hello"), ("gpt", "4"), rid="tiny")]
    f = tmp_path / "d.json"
    write_array(f, recs)
    d = prepare_data(f, chatml_tokenizer, len(chatml_tokenizer), num_conversations=None, max_length=64,
                     min_supervised_tokens=5, draft_vocab_size=20)
    s = d.summary
    assert s["conversations_read"] == 4 and s["conversations_kept"] == 1
    assert s["dropped"] == {"unknown role 'robot'": 1, "no assistant turn": 1, "fewer than 5 supervised tokens": 1}
    assert d.rows["source"] == ["ok"]
    assert d.mask_token_id not in set(d.rows["input_ids"][0])


# ---- sources through datasets, caching, mixes, bad input, manifest, packing ----

@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def prep(path, tok, **kw):
    args = dict(num_conversations=None, max_length=64, min_supervised_tokens=1, draft_vocab_size=20)
    return prepare_data(path, tok, len(tok), **{**args, **kw})


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


QA = [("hello there", "I am fine, thank you."), ("What is two plus two?", "The answer is 4."),
      ("how are you today?", "I am fine.")]


def test_formats_give_the_same_rows(tmp_path, chatml_tokenizer):
    import datasets

    sg = tmp_path / "sg.json"
    write_array(sg, [conv(("human", q), ("gpt", a), rid=str(i)) for i, (q, a) in enumerate(QA)])
    oa = tmp_path / "oa.jsonl"
    write_jsonl(oa, [{"id": str(i), "messages": [{"role": "user", "content": q},
                                                 {"role": "assistant", "content": [{"type": "text", "text": a}]}]}
                     for i, (q, a) in enumerate(QA)])
    uc = tmp_path / "uc.jsonl"
    write_jsonl(uc, [{"id": str(i), "data": [q, a]} for i, (q, a) in enumerate(QA)])
    hf = tmp_path / "hfdir"
    datasets.Dataset.from_list([{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                for i, (q, a) in enumerate(QA)]).save_to_disk(str(hf))
    ref = prep(sg, chatml_tokenizer).rows
    for f in (oa, uc, hf):
        rows = prep(f, chatml_tokenizer).rows
        assert rows["input_ids"] == ref["input_ids"] and rows["loss_mask"] == ref["loss_mask"], f
    assert sorted(ref["source"]) == ["0", "1", "2"]
    masked = [chatml_tokenizer.decode([t for t, m in zip(i, k) if m]) for i, k in zip(ref["input_ids"], ref["loss_mask"])]
    assert sorted(masked) == sorted(a + "<|im_end|>" for _, a in QA)


def test_pretokenised_rows_pass_through_unchanged(tmp_path, chatml_tokenizer):
    f = tmp_path / "tok.jsonl"
    write_jsonl(f, [{"id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},
                    {"id": "b", "input_ids": [9, 10], "loss_mask": [0]},            # lengths differ: dropped
                    {"id": "c", "input_ids": [1] * 70, "loss_mask": [0] + [1] * 69}])  # cut at max_length 64
    d = prep(f, chatml_tokenizer)
    got = {s: (i, m) for s, i, m in zip(d.rows["source"], d.rows["input_ids"], d.rows["loss_mask"])}
    assert got["a"] == ([5, 6, 7, 8], [0, 1, 1, 1])
    assert got["c"] == ([1] * 64, [0] + [1] * 63)
    assert "b" not in got and sum(d.summary["dropped"].values()) == 1
    assert d.summary["changed"] == {"cut at max_length": 1}


def test_second_run_is_a_cache_hit(tmp_path, chatml_tokenizer, monkeypatch):
    import peagle_train.data.prepare as P

    f = tmp_path / "sg.json"
    write_array(f, [conv(("human", q), ("gpt", a), rid=str(i)) for i, (q, a) in enumerate(QA)])
    calls = []
    real = P._tokenise_batch
    monkeypatch.setattr(P, "_tokenise_batch", lambda b, **kw: calls.append(1) or real(b, **kw))
    first = prep(f, chatml_tokenizer)
    assert calls
    calls.clear()
    second = prep(f, chatml_tokenizer)
    assert calls == [] and second.rows["input_ids"] == first.rows["input_ids"]
    prep(f, chatml_tokenizer, max_length=32)  # another setting is another fingerprint
    assert calls


def test_mix_takes_rows_by_weight(tmp_path, chatml_tokenizer):
    a, b = tmp_path / "a.json", tmp_path / "b.jsonl"
    write_array(a, [conv(("human", "hello there"), ("gpt", "I am fine."), rid=f"a{i}") for i in range(10)])
    write_jsonl(b, [{"id": f"b{i}", "messages": [{"role": "user", "content": "What is two plus two?"},
                                                 {"role": "assistant", "content": "The answer is 4."}]} for i in range(10)])
    d = prep(None, chatml_tokenizer, mix=[{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 1.0}],
             num_conversations=6)
    src = d.rows["source"]
    assert sum(s.startswith("a:") for s in src) == 4 and sum(s.startswith("b:") for s in src) == 2
    # all data: the largest 2:1 mix that uses no row twice (10 of a, 5 of b)
    d = prep(None, chatml_tokenizer, mix=[{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 1.0}])
    assert sorted(s[0] for s in d.rows["source"]) == ["a"] * 10 + ["b"] * 5
    assert [s["weight"] for s in d.manifest["sources"]] == [2.0, 1.0]


def test_bad_input_is_counted_or_named(tmp_path, chatml_tokenizer):
    recs = [conv(("human", "hello there"), ("gpt", "I am fine, thank you."), rid="ok"),
            {"id": "nonstr", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]},
            conv(("human", "   "), ("gpt", "x"), rid="blank"),
            conv(("human", "What is two plus two?"), ("gpt", "The answer is 4. " * 20), rid="long")]
    f = tmp_path / "bad.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs[:2]) + "{not json\n" + "".join(json.dumps(r) + "\n" for r in recs[2:]))
    d = prep(f, chatml_tokenizer, max_length=48)
    s = d.summary
    assert s["malformed_records_skipped"] == 1 and s["conversations_read"] == 4
    assert s["dropped"] == {"no assistant turn": 2}
    assert s["changed"]["truncated at a message with non-string content"] == 1
    assert s["changed"]["truncated at an empty message"] == 1
    assert s["changed"]["cut at max_length"] == 1 and max(len(x) for x in d.rows["input_ids"]) == 48
    with pytest.raises(DataFileError, match="nope.jsonl"):
        prep(tmp_path / "nope.jsonl", chatml_tokenizer)
    trunc = tmp_path / "trunc.json"
    full = json.dumps([conv(("human", "hello"), ("gpt", "I am fine."), rid=str(i)) for i in range(3)], indent=2)
    trunc.write_text(full[: full.index('"2"') + 5])
    d = prep(trunc, chatml_tokenizer)
    assert d.summary["file_truncated"] and d.summary["conversations_read"] == 2


def test_user_mask_token_used_by_data_is_refused_with_its_count(tmp_path, chatml_tokenizer):
    f = tmp_path / "sg.json"
    write_array(f, [conv(("human", q), ("gpt", a), rid=str(i)) for i, (q, a) in enumerate(QA)])
    im_end = chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match=f"mask_token_id={im_end} occurs 6 times in the training data"):
        prep(f, chatml_tokenizer, mask_token_id=im_end)  # 3 conversations × 2 turns' <|im_end|>


def test_manifest_round_trip_and_mismatch_refused(tmp_path, chatml_tokenizer):
    from peagle_train.data.manifest import ManifestMismatchError
    from peagle_train.data.prepare import load_prepared, save_prepared

    f = tmp_path / "sg.json"
    write_array(f, [conv(("human", q), ("gpt", a), rid=str(i)) for i, (q, a) in enumerate(QA)])
    d = prep(f, chatml_tokenizer)
    save_prepared(d, tmp_path / "out", pack_length=64)
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["sources"][0]["sha256"] == __import__("hashlib").sha256(f.read_bytes()).hexdigest()
    assert m["max_length"] == 64 and m["mask_token_id"] == d.mask_token_id and m["counts"]["conversations_kept"] == 3
    back = load_prepared(tmp_path / "out", chatml_tokenizer, len(chatml_tokenizer), max_length=64)
    assert back.rows["input_ids"] == d.rows["input_ids"] and torch.equal(back.vocab.d2t, d.vocab.d2t)
    with pytest.raises(ManifestMismatchError, match="max_length: prepared with 64, training gives 128"):
        load_prepared(tmp_path / "out", chatml_tokenizer, len(chatml_tokenizer), max_length=128)
    other = chatml_tokenizer.__class__(tokenizer_object=chatml_tokenizer.backend_tokenizer, eos_token="<|im_end|>",
                                       chat_template=chatml_tokenizer.chat_template.replace("\n", " "))
    with pytest.raises(ManifestMismatchError, match="chat template"):
        load_prepared(tmp_path / "out", other, len(chatml_tokenizer))
    with pytest.raises(ManifestMismatchError, match="target vocabulary size"):
        load_prepared(tmp_path / "out", chatml_tokenizer, len(chatml_tokenizer) + 1)


def test_pack_rows_hand_checked():
    import datasets

    from peagle_train.data.prepare import pack_rows

    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]],
                                       "loss_mask": [[0, 1, 1], [0, 1], [0, 0, 1, 1], [1]]})
    p = pack_rows(rows, 5)
    assert p["input_ids"] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert p["document_ids"] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
    assert p["loss_mask"] == [[0, 1, 1, 0, 1], [0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="pack_length"):
        pack_rows(rows, 4, max_length=8)


def test_no_chat_template_error_only_when_conversations_need_one(tmp_path, chatml_tokenizer):
    from transformers import PreTrainedTokenizerFast

    from peagle_train.data.template import MissingChatTemplateError

    bare = PreTrainedTokenizerFast(tokenizer_object=chatml_tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    f = tmp_path / "sg.json"
    write_array(f, [conv(("human", "hello"), ("gpt", "I am fine."))])
    with pytest.raises(MissingChatTemplateError, match="data.chat_template"):
        prep(f, bare)
    t = tmp_path / "tok.jsonl"
    write_jsonl(t, [{"id": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}])
    assert prep(t, bare).rows["input_ids"] == [[5, 6, 7]]  # pre-tokenised rows need no template
