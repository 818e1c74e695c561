"""Regeneration: turn-by-turn with the target's own history, resumable after a kill, against a
loopback OpenAI-compatible server started by the test, and with the in-process HF backend."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from peagle_train.data.regenerate import done_ids, regenerate
from peagle_train.decoding.hf_backend import HFBackend
from peagle_train.serving.backends import EndpointBackend
from tests.conftest import tiny_llama


@pytest.fixture
def server():
    """A /v1/chat/completions server on 127.0.0.1 that answers "ans(<last user text>)#<answers so far>"."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            if self.path != "/v1/chat/completions":
                self.send_response(404)
                self.end_headers()
                return
            msgs = body["messages"]
            k = sum(m["role"] == "assistant" for m in msgs)
            text = f"ans({msgs[-1]['content']})#{k}" if msgs[-1]["content"] != "say nothing" else ""
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                           "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", requests
    srv.shutdown()


def convs(n):
    return [(f"c{i}", [{"role": "system", "content": "S"}, {"role": "user", "content": f"q{i}a"},
                       {"role": "assistant", "content": "old"}, {"role": "user", "content": f"q{i}b"},
                       {"role": "assistant", "content": "old"}]) for i in range(n)]


def test_endpoint_turn_by_turn_with_own_history(tmp_path, server):
    url, requests = server
    out = tmp_path / "regen.jsonl"
    st = regenerate(convs(2), EndpointBackend(url, "m", concurrency=2), out, batch_size=2)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["c0", "c1"]
    assert lines[0]["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "q0a"},
                                    {"role": "assistant", "content": "ans(q0a)#0"}, {"role": "user", "content": "q0b"},
                                    {"role": "assistant", "content": "ans(q0b)#1"}]
    # the second turn was asked with the regenerated first answer in its history, never the old one
    second = [r for r in requests if r["messages"][-1]["content"] == "q1b"][0]
    assert second["messages"][2] == {"role": "assistant", "content": "ans(q1a)#0"} and second["model"] == "m"
    assert st.turns_generated == 4 and st.written == 2


def test_max_turns_answers_only_the_first_turns(tmp_path, server):
    url, requests = server
    out = tmp_path / "regen.jsonl"
    st = regenerate(convs(3), EndpointBackend(url, "m"), out, batch_size=2, max_turns=1)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[2]["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "q2a"},
                                    {"role": "assistant", "content": "ans(q2a)#0"}]
    assert len(requests) == 3 and st.turns_generated == 3 and st.turns_cut_by_max_turns == 3


def test_resume_after_kill_redoes_nothing_finished(tmp_path, server):
    url, requests = server
    out = tmp_path / "regen.jsonl"

    class Dying(EndpointBackend):
        calls = 0

        def generate(self, c):
            Dying.calls += 1
            if Dying.calls > 2:  # batch 1 (2 turn calls) finishes, batch 2 is killed
                raise KeyboardInterrupt
            return super().generate(c)

    with pytest.raises(KeyboardInterrupt):
        regenerate(convs(5), Dying(url, "m"), out, batch_size=2)
    with open(out, "a") as f:
        f.write('{"id": "c2", "messa')  # a torn line, as a kill in the middle of a write leaves
    assert done_ids(out) == {"c0", "c1"} and out.read_text().endswith("\n")
    n_before = len(requests)
    st = regenerate(convs(5), EndpointBackend(url, "m"), out, batch_size=2)
    assert st.skipped_done == 2 and st.written == 3
    asked = {r["messages"][1]["content"] for r in requests[n_before:]}
    assert asked == {"q2a", "q3a", "q4a"}  # c0, c1 were not asked again
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == ["c0", "c1", "c2", "c3", "c4"]


