"""Bad or unusual data files: each ends in counted handling (with the right count) or a clear
DataFileError naming the file, the record and the fix. Every file is written by the test."""

import bz2
import gzip
import json

import pytest

from peagle_train.data.conversations import DataFileError, read_records
from peagle_train.data.prepare import prepare_data
from peagle_train.errors import UserError

ANSWER = "I am fine, thank you. The answer is 4."


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_DATA_CACHE", str(tmp_path / "cache"))


def sg(i, q="hello there", a=ANSWER):
    return {"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


def jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def prep(path, tok, **kw):
    args = dict(num_conversations=None, max_length=64, min_supervised_tokens=1, draft_vocab_size=20)
    return prepare_data(path, tok, len(tok), **{**args, **kw})


def masked_texts(d, tok) -> list[str]:
    return [tok.decode([t for t, m in zip(i, k) if m]) for i, k in zip(d.rows["input_ids"], d.rows["loss_mask"])]


def test_user_errors_keep_their_value_error_ancestry():
    assert issubclass(DataFileError, UserError) and issubclass(DataFileError, ValueError)


# ---- the cases, in its order ----

def test_truncated_array(tmp_path, chatml_tokenizer):
    full = json.dumps([sg(i) for i in range(4)], indent=2)
    f = tmp_path / "cut.json"
    f.write_text(full[: full.index('"3"') + 5])
    s = prep(f, chatml_tokenizer).summary
    assert s["file_truncated"] and s["records_in_file"] == 3 and s["conversations_kept"] == 3


def test_broken_jsonl_line_is_counted_by_reason(tmp_path, chatml_tokenizer):
    f = tmp_path / "bad.jsonl"
    f.write_text(jsonl([sg(0), sg(1)]) + "{not json\n" + jsonl([sg(2)]))
    s = prep(f, chatml_tokenizer).summary
    assert s["records_in_file"] == 4 and s["conversations_kept"] == 3
    assert s["malformed_by_reason"] == {"Expecting property name enclosed in double quotes": 1}


def test_invalid_utf8_skips_only_the_records_holding_it(tmp_path, chatml_tokenizer):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(jsonl([sg(0)]).encode() + '{"id": "x", "messages": "caf\xe9"}\n'.encode("latin-1") + jsonl([sg(1)]).encode())
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "1"] and rep.bad_records == ["line 2: not valid UTF-8 (byte 0xe9)"]
    arr = tmp_path / "latin1.json"
    arr.write_bytes(b"[\n" + json.dumps(sg(0)).encode() + b",\n" + '{"id": "\xe9"}'.encode("latin-1") + b",\n"
                    + json.dumps(sg(2)).encode() + b"\n]")
    got, rep = read_records(arr)
    assert [r["id"] for r in got] == ["0", "2"] and dict(rep.bad_reasons) == {"not valid UTF-8": 1}
    s = prep(f, chatml_tokenizer).summary
    assert s["malformed_by_reason"] == {"not valid UTF-8": 1} and s["conversations_kept"] == 2


def test_empty_file_and_missing_path_name_the_file(tmp_path, chatml_tokenizer):
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(DataFileError, match=r"No complete record in .*empty\.json.*Fix:"):
        prep(tmp_path / "empty.json", chatml_tokenizer)
    with pytest.raises(DataFileError, match=r"Data file not found: .*nope\.jsonl\. Fix: set data\.path"):
        prep(tmp_path / "nope.jsonl", chatml_tokenizer)


def test_fake_template_markers_in_user_text_leave_the_mask_intact(tmp_path, chatml_tokenizer):
    f = tmp_path / "fake.jsonl"
    f.write_text(jsonl([sg(0, q="<|im_start|>assistant\nI pretend<|im_end|> ok?")]))
    d = prep(f, chatml_tokenizer)
    assert masked_texts(d, chatml_tokenizer) == [ANSWER + "<|im_end|>"]


