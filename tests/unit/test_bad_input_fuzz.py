"""Fuzz test of the data reader: hundreds of generated malformed records mixed with good ones.

Every good record is kept; every bad one is counted under a reason (malformed at reading, dropped at
normalisation or tokenisation); nothing raises; kept + dropped + malformed = the records in the file.
The directory test adds the ways data is silently lost or added: JSON arrays concatenated in one
file, records holding a lone surrogate escape, a UTF-16 file without a byte-order mark, hidden copies
(.ipynb_checkpoints/, swap files), symlinked files and folders, and exact duplicate conversations.
"""

import json
import random

import pytest

from peagle_train.data.conversations import normalize_record
from peagle_train.data.prepare import prepare_data

ANSWER = "I am fine, thank you. The answer is 4."
WRONG = [None, 0, 1.5, True, "text", [], [1, 2], {}, {"a": 1}]  # a value of every JSON type


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_DATA_CACHE", str(tmp_path / "cache"))


def good_record(rng: random.Random, i: int) -> dict:
    """A trainable record in one of the supported shapes, with unusual but valid text."""
    q = rng.choice(["hello there", "What is two plus two?", "tab\there, bell\x07, nul\x00, \x1c and \u2028 inside",
                    "emoji 🎉 and RTL \u202e text", "x" * rng.choice([1, 40])])  # long text: in answers
    a = rng.choice([ANSWER, ANSWER + " \x1b[31mred\x1b[0m", "y " * 20000, "Ünïcödé answer, quite long enough."])
    kind = rng.randrange(5)
    rid = f"good{i}"
    if kind == 0:
        return {"id": rid, "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    if kind == 1:
        return {"id": rid, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
                                        {"role": "assistant", "content": [{"type": "text", "text": a}]}]}
    if kind == 2:
        return {"id": rid, "data": [q, a, "and then?", a]}
    if kind == 3:  # extra unknown fields at every level are ignored
        return {"id": rid, "extra": {"deep": [[[1]]]}, "conversations": [
            {"from": "human", "value": q, "weight": 0}, {"from": "gpt", "value": a, "meta": None}]}
    return {"id": rid, "input_ids": [rng.randrange(1, 300) for _ in range(12)], "loss_mask": [0] * 4 + [1] * 8}