def test_empty_answer_ends_the_conversation(tmp_path, server):
    url, _ = server
    out = tmp_path / "r.jsonl"
    c = [("x", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"},
                {"role": "user", "content": "say nothing"}, {"role": "assistant", "content": "old"}]),
         ("y", [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": "old"}])]
    st = regenerate(c, EndpointBackend(url, "m"), out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [{"id": "x", "messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "ans(hi)#0"}]}]
    assert st.stopped_at_empty_answer == 2 and st.dropped == {"no answer generated": 1}


def test_endpoint_unreachable_names_the_url():
    from peagle_train.runtime import user_error_message

    with pytest.raises(RuntimeError, match="127.0.0.1:9/v1/chat/completions") as e:
        EndpointBackend("http://127.0.0.1:9/v1", "m", timeout_s=2).generate([[{"role": "user", "content": "q"}]])
    assert user_error_message(e.value).startswith("Endpoint http://127.0.0.1:9/v1/chat/completions failed: ")  # one line
    assert user_error_message(e.value).endswith(". Fix: check regenerate.endpoint_url and that the server is up "
                                                "(vllm serve / sglang).")


def test_hf_backend_batched_equals_one_by_one(chatml_tokenizer):
    tok = chatml_tokenizer
    model = tiny_llama(vocab_size=len(tok))
    be = HFBackend(model, tok, max_new_tokens=5)
    a = [{"role": "user", "content": "hello there"}]
    b = [{"role": "user", "content": "What is two plus two? I am fine, thank you."}]
    both = be.generate([a, b])
    assert [g.text for g in both] == [be.generate([a])[0].text, be.generate([b])[0].text]
    # greedy: the same tokens as the model's own generate on the single prompt
    ids = tok.apply_chat_template(a, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    new = ref[0, ids["input_ids"].shape[1]:].tolist()
    eos = tok.eos_token_id
    new = new[: new.index(eos)] if eos in new else new
    assert both[0].text == tok.decode(new, skip_special_tokens=True).strip()


# --- the output's sidecar manifest: readers refuse an unfinished, cut or altered file ----------------------


def _records(path, tmp_path):
    from peagle_train.data.sources import load_source

    ds, info = load_source(path, tmp_path / "cache")
    return sorted(ds["id"]), info.records


def test_a_kill_between_two_batches_is_refused_by_readers_until_the_rerun_finishes(tmp_path, server):
    from peagle_train.data.manifest import read_regenerated_manifest
    from peagle_train.errors import CorruptFileError

    url, _ = server
    out = tmp_path / "regen.jsonl"
    settings = {"regenerated_by": "m", "temperature": 0.0}

    class Dying(EndpointBackend):
        calls = 0

        def generate(self, c):
            Dying.calls += 1
            if Dying.calls > 2:  # batch 1 written, the process dies in batch 2
                raise KeyboardInterrupt
            return super().generate(c)

    with pytest.raises(KeyboardInterrupt):
        regenerate(convs(5), Dying(url, "m"), out, batch_size=2, settings=settings, command="peagle regenerate x=1")
    m = read_regenerated_manifest(out)
    assert (m["complete"], m["conversations"], m["bytes"], m["sha256"]) == (False, 0, 0, None)
    with pytest.raises(CorruptFileError) as e:
        _records(out, tmp_path)
    assert str(e.value) == (f"{out}: an unfinished peagle regenerate output ({out}.manifest records the run as not "
                            "finished: stopped after 0 conversations). Fix: rerun peagle regenerate x=1: it keeps the "
                            f"complete conversations of {out} and regenerates the rest.")
    with open(out, "a") as f:
        f.write('{"id": "c2", "messa')  # a torn line, as a kill in the middle of a write leaves
    st = regenerate(convs(5), EndpointBackend(url, "m"), out, batch_size=2, settings=settings)
    assert (st.skipped_done, st.written, st.torn_lines_dropped) == (2, 3, 1)
    m = read_regenerated_manifest(out)
    assert (m["complete"], m["conversations"], m["bytes"]) == (True, 5, out.stat().st_size)
    assert _records(out, tmp_path) == (["c0", "c1", "c2", "c3", "c4"], 5)


def test_a_kill_before_the_last_write_is_refused_and_the_rerun_completes(tmp_path, server, monkeypatch):
    import peagle_train.data.regenerate as regen_mod
    from peagle_train.errors import CorruptFileError

    url, _ = server
    out = tmp_path / "regen.jsonl"
    real, calls = regen_mod.atomic_write_json, []

    def dies_at_the_second(*a, **k):  # every line written, the process dies before the manifest says so
        calls.append(a[1]["complete"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(regen_mod, "atomic_write_json", dies_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        regenerate(convs(3), EndpointBackend(url, "m"), out, batch_size=2)
    assert calls == [False, True] and len(out.read_text().splitlines()) == 3
    with pytest.raises(CorruptFileError, match=r"an unfinished peagle regenerate output .*stopped after 0 conversations\)"
                                               rf"\. Fix: rerun peagle regenerate regenerate\.output={out} with the "
                                               "settings it was made with: it keeps"):
        _records(out, tmp_path)
    monkeypatch.undo()
    st = regenerate(convs(3), EndpointBackend(url, "m"), out, batch_size=2)
    assert (st.skipped_done, st.written) == (3, 0)
    assert _records(out, tmp_path) == (["c0", "c1", "c2"], 3)


def test_a_cut_or_altered_output_is_refused_and_a_cut_one_resumed(tmp_path, server, caplog):
    import logging

    from peagle_train.errors import CorruptFileError

    url, requests = server
    out = tmp_path / "d" / "regen.jsonl"
    regenerate(convs(4), EndpointBackend(url, "m"), out, batch_size=2)
    full = out.read_bytes()
    out.write_bytes(full[: int(len(full) * 0.6)])  # cut, in the middle of the third line
    fix = f"Fix: rerun peagle regenerate regenerate.output={out} with the settings it was made with"
    with pytest.raises(CorruptFileError) as e:
        _records(out, tmp_path)
    assert str(e.value).startswith(f"{out}: {int(len(full) * 0.6)} bytes, {out}.manifest records {len(full)}: the file "
                                   f"is cut off or was changed after peagle regenerate finished it. {fix}")
    with pytest.raises(CorruptFileError, match=r"regen\.jsonl: \d+ bytes, .*records \d+: the file is cut off"):
        _records(out.parent, tmp_path)  # read through its directory too (the sidecar is not read as data)
    n_before = len(requests)
    with caplog.at_level(logging.WARNING, logger="peagle_train.data.regenerate"):
        st = regenerate(convs(4), EndpointBackend(url, "m"), out, batch_size=2)
    assert f"records {len(full)} (cut off): continuing from its complete lines" in caplog.text
    assert (st.skipped_done, st.written, st.torn_lines_dropped) == (2, 2, 1) and len(requests) - n_before == 4
    assert _records(out.parent, tmp_path) == (["c0", "c1", "c2", "c3"], 4)
    out.write_bytes(out.read_bytes().replace(b"ans(", b"ANS(", 1))  # altered: same size, other bytes
    with pytest.raises(CorruptFileError, match=rf"^{out}: its sha256 differs from {out}\.manifest: the file was altered "
                                               rf"after peagle regenerate finished it\. Fix: remove it and "
                                               rf"regen\.jsonl\.manifest, then rerun"):
        _records(out, tmp_path)
    size = out.stat().st_size
    with pytest.raises(CorruptFileError) as e:  # and a rerun does not adopt it
        regenerate(convs(4), EndpointBackend(url, "m"), out, batch_size=2)
    assert str(e.value) == (f"{out}: altered after peagle regenerate finished it ({out}.manifest records {size} bytes "
                            f"and their sha256, the file holds another sha256). Fix: remove {out} and "
                            f"regen.jsonl.manifest, then rerun peagle regenerate regenerate.output={out} with the settings "
                            f"it was made with: it keeps the complete conversations of {out} and regenerates the rest.")


def test_resuming_with_other_settings_or_a_damaged_line_is_refused(tmp_path, server):
    from peagle_train.errors import CorruptFileError

    url, _ = server
    out = tmp_path / "regen.jsonl"
    regenerate(convs(2), EndpointBackend(url, "m"), out, settings={"temperature": 0.0, "max_new_tokens": 512})
    with pytest.raises(CorruptFileError) as e:
        regenerate(convs(3), EndpointBackend(url, "m"), out, settings={"temperature": 0.7, "max_new_tokens": 512})
    assert str(e.value) == (f"{out}: written by peagle regenerate with other settings (temperature: 0.0 then, 0.7 now; "
                            f"{out}.manifest); continuing it would mix two kinds of answers in one file. Fix: choose "
                            f"another regenerate.output, or remove {out} and regen.jsonl.manifest to start over.")
    lines = out.read_text().splitlines()
    out.write_text(lines[0][:30] + "\n" + lines[1] + "\n")  # a damaged line before the last
    (tmp_path / "regen.jsonl.manifest").unlink()  # (a file without its manifest is not checked)
    with pytest.raises(CorruptFileError, match=rf"^{out}, line 1: not a regenerated conversation \(JSONDecodeError: "
                                               r".*\): the file is damaged\. Fix: remove that line \(or the file\) and "
                                               "rerun peagle regenerate"):
        regenerate(convs(3), EndpointBackend(url, "m"), out)