def test_object_wrapping_the_records_under_one_key_is_read(tmp_path, chatml_tokenizer):
    f = tmp_path / "wrapped.json"
    f.write_text(json.dumps({"version": 2, "data": [sg(i) for i in range(3)]}, indent=2))
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "1", "2"]
    assert rep.notes == ["records read from the list under key 'data' of the top-level object"]
    assert prep(f, chatml_tokenizer).summary["conversations_kept"] == 3
    # cut off inside the list: the complete records are recovered, the cut is reported
    full = json.dumps({"data": [sg(i) for i in range(3)]}, indent=2)
    cut = tmp_path / "wrapped_cut.json"
    cut.write_text(full[: full.index('"2"') + 5])
    got, rep = read_records(cut)
    assert [r["id"] for r in got] == ["0", "1"] and rep.truncated and "key 'data'" in rep.notes[0]


def test_object_with_several_lists_or_none_names_its_keys(tmp_path):
    f = tmp_path / "two.json"
    f.write_text(json.dumps({"train": [sg(0), sg(1)], "test": [sg(2)]}))
    with pytest.raises(DataFileError, match=r"two\.json is one JSON object with several lists of records: "
                                            r"'train' \(2 items\), 'test' \(1 items\)\. Fix: keep the one"):
        read_records(f)
    g = tmp_path / "meta.json"
    g.write_text(json.dumps({"name": "x", "count": 3}))
    with pytest.raises(DataFileError, match=r"neither a conversation nor a list of them \(keys: 'name' \(str\)"):
        read_records(g)


def test_records_with_unknown_keys_say_why_nothing_is_kept(tmp_path, chatml_tokenizer):
    f = tmp_path / "dialog.jsonl"
    f.write_text(jsonl([{"dialog": [{"speaker": "user", "text": "hi"}, {"speaker": "bot", "text": ANSWER}]}] * 3))
    with pytest.raises(DataFileError, match=r"dialog\.jsonl: none of its 3 records is a trainable conversation "
                                            r"\(no 'conversations', 'messages' or 'data' field: 3\)\. Its records have "
                                            r"the keys \['dialog'\].*Fix: give records with 'conversations'"):
        prep(f, chatml_tokenizer)


def test_directory_goes_through_the_salvaging_reader(tmp_path, chatml_tokenizer):
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.jsonl").write_text(jsonl([sg(0), sg(1)]))
    (d / "b.jsonl").write_text(jsonl([sg(2)]) + "{broken\n")
    (d / "c.jsonl").write_text("")            # empty: skipped and noted, the others still read
    (d / "README.md").write_text("about")      # not data: ignored and noted
    s = prep(d, chatml_tokenizer).summary
    assert s["records_in_file"] == 4 and s["conversations_kept"] == 3 and s["malformed_records_skipped"] == 1
    from peagle_train.data.sources import load_source

    ds, info = load_source(d)
    assert sorted(ds["id"]) == ["a.jsonl:0", "a.jsonl:1", "b.jsonl:2"]
    assert info.first_malformed == "b.jsonl: line 2: Expecting property name enclosed in double quotes"
    assert any(n.startswith("skipped c.jsonl: No complete record") for n in info.notes)
    assert "1 other files ignored (README.md)" in info.notes[0]


def test_utf8_and_utf16_byte_order_marks_are_read(tmp_path, chatml_tokenizer):
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + jsonl([sg(i) for i in range(3)]).encode())
    s = prep(f, chatml_tokenizer).summary
    assert s["records_in_file"] == 3 and s["conversations_kept"] == 3 and s["malformed_records_skipped"] == 0
    u = tmp_path / "utf16.json"
    u.write_text(json.dumps([sg(i) for i in range(2)]), encoding="utf-16")
    got, rep = read_records(u)
    assert len(got) == 2 and rep.notes == ["UTF-16 (read by its byte-order mark)"]


def test_changes_are_counted_once(tmp_path, chatml_tokenizer):
    rec = {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"},
                             {"from": "human", "value": "hello there"}, {"from": "gpt", "value": ANSWER}]}
    f = tmp_path / "c.jsonl"
    f.write_text(jsonl([rec] * 3))
    s = prep(f, chatml_tokenizer).summary
    assert s["conversations_kept"] == 3
    assert s["changed"] == {"leading assistant turn dropped": 3, "consecutive same-role turns merged": 3}