def bad_record(rng: random.Random, i: int):
    """A record that cannot be trained on: wrong types at every level, missing keys, nulls, roles the
    rules drop, deep nesting. Returns a JSON value (possibly not an object)."""
    rid = f"bad{i}"
    user = {"from": "human", "value": "hello there"}
    gpt = {"from": "gpt", "value": ANSWER}
    w = rng.choice(WRONG)
    cases = [
        lambda: rng.choice([[], [1, 2], 3, "a string", None, True]),                         # not an object
        lambda: {"id": rid},                                                                  # no known key
        lambda: {"id": rid, "dialog": [user, gpt]},
        lambda: {"id": rid, "conversations": rng.choice([None, 0, "text", {"from": "human"}, True])},
        lambda: {"id": rid, "messages": rng.choice([None, 1.5, "text", {}])},
        lambda: {"id": rid, "conversations": [rng.choice([None, 1, "turn", [user], True]), gpt]},  # turn type
        lambda: {"id": rid, "conversations": [{"from": rng.choice([None, 3, [], {}, 1.5]), "value": "q"}, gpt]},
        lambda: {"id": rid, "conversations": [{"value": "q"}, gpt]},                          # role missing
        lambda: {"id": rid, "conversations": [user, {"from": rng.choice(["robot", "", "🤖", "z" * 5000]),
                                                     "value": ANSWER}]},                      # unknown role
        lambda: {"id": rid, "conversations": [{"from": "human", "value": w if w != "text" else None}, gpt]},
        lambda: {"id": rid, "messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]},
                                         {"role": "assistant", "content": ANSWER}]},          # no text parts
        lambda: {"id": rid, "conversations": [{"from": "human", "value": rng.choice(["", "  \n\t"])}, gpt]},
        lambda: {"id": rid, "conversations": [user] * rng.randint(1, 4)},                   # never answered
        lambda: {"id": rid, "conversations": [gpt] * rng.randint(1, 3)},                    # only the assistant
        lambda: {"id": rid, "conversations": [{"from": "system", "value": "s"}]},
        lambda: {"id": rid, "messages": [{"role": "tool", "content": "4"}, {"role": "assistant", "content": ANSWER}]},
        lambda: {"id": rid, "messages": [{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": ANSWER, "tool_calls": [{"id": 1}]}]},
        lambda: {"id": rid, "data": [rng.choice(WRONG[:4]), ANSWER]},                       # UltraChat, wrong type
        lambda: {"id": rid, "input_ids": rng.choice([None, "1 2", [1, -2], [1.5], [10 ** 40], []]),
                 "loss_mask": [0, 1]},
        lambda: {"id": rid, "input_ids": [1, 2, 3], "loss_mask": rng.choice([[0, 1], [0, 2, 1], None, [0.5] * 3])},
        lambda: {"id": rid, "conversations": [user, {"from": "gpt", "value": "quoting <|im_end|> here"}]},
        lambda: {"id": w, "conversations": {"nested": [[[[{"from": "gpt"}]]]]}},               # odd id, nested
    ]
    return rng.choice(cases)()


def bad_line(rng: random.Random, i: int) -> bytes:
    """A line that is not a JSON record at all."""
    good = json.dumps(good_record(rng, i))
    kind = rng.randrange(5)
    if kind == 0:
        return good[: rng.randrange(1, len(good) - 1)].encode()                 # cut mid-record
    if kind == 1:
        return good.encode().replace(b"hello", b"h\xffllo").replace(b'"I am', b'"\xc3(') + b"\xfe"  # not UTF-8
    if kind == 2:
        return ("{" * rng.randint(1, 5) + "garbage" + "]" * rng.randint(0, 3)).encode()
    if kind == 3:
        return ('{"conversations": ' + "[" * 20000 + "]" * 20000 + "}").encode()   # nested too deeply
    return bytes(rng.randrange(1, 256) for _ in range(40)).replace(b"\n", b" ").replace(b"\r", b" ")


def test_fuzzed_file_keeps_every_good_record_and_counts_every_bad_one(tmp_path, chatml_tokenizer):
    rng = random.Random(20)
    lines, good_ids, n_bad = [], set(), 0
    for i in range(480):
        r = rng.random()
        if r < 0.25:
            rec = good_record(rng, i)
            good_ids.add(rec["id"])
            lines.append(json.dumps(rec, ensure_ascii=rng.random() < 0.5).encode())  # raw U+2028 etc. half the time
        elif r < 0.75:
            lines.append(json.dumps(bad_record(rng, i)).encode())
            n_bad += 1
        else:
            lines.append(bad_line(rng, i))
            n_bad += 1
    f = tmp_path / "fuzz.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    d = prepare_data(f, chatml_tokenizer, 400, num_conversations=None, max_length=128, min_supervised_tokens=1,
                     draft_vocab_size=20)
    s = d.summary
    kept = set(d.rows["source"])
    assert kept == good_ids                                  # every good record kept, no bad one
    assert s["records_in_file"] == len(lines) == 480
    dropped, malformed = sum(s["dropped"].values()), s["malformed_records_skipped"]
    assert s["conversations_kept"] + dropped + malformed == len(lines)   # each record counted once
    assert dropped + malformed == n_bad and sum(s["malformed_by_reason"].values()) == malformed
    assert all(r and c > 0 for r, c in {**s["dropped"], **s["malformed_by_reason"]}.items())
    print(f"\nfuzz: {len(lines)} records: {len(kept)} good kept, {n_bad} bad = {malformed} malformed "
          f"{s['malformed_by_reason']} + {dropped} dropped {s['dropped']}")


def test_fuzzed_json_array_gives_the_same_counts(tmp_path, chatml_tokenizer):
    rng = random.Random(7)
    recs, good_ids = [], set()
    for i in range(300):
        if rng.random() < 0.3:
            recs.append(good_record(rng, i))
            good_ids.add(recs[-1]["id"])
        else:
            recs.append(bad_record(rng, i))
    f = tmp_path / "fuzz.json"
    f.write_text(json.dumps(recs, indent=2))
    d = prepare_data(f, chatml_tokenizer, 400, num_conversations=None, max_length=128, min_supervised_tokens=1,
                     draft_vocab_size=20)
    s = d.summary
    assert set(d.rows["source"]) == good_ids
    assert s["conversations_kept"] + sum(s["dropped"].values()) + s["malformed_records_skipped"] == 300
    print(f"\nfuzz (JSON array): 300 records: {len(good_ids)} good kept, {s['malformed_records_skipped']} malformed "
          f"{s['malformed_by_reason']} + {sum(s['dropped'].values())} dropped {s['dropped']}")


def half_emoji_record(rng: random.Random, i: int) -> str:
    """A record (JSON text) holding a lone surrogate escape somewhere: half of an emoji."""
    text = rng.choice(["cut emoji \\ud83d", "\\udc00 low half first", "pair \\ud83d\\ude00 then half \\ud83c"])
    where = rng.randrange(3)
    turns = [{"from": "human", "value": "@Q@" if where == 0 else "hello there"},
             {"from": "gpt", "value": "@Q@" if where == 1 else ANSWER}]
    rec = {"id": f"half{i}", "conversations": turns, **({"meta": "@Q@"} if where == 2 else {})}
    return json.dumps(rec).replace("@Q@", text)


def content_key(rec: dict):
    """What makes two good records the same training row: their normalised messages (or tokens)."""
    if "input_ids" in rec:
        return ("tokens", tuple(rec["input_ids"]), tuple(rec["loss_mask"]))
    return json.dumps(normalize_record(rec)[0], sort_keys=True)


def test_fuzzed_directory_counts_concatenation_encodings_hidden_links_and_duplicates(tmp_path, chatml_tokenizer):
    rng = random.Random(36)
    root, outside = tmp_path / "data", tmp_path / "outside"
    (root / ".ipynb_checkpoints").mkdir(parents=True)
    outside.mkdir()
    good, n_half, n_records = {}, 0, 0  # good: "file:id" -> content key

    def records(name: str, n: int, halves: bool) -> list[str]:
        nonlocal n_half, n_records
        out = []
        for i in range(n):
            r, rid = rng.random(), f"{name}{i}"
            if r < 0.4:
                rec = good_record(rng, i)
                while "y y y y" in json.dumps(rec):  # no row cut at max_length: equal content = equal rows
                    rec = good_record(rng, i)
                if good and rng.random() < 0.3:  # an exact duplicate of an earlier good record, under another id
                    src = rng.choice(sorted(good))
                    rec = json.loads(good[src][1])
                rec["id"] = rid
                good[f"{name}.json{'l' if name != 'a' else ''}:{rid}"] = (content_key(rec), json.dumps(rec))
                out.append(json.dumps(rec))
            elif r < 0.55 and halves:
                out.append(half_emoji_record(rng, i).replace(f'"half{i}"', f'"{rid}"'))
                n_half += 1
            else:
                out.append(json.dumps(bad_record(rng, i)))
        n_records += n
        return out

    a = records("a", 60, True)
    a1, a2 = a[:40], a[40:]
    array = lambda recs: "[\n" + ",\n".join(recs) + "\n]\n"  # noqa: E731
    (root / "a.json").write_text(array(a1) + array(a2))                              # cat a.json b.json
    (root / "b.jsonl").write_bytes("\n".join(records("b", 60, False)).encode("utf-16-le"))  # UTF-16, no BOM
    (outside / "c.jsonl").write_text("\n".join(records("c", 60, True)) + "\n")
    (root / "c.jsonl").symlink_to(outside / "c.jsonl")                                  # a symlinked file
    (root / "again").symlink_to(root, target_is_directory=True)                         # a loop: read once
    (root / ".ipynb_checkpoints" / "a-checkpoint.json").write_text((root / "a.json").read_text())  # hidden copies
    (root / ".a.json.swp").write_bytes(b"b0VIM\x00" + (root / "a.json").read_bytes())
    d = prepare_data(root, chatml_tokenizer, 400, num_conversations=None, max_length=512, min_supervised_tokens=1,
                     draft_vocab_size=20)
    s = d.summary
    assert "cut at max_length" not in s["changed"]
    assert set(d.rows["source"]) == set(good)                # every good record kept once, no copy, no bad one
    assert s["records_in_file"] == n_records == 180          # the hidden copies are not read
    dropped, malformed = sum(s["dropped"].values()), s["malformed_records_skipped"]
    assert s["conversations_kept"] + dropped + malformed == n_records
    assert s["malformed_by_reason"].get("lone surrogate escape", 0) == n_half > 0
    keys = [k for k, _ in good.values()]
    assert s["duplicate_conversations"] == len(keys) - len(set(keys)) > 0
    print(f"\nfuzz (directory): {n_records} records: {len(good)} good kept ({s['duplicate_conversations']} duplicates), "
          f"{malformed} malformed {s['malformed_by_reason']} + {dropped} dropped {s['dropped']}")


def test_fuzzed_json_array_followed_by_json_lines_counts_every_record(tmp_path, chatml_tokenizer):
    """`cat a.json b.jsonl`: a JSON array of good and bad records, then JSON Lines of good records, bad
    records and lines that are no JSON record at all. Every record of both parts is counted once."""
    rng = random.Random(44)
    good_ids, n_bad, array, lines = set(), 0, [], []
    for i in range(160):
        if rng.random() < 0.35:
            array.append(good_record(rng, i))
            good_ids.add(array[-1]["id"])
        else:
            array.append(bad_record(rng, i))
            n_bad += 1
    for i in range(160, 320):
        r = rng.random()
        if r < 0.35:
            rec = good_record(rng, i)
            good_ids.add(rec["id"])
            lines.append(json.dumps(rec).encode())
        elif r < 0.7:
            lines.append(json.dumps(bad_record(rng, i)).encode())
            n_bad += 1
        else:
            line = bad_line(rng, i)
            lines.append(line if line.strip() else b"x")
            n_bad += 1
    if lines[0][:1] != b"{":  # the tail starts as a JSON Lines file of records does
        good = good_record(rng, 999)
        good_ids.add(good["id"])
        lines.insert(0, json.dumps(good).encode())
    f = tmp_path / "array-then-lines.json"
    f.write_bytes(json.dumps(array, indent=rng.choice([None, 2])).encode() + b"\n" + b"\n".join(lines) + b"\n")
    d = prepare_data(f, chatml_tokenizer, 400, num_conversations=None, max_length=128, min_supervised_tokens=1,
                     draft_vocab_size=20)
    s = d.summary
    assert set(d.rows["source"]) == good_ids                 # the good records of both parts, no bad one
    assert s["records_in_file"] == len(array) + len(lines)
    dropped, malformed = sum(s["dropped"].values()), s["malformed_records_skipped"]
    assert s["conversations_kept"] + dropped + malformed == len(array) + len(lines)
    assert dropped + malformed == n_bad and sum(s["malformed_by_reason"].values()) == malformed
    assert "data after the JSON array" not in s["malformed_by_reason"]
    print(f"\nfuzz (array then JSON Lines): {len(array)} + {len(lines)} records: {len(good_ids)} good kept, "
          f"{malformed} malformed {s['malformed_by_reason']} + {dropped} dropped {s['dropped']}")
