"""data.sources: datasets named by hub id, read with `datasets` and mixed into one conversation set
(the regenerate stage's input). Offline: local stand-ins in the hub's layout (data/<split>-00000-of-00001.jsonl),
a few records in each format (ShareGPT `conversations`, OpenAI `messages`, Magpie's instruction/response)."""

import json
import logging

import pytest

from peagle_train.config import sources_problems
from peagle_train.data.conversations import DataFileError
from peagle_train.data.sources import mix_sources


def _hub_dir(root, name, split, records):
    """A local dataset directory laid out as on the hub: data/<split>-00000-of-00001.jsonl."""
    d = root / name
    (d / "data").mkdir(parents=True)
    with open(d / "data" / f"{split}-00000-of-00001.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(d)


def _sharegpt(i):
    return {"id": f"s{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": f"answer {i}"}]}


def _openai(i):
    return {"prompt_id": f"u{i}", "messages": [{"role": "user", "content": f"hello {i}"},
                                               {"role": "assistant", "content": f"hi {i}"},
                                               {"role": "user", "content": f"more {i}"},
                                               {"role": "assistant", "content": f"sure {i}"}]}


def _magpie(i):
    return {"uuid": f"m{i}", "instruction": f"task {i}", "response": f"done {i}", "task_category": "x"}


@pytest.fixture
def stand_ins(tmp_path):
    bad_sharegpt = {"id": "s-bad", "conversations": [{"from": "human", "value": "only a question"}]}
    sharegpt = _hub_dir(tmp_path, "ShareGPT_stand_in", "train", [_sharegpt(i) for i in range(5)] + [bad_sharegpt])
    ultrachat = _hub_dir(tmp_path, "ultrachat_stand_in", "train_sft", [_openai(i) for i in range(6)])
    magpie = _hub_dir(tmp_path, "magpie_stand_in", "train", [_magpie(i) for i in range(4)])
    return sharegpt, ultrachat, magpie


def test_sources_are_mapped_mixed_and_counted(stand_ins, tmp_path, caplog):
    sharegpt, ultrachat, magpie = stand_ins
    entries = [{"hub": sharegpt, "split": "train"},                                      # auto: conversations
               {"hub": ultrachat, "split": "train_sft", "count": 4, "format": "openai"},  # 4 of 6
               {"hub": magpie, "format": "instruction"}]                                  # split defaults to train
    assert sources_problems(entries) == []
    with caplog.at_level(logging.INFO, logger="peagle_train.data.sources"):
        ds, counts = mix_sources(entries, seed=0, cache_dir=tmp_path / "cache")
    got = [(c.name, c.format, c.records, c.kept, c.taken, c.skipped, c.first_skipped) for c in counts]
    assert got == [("ShareGPT_stand_in/train", "sharegpt", 6, 5, 5, {"no assistant turn": 1}, "ShareGPT_stand_in/train:5"),
                   ("ultrachat_stand_in/train_sft", "openai", 6, 6, 4, {}, ""),
                   ("magpie_stand_in/train", "instruction", 4, 4, 4, {}, "")]
    assert len(ds) == 13 and set(ds["drop"]) == {""}
    by_id = dict(zip(ds["id"], ds["messages"]))
    assert sum(i.startswith("ultrachat_stand_in/train_sft:") for i in by_id) == 4
    assert by_id["ShareGPT_stand_in/train:2"] == [{"role": "user", "content": "question 2"},
                                                  {"role": "assistant", "content": "answer 2"}]
    assert by_id["magpie_stand_in/train:3"] == [{"role": "user", "content": "task 3"},
                                                {"role": "assistant", "content": "done 3"}]
    u = next(m for i, m in by_id.items() if i.startswith("ultrachat"))
    assert [t["role"] for t in u] == ["user", "assistant", "user", "assistant"]
    assert "ShareGPT_stand_in/train (" in caplog.text and "1 skipped (no assistant turn: 1; first: record " \
        "ShareGPT_stand_in/train:5)" in caplog.text and "13 conversations from 3 sources" in caplog.text
    # the same entries and seed give the same set in the same order (a regeneration keyed by id resumes)
    again, _ = mix_sources(entries, seed=0, cache_dir=tmp_path / "cache")
    assert again["id"] == ds["id"]
    other, _ = mix_sources(entries, seed=1, cache_dir=tmp_path / "cache")
    assert sorted(other["id"]) != sorted(ds["id"]) or other["id"] != ds["id"]


def test_a_missing_column_is_one_line_naming_the_source_and_the_fix(stand_ins, tmp_path):
    sharegpt, ultrachat, magpie = stand_ins
    with pytest.raises(DataFileError) as e:
        mix_sources([{"hub": sharegpt}, {"hub": magpie, "format": "sharegpt"}], cache_dir=tmp_path / "c")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"data.sources[1] ({magpie}): format sharegpt reads the column(s) "
                                              "turns: conversations, which it lacks (its columns: ")
    assert msg.endswith("task_category). Fix: name the column(s) in its columns (columns: {turns: NAME}), or set "
                        "format: auto.")
    with pytest.raises(DataFileError, match=r"^data\.sources\[0\] \(.*\): none of the columns conversations, messages, "
                                            r"data or instruction \+ response is there \(its columns: uuid, x\)\. Fix: "):
        mix_sources([{"hub": _hub_dir(tmp_path, "odd", "train", [{"uuid": "1", "x": 2}])}], cache_dir=tmp_path / "c")