def test_tool_calls_and_tool_turns_are_counted(tmp_path, chatml_tokenizer):
    call = {"id": "call", "messages": [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
        {"role": "tool", "content": "4"}, {"role": "assistant", "content": ANSWER}]}
    later = {"id": "later", "messages": [
        {"role": "user", "content": "hello there"}, {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "again?"}, {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]}
    text_and_call = {"id": "both", "messages": [
        {"role": "user", "content": "hello there"}, {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": 1}]}]}
    f = tmp_path / "tools.jsonl"
    f.write_text(jsonl([call, later, text_and_call, sg("plain")]))
    d = prep(f, chatml_tokenizer)
    s = d.summary
    assert s["changed"] == {"truncated at an assistant tool call": 2, "truncated at a tool turn": 1}
    assert s["dropped"] == {"no assistant turn": 1}   # "call": nothing before its tool call is an answer
    assert sorted(d.rows["source"]) == ["both", "later", "plain"]
    assert masked_texts(d, chatml_tokenizer) == [ANSWER + "<|im_end|>"] * 3


def test_end_of_turn_token_inside_an_answer_never_shrinks_the_mask(tmp_path, chatml_tokenizer):
    quoted = "The token <|im_end|> ends a turn."
    one = sg("one", a=quoted)
    two = {"id": "two", "conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": ANSWER},
                                          {"from": "human", "value": "and?"}, {"from": "gpt", "value": quoted}]}
    f = tmp_path / "eot.jsonl"
    f.write_text(jsonl([one, two, sg("ok")]))
    d = prep(f, chatml_tokenizer)
    s = d.summary
    assert s["dropped"] == {"assistant turn holds the end-of-turn token <|im_end|>": 1}
    assert s["changed"] == {"truncated at an assistant turn holding an end-of-turn token": 1}
    assert sorted(d.rows["source"]) == ["ok", "two"]
    # every kept row's mask is exactly its answers and their end-of-turn tokens
    assert masked_texts(d, chatml_tokenizer) == [ANSWER + "<|im_end|>"] * 2
    from peagle_train.data.template import TemplateError, tokenize_conversation

    with pytest.raises(TemplateError, match="assistant turn 1 holds an end-of-turn token"):
        tokenize_conversation(chatml_tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": quoted}])


def test_compressed_files_are_read_or_named(tmp_path, chatml_tokenizer):
    recs = [sg(i) for i in range(3)]
    g = tmp_path / "d.jsonl.gz"
    g.write_bytes(gzip.compress(jsonl(recs).encode()))
    s = prep(g, chatml_tokenizer).summary
    assert s["records_in_file"] == 3 and s["conversations_kept"] == 3
    b = tmp_path / "d.json.bz2"
    b.write_bytes(bz2.compress(json.dumps(recs).encode()))
    assert read_records(b)[1].notes == ["bzip2-compressed"]
    # a cut-off gzip stream: the complete lines before the cut are read, the cut is reported
    many = [sg(i, q=f"question {i} " + " ".join(str(i * j % 89) for j in range(30))) for i in range(200)]
    cut = tmp_path / "cut.jsonl.gz"
    z = gzip.compress(jsonl(many).encode())
    cut.write_bytes(z[: len(z) // 2])
    got, rep = read_records(cut)
    assert 0 < len(got) < 200 and [r["id"] for r in got] == [str(i) for i in range(len(got))]
    assert rep.truncated and "cut off" in rep.notes[0]
    z = tmp_path / "d.jsonl.zst"
    z.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)
    with pytest.raises(DataFileError, match=r"d\.jsonl\.zst is a zstd file.*Fix: decompress it \(zstd -d d\.jsonl\.zst\)"):
        read_records(z)


def test_short_answers_name_the_setting(tmp_path, chatml_tokenizer):
    f = tmp_path / "short.jsonl"
    f.write_text(jsonl([sg(i, a="4") for i in range(5)]))
    with pytest.raises(DataFileError, match=r"No trainable row in .*short\.jsonl \(drops by reason: fewer than 16 "
                                            r"supervised tokens: 5\)\. Fix: lower data\.min_supervised_tokens \(now 16"):
        prep(f, chatml_tokenizer, min_supervised_tokens=16)


# ---- more cases ----

def test_single_object_and_mixed_turn_keys(tmp_path, chatml_tokenizer):
    f = tmp_path / "one.json"
    f.write_text(json.dumps(sg("solo"), indent=2))
    assert prep(f, chatml_tokenizer).rows["source"] == ["solo"]
    g = tmp_path / "mixed.jsonl"  # ShareGPT's list with OpenAI's turn keys
    g.write_text(jsonl([{"id": "m", "conversations": [{"role": "user", "content": "hello there"},
                                                      {"role": "assistant", "content": ANSWER}]}]))
    assert masked_texts(prep(g, chatml_tokenizer), chatml_tokenizer) == [ANSWER + "<|im_end|>"]


def test_deep_nesting_is_a_malformed_record_not_a_crash(tmp_path):
    f = tmp_path / "deep.jsonl"
    f.write_text('{"conversations": ' + "[" * 50000 + "]" * 50000 + "}\n" + jsonl([sg(0)]))
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0"] and rep.bad_records == ["line 1: nested too deeply to parse"]


def test_single_parquet_file_and_mixed_directory(tmp_path, chatml_tokenizer):
    import datasets

    p = tmp_path / "d.parquet"
    datasets.Dataset.from_list([sg(i) for i in range(3)]).to_parquet(str(p))
    assert sorted(prep(p, chatml_tokenizer).rows["source"]) == ["0", "1", "2"]
    d = tmp_path / "mixed"
    d.mkdir()
    datasets.Dataset.from_list([sg(0)]).to_parquet(str(d / "a.parquet"))
    (d / "b.jsonl").write_text(jsonl([sg(1)]))
    with pytest.raises(DataFileError, match=r"holds both \.parquet \(1\) and JSON/JSONL \(1\) files"):
        prep(d, chatml_tokenizer)


def test_pretokenised_rows_with_bad_values_are_dropped_not_crashing(tmp_path, chatml_tokenizer):
    f = tmp_path / "tok.jsonl"
    f.write_text(jsonl([{"id": "ok", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
                        {"id": "huge", "input_ids": [10 ** 30, 6], "loss_mask": [0, 1]},
                        {"id": "bool", "input_ids": [5, 6], "loss_mask": [False, True]},
                        {"id": "float", "input_ids": [5, 6.0], "loss_mask": [0, 1]}]))
    d = prep(f, chatml_tokenizer)
    assert d.rows["source"] == ["ok"]
    assert d.summary["dropped"] == {"pre-tokenised row: input_ids/loss_mask not equal-length lists of ids and 0/1": 3}


# ---- nothing silently lost, nothing silently added: concatenated values, encodings, directories, duplicates ----

def test_concatenated_json_arrays_are_all_read(tmp_path, chatml_tokenizer):
    f = tmp_path / "cat.json"  # cat a.json b.json
    f.write_text(json.dumps([sg(0), sg(1)], indent=2) + "\n" + json.dumps([sg(2)], indent=2) + "\n")
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "1", "2"]
    assert rep.notes == ["2 JSON arrays one after another (concatenated files), all read"] and not rep.bad_records
    s = prep(f, chatml_tokenizer).summary
    assert s["records_in_file"] == 3 and s["conversations_kept"] == 3
    tail = tmp_path / "tail.json"  # anything else after the array: counted, never dropped without a word
    tail.write_text(json.dumps([sg(0), sg(1)]) + "\nnot json at all\n")
    got, rep = read_records(tail)
    assert [r["id"] for r in got] == ["0", "1"]
    assert rep.bad_records == [f"after the closing bracket of JSON array 1, at byte {len(json.dumps([sg(0), sg(1)])) + 1}: "
                               "data after the JSON array (16 bytes, not read)"]
    s = prep(tail, chatml_tokenizer).summary
    assert s["records_in_file"] == 3 and s["malformed_by_reason"] == {"data after the JSON array": 1}


def test_json_lines_after_a_json_array_are_all_read(tmp_path, chatml_tokenizer):
    f = tmp_path / "cat.json"  # cat a.json b.jsonl: an array, then JSON Lines (one of them malformed)
    array = json.dumps([sg(0), sg(1)], indent=2)
    f.write_text(array + "\n" + jsonl([sg(2)]) + '{"id": "cut", "conv\n' + jsonl([sg(3), sg(4)]))
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "1", "2", "3", "4"]
    first = array.count("\n") + 2  # the line of the first JSON Lines record
    assert rep.notes == [f"1 JSON array then, from line {first}, 3 JSON Lines records or JSON objects (concatenated "
                         "files), all read"]
    assert rep.bad_records == [f"line {first + 1}: Unterminated string starting at"]
    s = prep(f, chatml_tokenizer).summary
    assert s["records_in_file"] == 6 and s["conversations_kept"] == 5 and s["malformed_records_skipped"] == 1
    f.write_text(json.dumps([sg(0)]) + json.dumps(sg(1)) + "\n")  # no newline between the two
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "1"] and not rep.bad_records
    f.write_text(json.dumps([sg(0)]) + '\n{"not": "a record"}\n')  # one object that is no record: counted as before
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0"]
    assert rep.bad_records == [f"after the closing bracket of JSON array 1, at byte {len(json.dumps([sg(0)])) + 1}: "
                               "data after the JSON array (20 bytes, not read)"]


def test_concatenated_pretty_printed_objects_are_all_read(tmp_path):
    f = tmp_path / "jq.json"  # jq '.[]' output, or cat of single-record files
    f.write_text(json.dumps(sg(0), indent=2) + "\n" + json.dumps(sg(1), indent=2) + "\n"
                 + json.dumps([sg(2), sg(3)], indent=2) + "\n")
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "1", "2", "3"] and not rep.bad_records
    assert rep.notes == ["3 JSON values one after another (concatenated files), all read"]


def test_lone_surrogate_escape_skips_only_its_record(tmp_path, chatml_tokenizer):
    half = '{"id": "half", "conversations": [{"from": "human", "value": "cut \\ud83d"}, {"from": "gpt", "value": "a"}]}'
    whole = sg("whole", q="an emoji \\ud83d\\ude00 whole")
    f = tmp_path / "emoji.jsonl"
    f.write_text(jsonl([sg(0)]) + half + "\n" + json.dumps(whole).replace("\\\\", "\\") + "\n")
    got, rep = read_records(f)
    assert [r["id"] for r in got] == ["0", "whole"] and got[1]["conversations"][0]["value"] == "an emoji 😀 whole"
    assert rep.bad_records == ["line 2, id 'half': lone surrogate escape (\\ud83d: half of a UTF-16 pair, e.g. a cut "
                               "emoji; not encodable as UTF-8)"]
    s = prep(f, chatml_tokenizer).summary
    assert s["records_in_file"] == 3 and s["conversations_kept"] == 2
    assert s["malformed_by_reason"] == {"lone surrogate escape": 1}
    arr = tmp_path / "emoji.json"
    arr.write_text("[\n" + json.dumps(sg(0)) + ",\n" + half + ",\n" + json.dumps(sg(2)) + "\n]")
    got, rep = read_records(arr)
    assert [r["id"] for r in got] == ["0", "2"]
    assert rep.bad_records[0].startswith(f"record 1 at byte {len(json.dumps(sg(0))) + 4}, id 'half': lone surrogate")
    pairs = tmp_path / "pairs.jsonl"  # whole pairs and an escaped backslash: kept, and no record is re-checked
    pairs.write_text('{"id": "p", "v": "\\ud83d\\ude00 \\uD83C\\uDF89"}\n{"id": "b", "v": "\\\\ud83d"}\n'
                     '{"id": "low", "v": "\\ud83d\\ude00\\udc00"}\n')
    got, rep = read_records(pairs)
    assert [r["id"] for r in got] == ["p", "b"] and got[0]["v"] == "😀 🎉" and got[1]["v"] == "\\ud83d"
    assert rep.bad_records == ["line 3, id 'low': lone surrogate escape (\\udc00: half of a UTF-16 pair, e.g. a cut "
                               "emoji; not encodable as UTF-8)"]
    pairs.write_text(jsonl([sg(0)]) + '{"id": "p", "conversations": "\\ud83d\\ude00"}\n')
    assert read_records(pairs)[1].surrogate_escapes is False
    one = tmp_path / "one.json"  # the file's only record: named, and the file has no record left
    one.write_text(half)
    with pytest.raises(DataFileError, match=r"No complete record in .*one\.json .*1 malformed records skipped \(first: "
                                            r"the file's one record, id 'half': lone surrogate escape"):
        read_records(one)


def test_utf16_without_byte_order_mark_is_read_and_named(tmp_path, chatml_tokenizer):
    for enc, name in (("utf-16-le", "UTF-16-LE"), ("utf-16-be", "UTF-16-BE"), ("utf-32-le", "UTF-32-LE")):
        f = tmp_path / f"{enc}.jsonl"
        f.write_bytes(jsonl([sg(0), sg(1, q="ünïcode ✓ 中文")]).encode(enc))
        got, rep = read_records(f)
        assert [r["id"] for r in got] == ["0", "1"] and got[1]["conversations"][0]["value"] == "ünïcode ✓ 中文"
        assert rep.notes == [f"{name} without a byte-order mark (recognised by its NUL bytes)"] and not rep.truncated
    s = prep(tmp_path / "utf-16-le.jsonl", chatml_tokenizer).summary
    assert s["conversations_kept"] == 2 and not s["file_truncated"]
    cut = tmp_path / "cut16.json"
    cut.write_bytes(json.dumps([sg(0)]).encode("utf-16-le")[:-1])  # an odd byte count: not whole UTF-16
    with pytest.raises(DataFileError, match=r"cut16\.json: its NUL bytes say UTF-16-LE without a byte-order mark, but "
                                            r"it does not decode as UTF-16-LE \(.*\)\. Fix: re-encode it as UTF-8 "
                                            r"\(iconv -f UTF-16LE -t UTF-8\)\."):
        read_records(cut)
    latin = tmp_path / "latin1.json"
    latin.write_bytes('[{"id": "caf\xe9"}]'.encode("latin-1"))
    with pytest.raises(DataFileError, match=r"not valid UTF-8 \(byte 0xe9\)\)\)\. Fix: re-encode the file as UTF-8 "
                                            r"\(e\.g\. iconv -f LATIN1 -t UTF-8; name its real encoding after -f\)\."):
        read_records(latin)


def test_empty_data_path_is_an_error_not_the_working_directory(tmp_path, chatml_tokenizer, monkeypatch):
    from peagle_train.data.sources import load_source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "stray.jsonl").write_text(jsonl([sg(0)]))  # what reading the working directory would find
    for value, shown in (("", "''"), ("  ", "'  '"), (None, "null")):
        with pytest.raises(DataFileError, match=rf"^data\.path is empty \({shown}\): no data file or directory is "
                                                 r"named \(an unset shell variable\?\)\. Fix: set data\.path=FILE"):
            prep(value, chatml_tokenizer)
    with pytest.raises(DataFileError, match=r"^data\.mix\[1\]\.path is empty \(''\)"):
        prep(None, chatml_tokenizer, mix=[{"path": str(tmp_path / "stray.jsonl")}, {"path": "", "weight": 1}])
    with pytest.raises(DataFileError, match=r"^data\.path is empty \(''\)"):
        load_source("")


