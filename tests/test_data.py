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
                     min_supervised_tokens=5, draft_vocab_size=20, log=lambda *_: None)
    s = d.summary
    assert s["conversations_read"] == 4 and s["conversations_kept"] == 1
    assert s["dropped"] == {"unknown role 'robot'": 1, "no assistant turn": 1, "fewer than 5 supervised tokens": 1}
    assert d.rows["source"] == ["ok"]
    assert d.mask_token_id not in set(d.rows["input_ids"][0])