def test_a_source_without_any_conversation_names_its_first_record(tmp_path):
    hub = _hub_dir(tmp_path, "broken", "train", [{"conversations": "not turns"}, {"conversations": "nor this"}])
    with pytest.raises(DataFileError) as e:
        mix_sources([{"hub": hub}], cache_dir=tmp_path / "c")
    assert str(e.value) == (f"data.sources[0] ({hub}, format sharegpt): none of its 2 records is a conversation "
                            "(turns are not a list: 2; first: record broken/train:0). Fix: set its format and columns "
                            "to the column holding the turns (sharegpt: from/value, openai: role/content).")


def test_an_unknown_split_or_dataset_is_one_line_with_the_fix(stand_ins, tmp_path):
    sharegpt = stand_ins[0]
    with pytest.raises(DataFileError) as e:
        mix_sources([{"hub": sharegpt, "split": "train_sft"}], cache_dir=tmp_path / "c")
    msg = str(e.value)
    assert msg.startswith(f"data.sources[0] ({sharegpt}, split train_sft): cannot load it (") and "\n" not in msg
    assert msg.endswith("Fix: check the hub id and the split (the dataset card lists its splits), set HF_TOKEN for a "
                        "gated dataset, or unset HF_HUB_OFFLINE to download it.")


def test_malformed_entries_are_refused_by_the_config_check():
    assert sources_problems([]) == [] and sources_problems(None) == []
    problems = sources_problems(["HuggingFaceH4/ultrachat_200k",
                                 {"hub": "a/b", "count": 0},
                                 {"hub": "a/b", "format": "alpaca"},
                                 {"hub": "a/b", "weight": 2},
                                 {"split": "train"},
                                 {"hub": "a/b", "format": "instruction", "columns": {"turns": "x"}}])
    assert [p.split(" ", 1)[0].split("=")[0].split(".")[0] for p in problems] == ["data"] * 6
    assert problems[0].startswith("data.sources[0]=HuggingFaceH4/ultrachat_200k is not an entry {hub: ID, split: S, count: N}.")
    assert problems[1].startswith("data.sources[1].count=0 must be an integer ≥ 1")
    assert problems[2].startswith("data.sources[2].format=alpaca must be auto, sharegpt, openai or instruction.")
    assert problems[3].startswith("data.sources[3] has unknown key(s) weight; an entry holds hub, split, count, format")
    assert problems[4].startswith("data.sources[4]={split: train} has no hub")
    assert problems[5].startswith("data.sources[5].columns={turns: x}: format instruction names the column(s) prompt "
                                  "and response")


def test_the_regenerate_stage_reads_the_sources(stand_ins):
    """`peagle regenerate` reads data.sources (mixed) when a recipe names them, data.path otherwise."""
    from peagle_train.cli.regenerate import conversations
    from peagle_train.config import compose

    sharegpt, ultrachat, magpie = stand_ins
    cfg = compose("regenerate", [f"data.sources=[{{hub: '{sharegpt}'}}, {{hub: '{ultrachat}', split: train_sft, "
                                 f"count: 2}}, {{hub: '{magpie}', format: instruction}}]", "data.num_conversations=null"])
    rows, too_long = conversations(cfg)
    ids = [i for i, _ in rows]
    assert too_long == 0 and len(ids) == 5 + 2 + 4 == len(set(ids))
    assert {i.split(":")[0] for i in ids} == {"ShareGPT_stand_in/train", "ultrachat_stand_in/train_sft",
                                              "magpie_stand_in/train"}
    cfg.data.num_conversations = 3
    assert [i for i, _ in conversations(cfg)[0]] == ids[:3]  # the shuffled mix, its first num_conversations


def test_the_regenerated_manifest_records_its_input(stand_ins):
    """The settings a regeneration records in its output's manifest (and a rerun must match) name its
    input: the sources as given, or the data file."""
    from peagle_train.cli.regenerate import run_settings
    from peagle_train.config import compose

    sharegpt, ultrachat, _ = stand_ins
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": None, "source": "generation_config"}
    cfg = compose("regenerate", [f"data.sources=[{{hub: '{sharegpt}'}}, {{hub: '{ultrachat}', split: train_sft, count: 2}}]"])
    s = run_settings(cfg, "org/target", sampling)
    assert s["input"] == {"sources": [{"hub": str(sharegpt)}, {"hub": str(ultrachat), "split": "train_sft", "count": 2}]}
    assert s["temperature"] == 0.7 and "source" not in s and s["regenerated_by"] == "org/target"
    plain = run_settings(compose("regenerate", ["data.path=/data/chats.jsonl"]), "org/target", sampling)
    assert plain["input"] == {"path": "/data/chats.jsonl"}