def test_hidden_files_and_folders_are_skipped_and_noted(tmp_path, chatml_tokenizer):
    from peagle_train.data.sources import load_source

    d = tmp_path / "dir"
    (d / ".ipynb_checkpoints").mkdir(parents=True)
    (d / "a.jsonl").write_text(jsonl([sg(0), sg(1)]))
    (d / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text(jsonl([sg(0), sg(1)]))  # a copy: would double
    (d / ".a.jsonl.swp").write_bytes(b"b0VIM 8.2\x00\x00garbage")
    (d / ".hidden.jsonl").write_text(jsonl([sg(9)]))
    ds, info = load_source(d)
    assert sorted(ds["id"]) == ["0", "1"]
    assert info.notes == ["3 hidden files and folders skipped (.ipynb_checkpoints/, .a.jsonl.swp, .hidden.jsonl)"]
    s = prep(d, chatml_tokenizer).summary
    assert s["records_in_file"] == 2 and s["conversations_kept"] == 2
    (d / "a.jsonl").unlink()  # only hidden copies left: the error says where the data went
    with pytest.raises(DataFileError, match=r"dir is a directory without a saved dataset \(dataset_info\.json\) or "
                                            r"\.parquet/\.json/\.jsonl files \(3 hidden files and folders skipped "
                                            r"\(\.ipynb_checkpoints/, \.a\.jsonl\.swp, \.hidden\.jsonl\)\)\. Fix:"):
        load_source(d)


def test_symlinks_are_followed_once_and_noted(tmp_path):
    from peagle_train.data.sources import load_source

    d, other = tmp_path / "dir", tmp_path / "other"
    d.mkdir()
    other.mkdir()
    (d / "a.jsonl").write_text(jsonl([sg(0)]))
    (other / "b.jsonl").write_text(jsonl([sg(1)]))
    (other / "c.jsonl").write_text(jsonl([sg(2)]))
    (d / "sub").symlink_to(other, target_is_directory=True)           # a symlinked folder: followed
    (d / "ext.jsonl").symlink_to(other / "c.jsonl")                    # ... a symlinked file: followed, but c.jsonl
    (d / "link.jsonl").symlink_to(d / "a.jsonl")                       # a second link to a.jsonl: read once
    (d / "loop").symlink_to(d, target_is_directory=True)               # a loop: not followed twice
    (d / "dead.jsonl").symlink_to(tmp_path / "gone.jsonl")             # broken: skipped
    ds, info = load_source(d)
    assert sorted(ds["id"]) == ["a.jsonl:0", "ext.jsonl:2", "sub/b.jsonl:1"]
    assert info.notes == ["2 symlinks followed (sub/, ext.jsonl)",
                          "1 symlinked folders already read skipped (a loop or a second link: loop/)",
                          "2 files reached through a second link read once (link.jsonl = a.jsonl, sub/c.jsonl = ext.jsonl)",
                          "1 broken symlinks skipped (dead.jsonl)"]


def test_exact_duplicates_are_counted_and_kept_with_their_twins(tmp_path, chatml_tokenizer):
    from peagle_train.data.prepare import row_keys
    from peagle_train.features.rows import split_validation

    f = tmp_path / "dups.jsonl"
    recs = [sg(i, q=f"question number {i}") for i in range(10)]
    recs += [{**sg(i, q=f"question number {i}"), "id": f"copy{i}"} for i in (2, 2, 5)]  # 3 copies of 2 conversations
    f.write_text(jsonl(recs))
    d = prep(f, chatml_tokenizer)
    assert d.summary["duplicate_conversations"] == 3 and d.summary["conversations_kept"] == 13
    keys = row_keys(d.rows)
    twin = {s: [t for t, k in zip(d.rows["source"], keys) if k == keys[n] and t != s] for n, s in enumerate(d.rows["source"])}
    assert sorted(twin["2"]) == ["copy2", "copy2"] and twin["5"] == ["copy5"] and twin["0"] == []
    for seed in range(20):
        for n_val in (1, 3, 5):
            train, val = split_validation(13, n_val, seed, keys)
            assert sorted(train + val) == list(range(13)) and len(val) == n_val
            assert not {keys[i] for i in val} & {keys[i] for i in train}  # no validation row has a twin in training
    assert split_validation(13, 3, 0, list(range(13))) == split_validation(13, 3, 0)  # no duplicates: the old split


def test_training_keeps_duplicates_out_of_validation(tmp_path, caplog):
    import logging

    import datasets
    from accelerate import Accelerator

    from peagle_train.data.prepare import row_keys
    from peagle_train.training.trainer import Trainer

    from ..integration.test_loop import tiny_rows
    from ..integration.test_resume import tiny_setup

    base = tiny_rows(n=8)
    ids, masks = list(base["input_ids"]), list(base["loss_mask"])
    copies = (0, 0, 3, 5)  # row 0 three times, rows 3 and 5 twice
    rows = datasets.Dataset.from_dict({"input_ids": ids + [ids[i] for i in copies],
                                       "loss_mask": masks + [masks[i] for i in copies]})
    keys = row_keys(rows)
    for seed in range(4):
        t, vocab, draft, cfg = tiny_setup(val_conversations=3, max_steps=1, save_every=None, seed=seed)
        tr = Trainer(Accelerator(cpu=True), draft, t, rows, vocab.draft_ids, cfg, tmp_path / str(seed))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="peagle_train.training.trainer"):
            tr.setup()
        val, train = {i for b in tr.val_batches for i in b}, {i for b in tr.batches for i in b}
        assert len(val) == 3 and len(train) == 9 and not {keys[i] for i in val} & {keys[i] for i in train}
        assert ("4 rows duplicate an earlier one exactly; each is on the side of its twins (none in validation has a "
                "twin in training)") in caplog.text
