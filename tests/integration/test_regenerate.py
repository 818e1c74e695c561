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


def chat_server(reply):
    """A /v1/chat/completions server on 127.0.0.1 answering each request body with reply(messages) =
    (text, finish_reason), or an HTTP 400 with message finish_reason when text is None: (its base
    URL, the list of request bodies received), and its shutdown."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            if self.path != "/v1/chat/completions":
                self.send_response(404)
                self.end_headers()
                return
            text, finish = reply(body["messages"])
            if text is None:  # an error answer: finish is its message, as vLLM's server sends a 400
                out = json.dumps({"object": "error", "message": finish, "type": "BadRequestError",
                                  "code": 400}).encode()
            else:
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                               "finish_reason": finish}]}).encode()
            self.send_response(200 if text is not None else 400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}/v1", requests, srv.shutdown


@pytest.fixture
def server():
    """A /v1/chat/completions server on 127.0.0.1 that answers "ans(<last user text>)#<answers so far>"."""
    def reply(msgs):
        k = sum(m["role"] == "assistant" for m in msgs)
        return (f"ans({msgs[-1]['content']})#{k}" if msgs[-1]["content"] != "say nothing" else ""), "stop"

    url, requests, stop = chat_server(reply)
    yield url, requests
    stop()


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

        def generate(self, c, seeds=None):
            Dying.calls += 1
            if Dying.calls > 2:  # batch 1 (2 turn calls) finishes, batch 2 is killed
                raise KeyboardInterrupt
            return super().generate(c, seeds)

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


def test_a_prompt_over_the_context_ends_its_conversation_before_that_turn(tmp_path):
    """vLLM's server answers a prompt over max_model_len with a 400 ("maximum context length"): that
    turn is not asked, the conversation keeps the turns before it, and one with no answer left is
    dropped under its own reason; every such prompt is counted. Any other 400 still stops the run."""
    from peagle_train.data.regenerate import OVER_CONTEXT

    def reply(msgs):
        if sum(len(m["content"]) for m in msgs) > 12:
            return None, ("This model's maximum context length is 8192 tokens. However, your prompt contains "
                          "8348 input tokens")
        return ("bad" if msgs[-1]["content"] == "bad" else f"a{len(msgs)}"), "stop"

    url, requests, stop = chat_server(reply)
    try:
        out = tmp_path / "r.jsonl"
        c = [("short", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"},
                        {"role": "user", "content": "much longer"}, {"role": "assistant", "content": "old"}]),
             ("long", [{"role": "user", "content": "x" * 13}, {"role": "assistant", "content": "old"}]),
             ("fits", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}])]
        st = regenerate(c, EndpointBackend(url, "m", concurrency=1), out, batch_size=3)
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert lines == [{"id": "short", "messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "a1"}]},
                         {"id": "fits", "messages": [{"role": "user", "content": "q"},
                                                     {"role": "assistant", "content": "a1"}]}]
        assert (st.prompts_over_context, st.turns_generated, st.written, st.dropped) == (2, 2, 2, {OVER_CONTEXT: 1})
        assert len(requests) == 4
    finally:
        stop()
    url, _, stop = chat_server(lambda msgs: (None, "temperature must be non-negative"))
    try:
        with pytest.raises(RuntimeError, match="HTTP Error 400"):
            EndpointBackend(url, "m").generate([[{"role": "user", "content": "q"}]])
    finally:
        stop()


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

        def generate(self, c, seeds=None):
            Dying.calls += 1
            if Dying.calls > 2:  # batch 1 written, the process dies in batch 2
                raise KeyboardInterrupt
            return super().generate(c, seeds)

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


# --- regeneration as the field does it: sampling, seeds, cut answers dropped, duplicates counted -------------


@pytest.fixture
def scripted():
    """A /v1/chat/completions server on 127.0.0.1: a prompt "long..." is answered with finish_reason
    "length" (cut), one "dup..." with the answer "same", any other one with "ans(<prompt>)#<answers so far>"."""
    def reply(msgs):
        last = msgs[-1]["content"]
        text = "same" if last.startswith("dup") else f"ans({last})#{sum(m['role'] == 'assistant' for m in msgs)}"
        return text, "length" if last.startswith("long") else "stop"

    url, requests, stop = chat_server(reply)
    yield url, requests
    stop()


def two_turns(cid, a, b):
    return (cid, [{"role": "user", "content": a}, {"role": "assistant", "content": "old"},
                  {"role": "user", "content": b}, {"role": "assistant", "content": "old"}])


def test_target_sampling_reads_the_generation_config_and_the_user_overrides():
    from transformers import GenerationConfig

    from peagle_train.data.regenerate import Sampling, target_sampling

    greedy = "greedy (the target's generation_config sets no sampling)"
    assert target_sampling(None) == Sampling(0.0, 1.0, 0, 0, greedy)
    assert target_sampling(GenerationConfig(bos_token_id=1, eos_token_id=2)) == Sampling(0.0, 1.0, 0, 0, greedy)
    # Llama-3's recommendation: top_k left unset is off (as vLLM reads it), not transformers' default 50
    llama3 = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9)
    assert target_sampling(llama3, seed=7) == Sampling(0.6, 0.9, 0, 7, "temperature, top_p from the target "
                                                                       "generation_config")
    assert target_sampling(GenerationConfig(do_sample=True)).temperature == 1.0
    assert target_sampling(GenerationConfig(do_sample=True, temperature=0.7, top_k=20)).top_k == 20
    assert target_sampling(llama3, temperature=0.3, top_k=5) == Sampling(
        0.3, 0.9, 5, 0, "temperature, top_k from the user; top_p from the target generation_config")
    assert target_sampling(None, temperature=0.0).source == "temperature from the user"


def test_hf_sampling_draws_each_conversation_with_its_own_seed(chatml_tokenizer):
    """A sampled answer is the target's softmax(logits / T) drawn with the conversation's seed, the
    same alone or beside another conversation; top_k 1 is the greedy answer."""
    import torch

    from peagle_train.data.regenerate import Sampling

    tok = chatml_tokenizer
    model = tiny_llama(vocab_size=len(tok))
    a = [{"role": "user", "content": "hello there"}]
    b = [{"role": "user", "content": "What is two plus two? I am fine, thank you."}]
    be = HFBackend(model, tok, max_new_tokens=6, sampling=Sampling(temperature=25.0))  # ×20 logits: T 25 spreads them
    both = [g.text for g in be.generate([a, b], seeds=[11, 22])]
    assert [g.text for g in be.generate([b, a], seeds=[22, 11])] == both[::-1]
    assert be.generate([a], seeds=[11])[0].text == both[0]
    # by hand: six draws from softmax(logits / 25) with a generator seeded 11
    ids = tok.apply_chat_template(a, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    g, new = torch.Generator().manual_seed(11), []
    with torch.no_grad():
        for _ in range(6):
            p = torch.softmax(model(ids).logits[0, -1].float() / 25.0, -1)
            t = int(torch.multinomial(p, 1, generator=g))
            if t == tok.eos_token_id:
                break
            new.append(t)
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
    assert both[0] == tok.decode(new, skip_special_tokens=True).strip()
    assert be.generate([a], seeds=[12])[0].text != both[0]  # another seed, another draw
    greedy = HFBackend(model, tok, max_new_tokens=6).generate([a, b])
    top1 = HFBackend(model, tok, max_new_tokens=6, sampling=Sampling(temperature=25.0, top_k=1)).generate([a, b], [1, 2])
    assert [x.text for x in top1] == [x.text for x in greedy]


def test_seeds_and_sampling_fields_reach_the_endpoint(tmp_path, scripted):
    from peagle_train.data.regenerate import turn_seed

    url, requests = scripted
    regenerate([two_turns("c0", "q", "r")], EndpointBackend(url, "m", temperature=0.7, top_k=20), tmp_path / "o.jsonl",
               seed=5)
    assert [(r["messages"][-1]["content"], r["seed"], r["temperature"], r["top_k"], "top_p" in r) for r in requests] == \
        [("q", turn_seed(5, "c0", 0), 0.7, 20, False), ("r", turn_seed(5, "c0", 1), 0.7, 20, False)]
    assert turn_seed(5, "c0", 0) != turn_seed(5, "c0", 1) != turn_seed(6, "c0", 1)
    assert 0 <= turn_seed(5, "c0", 0) < 2**31
    requests.clear()
    regenerate([two_turns("c1", "q", "r")], EndpointBackend(url, "m", temperature=None), tmp_path / "p.jsonl")
    assert "temperature" not in requests[0] and "top_k" not in requests[0]  # the server's default


def test_a_sampled_run_resumed_after_a_kill_writes_what_one_run_writes(tmp_path, chatml_tokenizer):
    from peagle_train.data.regenerate import Sampling

    tok = chatml_tokenizer
    model = tiny_llama(vocab_size=len(tok))
    cs = [(f"c{i}", [{"role": "user", "content": q}, {"role": "assistant", "content": "old"}])
          for i, q in enumerate(["hello there", "What is two plus two?", "how are you today?", "thank you", "fine"])]
    be = HFBackend(model, tok, max_new_tokens=4, sampling=Sampling(temperature=25.0))

    class Dying(HFBackend):
        calls = 0

        def generate(self, c, seeds=None):
            Dying.calls += 1
            if Dying.calls > 1:
                raise KeyboardInterrupt
            return super().generate(c, seeds)

    def answers(path):
        return {r["id"]: r["messages"] for r in map(json.loads, path.read_text().splitlines())}

    one = regenerate(cs, be, tmp_path / "one.jsonl", batch_size=2, seed=3, drop_cut=False)
    with pytest.raises(KeyboardInterrupt):
        regenerate(cs, Dying(model, tok, max_new_tokens=4, sampling=Sampling(temperature=25.0)), tmp_path / "two.jsonl",
                   batch_size=2, seed=3, drop_cut=False)
    st = regenerate(cs, be, tmp_path / "two.jsonl", batch_size=3, seed=3, drop_cut=False)  # another batch size
    assert (one.written, st.skipped_done, st.written) == (5, 2, 3)
    assert answers(tmp_path / "two.jsonl") == answers(tmp_path / "one.jsonl")
    assert len({m[1]["content"] for m in answers(tmp_path / "one.jsonl").values()}) > 1


def test_a_cut_answer_drops_its_conversation_counted_and_remembered(tmp_path, scripted):
    from peagle_train.data.manifest import read_regenerated_manifest
    from peagle_train.data.regenerate import CUT, dropped_path

    url, requests = scripted
    out = tmp_path / "regen.jsonl"
    cs = [two_turns("ok", "q", "r"), two_turns("cut2", "q", "long answer"), two_turns("cut1", "long", "r")]
    st = regenerate(cs, EndpointBackend(url, "m"), out, batch_size=2)
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["ok"]
    assert (st.written, st.cut_at_max_new_tokens, st.turns_generated, st.dropped) == (1, 2, 5, {CUT: 2})
    # cut1's first answer was cut: its second turn was never asked
    assert [r["messages"][-1]["content"] for r in requests if r["messages"][0]["content"] == "long"] == ["long"]
    m = read_regenerated_manifest(out)
    assert (m["complete"], m["conversations"], m["dropped"], m["cut_answers_dropped"]) == (True, 1, {CUT: 2}, 2)
    assert [json.loads(x) for x in dropped_path(out).read_text().splitlines()] == [
        {"id": "cut2", "reason": CUT}, {"id": "cut1", "reason": CUT}]
    n = len(requests)
    again = regenerate(cs + [two_turns("new", "q2", "r2")], EndpointBackend(url, "m"), out, batch_size=2)
    assert (again.skipped_done, again.skipped_dropped, again.written, len(requests) - n) == (1, 2, 1, 2)
    assert read_regenerated_manifest(out)["dropped"] == {CUT: 2}  # the whole output's, not this run's
    kept = regenerate([two_turns("cut2", "q", "long answer")], EndpointBackend(url, "m"), tmp_path / "k.jsonl",
                      drop_cut=False)
    assert kept.written == 1 and kept.dropped == {} and kept.cut_at_max_new_tokens == 1


def test_exact_duplicates_are_counted_and_duplicate_conversations_dropped(tmp_path, scripted):
    from peagle_train.data.manifest import read_regenerated_manifest
    from peagle_train.data.regenerate import DUPLICATE

    url, _ = scripted
    out = tmp_path / "regen.jsonl"
    cs = [two_turns("a", "q", "dup1"), two_turns("b", "q2", "dup2"), two_turns("a2", "q", "dup1")]
    st = regenerate(cs, EndpointBackend(url, "m"), out, batch_size=2)
    # b's second answer "same" repeats a's; a2 is a whole copy of a (same prompts, same answers)
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "b"]
    assert (st.duplicate_answers, st.duplicate_conversations, st.dropped) == (1, 1, {DUPLICATE: 1})
    st = regenerate([two_turns("a3", "q", "dup1"), two_turns("c", "q3", "dup3")], EndpointBackend(url, "m"), out)
    assert (st.written, st.duplicate_answers, st.duplicate_conversations) == (1, 1, 1)  # against the file written before
    m = read_regenerated_manifest(out)
    assert (m["duplicate_answers"], m["duplicate_conversations_dropped"], m["dropped"]) == (2, 2, {DUPLICATE: 2})


def test_the_vllm_backend_sends_one_seed_per_prompt_and_reads_cut_answers(monkeypatch, chatml_tokenizer):
    import peagle_train.serving.vllm_engine as engine
    from peagle_train.data.regenerate import Sampling
    from peagle_train.serving.backends import VllmBackend
    from peagle_train.serving.vllm_worker import serve_sampling_params

    calls = []

    class FakeSession:
        def __init__(self, **kw):
            calls.append(("start", kw["max_num_seqs"]))

        def generate(self, prompts, **kw):
            calls.append(kw)
            return [{"token_ids": [5, 6], "finish_reason": "length"}, {"token_ids": [5, 2], "finish_reason": "stop"}]

    monkeypatch.setattr(engine, "VllmSession", FakeSession)
    be = VllmBackend("t", chatml_tokenizer, {2}, python="p", log_path="l", max_num_seqs=256, max_new_tokens=9,
                     sampling=Sampling(0.6, 0.9, 20, 1))
    gens = be.generate([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], seeds=[3, 4])
    assert [g.cut for g in gens] == [True, False]
    assert calls == [("start", 256), {"max_new_tokens": 9, "stop_token_ids": {2}, "temperature": 0.6, "seed": 1,
                                      "top_p": 0.9, "top_k": 20, "seeds": [3, 4]}]
    params = serve_sampling_params(dict, {"prompts": [[1], [2]], "max_new_tokens": 9, "temperature": 0.6, "top_p": 0.9,
                                          "top_k": 20, "seed": 1, "seeds": [3, 4], "stop_token_ids": [2]})
    assert params == [dict(temperature=0.6, top_p=0.9, top_k=20, max_tokens=9, stop_token_ids=[2], seed=s)
                      for s in (3, 4)]
    assert [p["seed"] for p in serve_sampling_params(dict, {"prompts": [[1], [2]], "max_new_tokens": 1, "seed": 8})] \
        == [8, 8]


def test_the_vllm_backend_never_sends_a_prompt_over_the_context(monkeypatch, chatml_tokenizer):
    """vLLM refuses a whole generate call when one prompt has max_model_len tokens or more: such a
    prompt is kept back (Generation.too_long) and the others go, each with its own seed."""
    import peagle_train.serving.vllm_engine as engine
    from peagle_train.data.regenerate import prompt_texts
    from peagle_train.serving.backends import VllmBackend

    sent = []

    class FakeSession:
        def __init__(self, **kw):
            pass

        def generate(self, prompts, **kw):
            sent.append((list(map(len, prompts)), kw["seeds"]))
            return [{"token_ids": [7, 2], "finish_reason": "stop"} for _ in prompts]

    monkeypatch.setattr(engine, "VllmSession", FakeSession)
    chats = [[{"role": "user", "content": w}] for w in ("a", "a " * 40, "b")]
    lengths = [len(ids) for ids in chatml_tokenizer(prompt_texts(chatml_tokenizer, chats, {}),
                                                    add_special_tokens=False)["input_ids"]]
    limit = lengths[1]  # the middle prompt has exactly max_model_len tokens: no room for an answer
    assert lengths[0] == lengths[2] < limit
    be = VllmBackend("t", chatml_tokenizer, {2}, python="p", log_path="l", max_model_len=limit)
    gens = be.generate(chats, seeds=[10, 11, 12])
    assert [(g.too_long, g.cut, bool(g.text)) for g in gens] == [(False, False, True), (True, False, False),
                                                                 (False, False, True)]
    assert sent == [([lengths[0], lengths[2]], [10, 12])]
    assert be.generate(chats[1:2]) == [gens[1]] and len(sent) == 1  # nothing left to send: no call


def test_a_cpu_engine_that_may_sample_never_splits_a_prefill():
    """vLLM rewinds a seeded prompt's generator after a partial prefill, which a CPU generator cannot:
    on CPU the serve engine (regeneration) and a sampling generate engine run without chunked prefill,
    with a step budget that holds a whole prompt of max_model_len; greedy evaluation, features and
    any GPU engine keep vLLM's defaults."""
    from peagle_train.serving.vllm_worker import _llm_kwargs

    class Platform:
        def __init__(self, cpu):
            self.cpu = cpu

        def is_cpu(self):
            return self.cpu

    whole = {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    serve = {"task": "serve", "model": "m", "max_model_len": 8192}
    assert whole.items() <= _llm_kwargs(serve, Platform(True)).items()
    assert _llm_kwargs({**serve, "max_model_len": 1024}, Platform(True))["max_num_batched_tokens"] == 4096
    assert whole.items() <= _llm_kwargs({**serve, "task": "generate", "temperature": 0.7}, Platform(True)).items()
    for req, cpu in [({**serve, "task": "generate"}, True), (serve, False),
                     ({**serve, "task": "generate", "temperature": 0.7}, False)]:
        kw = _llm_kwargs(req, Platform(cpu))
        assert "enable_chunked_prefill" not in kw and "max_num_batched_tokens" not in kw, (req, cpu)


def test_the_regenerate_group_resolves_sampling_and_batch_size(tmp_path, chatml_tokenizer):
    """backend_from_config's hf backend samples with the target's generation_config (a user's value
    wins); the batch size defaults per backend."""
    from transformers import GenerationConfig

    from peagle_train.cli.regenerate import backend_from_config, batch_size_of
    from peagle_train.config import compose

    d = tmp_path / "target"
    model = tiny_llama(vocab_size=len(chatml_tokenizer))
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, eos_token_id=2)
    model.save_pretrained(str(d))
    chatml_tokenizer.save_pretrained(str(d))
    cfg = compose("regenerate", [f"target.path={d}", "regenerate.top_p=0.95"])
    backend, _ = backend_from_config(cfg.regenerate, cfg.target, cfg.data, seed=4)
    s = backend.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.7, 0.95, 20, 4)
    assert s.source == "top_p from the user; temperature, top_k from the target generation_config"
    assert [batch_size_of(compose("regenerate", o).regenerate) for o in
            ([], ["regenerate.backend=vllm"], ["regenerate.backend=endpoint"], ["regenerate.backend=vllm",
                                                                                 "regenerate.batch_size=7"])] == \
        [16, 256, 64, 7]


def test_peagle_regenerate_records_and_prints_its_sampling_and_drops(tmp_path, chatml_tokenizer):
    """The command: the target's generation_config samples (the user's top_p on top), every answer of
    the tiny target is cut at 3 tokens, so both conversations are dropped; the summary and the
    manifest say so."""
    import os
    import subprocess
    import sys

    from transformers import GenerationConfig

    from peagle_train.data.manifest import read_regenerated_manifest
    from peagle_train.data.regenerate import CUT
    from tests.conftest import REPO_ROOT

    d = tmp_path / "target"
    model = tiny_llama(vocab_size=len(chatml_tokenizer))
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, eos_token_id=2)
    model.save_pretrained(str(d))
    chatml_tokenizer.save_pretrained(str(d))
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q},
                                                                    {"role": "assistant", "content": "old"}]}) + "\n"
                            for i, q in enumerate(["hello there", "What is two plus two?"])))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PEAGLE_DATA_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "peagle_train.cli", "regenerate", f"target.path={d}", f"data.path={data}",
                        "data.num_conversations=null", "regenerate.max_new_tokens=3", "regenerate.top_p=0.9", "seed=2",
                        f"output_dir={tmp_path / 'out'}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "out" / "regenerated.jsonl"
    m = read_regenerated_manifest(out)
    assert {k: m["settings"][k] for k in ("temperature", "top_p", "top_k", "seed", "drop_cut")} == \
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 2, "drop_cut": True}
    assert (m["complete"], m["conversations"], m["dropped"], m["cut_answers_dropped"]) == (True, 0, {CUT: 2}, 2)
    log = p.stdout + p.stderr
    assert "'temperature': 0.7, 'top_p': 0.9, 'top_k': 20, 'source': 'top_p from the user; temperature, top_k from " \
           "the target generation_config'}" in log
    assert f"{'dropped':<26} {{'{CUT}': 2}}" in log and f"{'batch_size':<26} 16" in log


# --- several engines (data parallel): shards by id, merged into what one engine writes ----------------------


def shard_convs():
    """Conversations of both shards of 2 (c0, c1, c2, c10, c11: shard 1; the others: shard 0) with cut
    answers (c5, c2), a repeated answer (c3's "same" after c1's) and whole duplicates: c4 of c0 and
    c10 of c3 across the shards, c8 of c7 within shard 0."""
    return [two_turns("c0", "q0", "r0"), two_turns("c1", "dupA", "r1"), two_turns("c3", "q3", "dupB"),
            two_turns("c4", "q0", "r0"), two_turns("c5", "long", "r"), two_turns("c2", "q2", "long answer"),
            two_turns("c6", "q6", "r6"), two_turns("c10", "q3", "dupB"), two_turns("c7", "q7", "r7"),
            two_turns("c8", "q7", "r7"), two_turns("c11", "q11", "r11")]


def recording_backends(url, asked, fail=None):
    """make_backend(k) for regenerate_sharded: EndpointBackends that note in asked[k] the ids of the
    conversations whose first turn they are asked (known by its seed, turn_seed(0, id, 0)); with
    `fail` = (k, n), shard k's backend raises at its call n + 1."""
    from peagle_train.data.regenerate import turn_seed

    first = {turn_seed(0, cid, 0): cid for cid, _ in shard_convs()}

    class Recording(EndpointBackend):
        def __init__(self, k):
            super().__init__(url, "m")
            self.k, self.calls = k, 0

        def generate(self, c, seeds=None):
            self.calls += 1
            if fail is not None and self.k == fail[0] and self.calls > fail[1]:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            asked.setdefault(self.k, set()).update(first[s] for s in seeds if s in first)
            return super().generate(c, seeds)

    return Recording


def test_two_shards_write_what_one_engine_writes(tmp_path, scripted):
    """Each conversation goes to exactly one shard (`shard_of`); the merge writes the output, its
    .dropped and its manifest's counts as one engine does, a duplicate across shards dropped as one
    engine drops it; the shard folder is removed and the manifest names the shards' devices."""
    from peagle_train.data.manifest import read_regenerated_manifest
    from peagle_train.data.regenerate import CUT, DUPLICATE, dropped_path
    from peagle_train.data.regenerate_shards import regenerate_sharded, shard_of, shards_dir

    url, _ = scripted
    cs, run = shard_convs(), dict(batch_size=2, settings={"regenerated_by": "m"}, extra={"regenerated_by": "m"})
    one = regenerate(cs, EndpointBackend(url, "m"), tmp_path / "one.jsonl", **run)
    asked = {}
    out = tmp_path / "two.jsonl"
    two, info = regenerate_sharded(cs, recording_backends(url, asked), out, devices=["0", "1"], **run)
    ids = [cid for cid, _ in cs]
    assert asked == {k: {cid for cid in ids if shard_of(cid, 2) == k} for k in (0, 1)}
    assert asked[0] | asked[1] == set(ids) and not asked[0] & asked[1] and len(asked[1]) == 5
    assert out.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert dropped_path(out).read_bytes() == dropped_path(tmp_path / "one.jsonl").read_bytes()
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["c0", "c1", "c3", "c6", "c7", "c11"]
    assert asdict_(two) == asdict_(one)
    assert (two.written, two.turns_generated, two.cut_at_max_new_tokens, two.duplicate_answers,
            two.duplicate_conversations, two.dropped) == (6, 21, 2, 1, 3, {DUPLICATE: 3, CUT: 2})
    m1, m2 = read_regenerated_manifest(tmp_path / "one.jsonl"), read_regenerated_manifest(out)
    assert {k: v for k, v in m2.items() if k not in ("file", "data_parallel", "shards")} == \
        {k: v for k, v in m1.items() if k != "file"}
    assert (m2["complete"], m2["conversations"], m2["dropped"], m2["duplicate_answers"], m2["data_parallel"]) == \
        (True, 6, {DUPLICATE: 3, CUT: 2}, 1, 2)
    assert m2["shards"] == info == [
        {"shard": 0, "devices": "0", "file": "two.jsonl.shards/0-of-2.jsonl", "conversations": 6,
         "status": "merged"},
        {"shard": 1, "devices": "1", "file": "two.jsonl.shards/1-of-2.jsonl", "conversations": 5,
         "status": "merged"}]
    assert not shards_dir(out).exists()
    assert _records(out, tmp_path) == (["c0", "c1", "c11", "c3", "c6", "c7"], 6)


def asdict_(stats):
    from dataclasses import asdict

    return asdict(stats)


def test_a_failed_shard_is_named_and_the_rerun_redoes_it_alone(tmp_path, scripted):
    """Shard 1's engine dies in its second batch: shard 0 still finishes; the error and the
    output's manifest name shard 1 and its GPU, readers refuse the output, a rerun with another
    number of engines is refused, and the rerun starts shard 1's backend alone, asks only the
    conversations it had not written and ends with what one engine writes."""
    from peagle_train.data.manifest import read_regenerated_manifest
    from peagle_train.data.regenerate_shards import ShardError, regenerate_sharded
    from peagle_train.errors import ConfigError, CorruptFileError
    from peagle_train.runtime import user_error_message

    url, _ = scripted
    cs, run = shard_convs(), dict(batch_size=2, settings={"regenerated_by": "m"}, command="peagle regenerate x=1")
    regenerate(cs, EndpointBackend(url, "m"), tmp_path / "one.jsonl", batch_size=2)
    out, asked = tmp_path / "two.jsonl", {}
    with pytest.raises(ShardError) as e:  # shard 1: batch 1 (c0, c1: 2 calls) written, the engine dies in batch 2
        regenerate_sharded(cs, recording_backends(url, asked, fail=(1, 2)), out, devices=["4", "6"], **run)
    assert user_error_message(e.value) == (
        f"{out}: 1 of 2 regeneration shards failed (shard 1 (devices 6): RuntimeError: CUDA error: an illegal memory "
        f"access was encountered); shard 0 finished (kept in {out}.shards). Fix: rerun peagle regenerate x=1: it keeps "
        "the finished shards and redoes shard 1 from its complete lines.")
    m = read_regenerated_manifest(out)
    assert (m["complete"], m["conversations"], m["data_parallel"]) == (False, 0, 2)
    assert [(s["shard"], s["devices"], s["status"], s.get("error")) for s in m["shards"]] == [
        (0, "4", "finished", None), (1, "6", "failed", "RuntimeError: CUDA error: an illegal memory access was "
                                                       "encountered")]
    with pytest.raises(CorruptFileError, match="an unfinished peagle regenerate output"):
        _records(out, tmp_path)
    with pytest.raises(ConfigError) as e:
        regenerate_sharded(cs, recording_backends(url, {}), out, devices=["0", "1", "2"], **run)
    assert str(e.value) == (f"regenerate.data_parallel=3, but {out}.shards holds the unmerged shards of a run with "
                            "regenerate.data_parallel=2. Fix: rerun with regenerate.data_parallel=2 to finish them, or "
                            f"remove {out}.shards to regenerate their conversations again.")
    made, asked = [], {}
    Recording = recording_backends(url, asked)

    def make(k):
        made.append(k)
        return Recording(k)

    st, info = regenerate_sharded(cs, make, out, devices=["4", "6"], **run)
    assert made == [1] and asked == {1: {"c2", "c10", "c11"}}
    assert (st.written, st.turns_generated) == (6, 6)  # the 2 turns of c2, c10, c11: the redone part alone
    assert out.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    m = read_regenerated_manifest(out)
    assert (m["complete"], m["conversations"], [s["status"] for s in m["shards"]]) == (True, 6, ["merged", "merged"])


def test_engines_per_gpu_from_the_settings(monkeypatch, chatml_tokenizer):
    """regenerate.data_parallel (null: the visible GPUs // tensor_parallel) engines of
    regenerate.tensor_parallel GPUs each, from CUDA_VISIBLE_DEVICES; one engine without GPUs or with
    another backend, and several refused there; each engine's CUDA_VISIBLE_DEVICES and
    tensor_parallel_size reach its vLLM process."""
    import peagle_train.serving.vllm_engine as engine
    from peagle_train.cli.regenerate import engine_devices, visible_gpus
    from peagle_train.config import compose
    from peagle_train.errors import ConfigError
    from peagle_train.serving.backends import VllmBackend
    from peagle_train.serving.vllm_worker import _llm_kwargs

    def devices(gpus, *o, backend="vllm"):
        return engine_devices(compose("regenerate", [f"regenerate.backend={backend}", *o]).regenerate, gpus)

    eight = [str(i) for i in range(8)]
    assert devices(eight) == eight
    assert devices(eight, "regenerate.tensor_parallel=2") == ["0,1", "2,3", "4,5", "6,7"]
    assert devices(eight, "regenerate.tensor_parallel=2", "regenerate.data_parallel=3") == ["0,1", "2,3", "4,5"]
    assert devices(["3", "5"], "regenerate.data_parallel=1") == ["3"]
    assert devices([]) == devices(eight, backend="hf") == devices([], backend="endpoint") == [None]
    with pytest.raises(ConfigError, match=r"regenerate.data_parallel=5, regenerate.tensor_parallel=2 ask for 10 GPUs, "
                                          r"8 are visible \(0,1,2,3,4,5,6,7\)\. Fix: "):
        devices(eight, "regenerate.tensor_parallel=2", "regenerate.data_parallel=5")
    with pytest.raises(ConfigError, match=r"no GPU is visible .*vLLM on a CPU runs one engine over the cores\. Fix: "
                                          "leave both unset"):
        devices([], "regenerate.data_parallel=2")
    with pytest.raises(ConfigError, match=r"regenerate.backend=hf runs one generator"):
        devices(eight, "regenerate.tensor_parallel=2", backend="hf")
    for env, gpus in (("2,5", ["2", "5"]), ("", []), ("0,-1,3", ["0"]),
                      ("GPU-ab12, GPU-cd34", ["GPU-ab12", "GPU-cd34"])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        assert visible_gpus() == gpus
    assert engine.worker_env("/v/bin/python", 1, "6")["CUDA_VISIBLE_DEVICES"] == "6"
    assert engine.worker_env("/v/bin/python", 1)["CUDA_VISIBLE_DEVICES"] == "GPU-ab12, GPU-cd34"  # this process's
    started = []
    monkeypatch.setattr(engine, "VllmSession", lambda **kw: started.append(kw) or None)
    be = VllmBackend("t", chatml_tokenizer, {2}, python="p", log_path="l", devices="2,3", tensor_parallel=2)
    with pytest.raises(AttributeError):  # the fake session cannot generate: only its start is looked at
        be.generate([[{"role": "user", "content": "a"}]])
    assert (started[0]["devices"], started[0]["tensor_parallel"]) == ("2,3", 2)
    serve = {"task": "serve", "model": "m", "max_model_len": 64}
    assert _llm_kwargs({**serve, "tensor_parallel_size": 2}, type("P", (), {"is_cpu": lambda self: False})())[
        "tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in _llm_kwargs({**serve, "tensor_parallel_size": 1},
                                                     type("P", (), {"is_cpu": lambda self: False})())


FAKE_VLLM = '''#!{python}
"""A stand-in for vllm_worker.py under vLLM's python: notes its CUDA_VISIBLE_DEVICES and
tensor_parallel_size, then answers the "serve" protocol with token ids drawn from the prompt and seed."""
import json, os, sys

_, worker, request, ready = sys.argv
req = json.load(open(request))
with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
    f.write(json.dumps({{"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "tp": req.get("tensor_parallel_size"),
                        "pid": os.getpid()}}) + "\\n")


def write(path, obj):
    json.dump(obj, open(path + ".tmp", "w"))
    os.replace(path + ".tmp", path)


write(ready, {{"vllm_version": "fake", "load_seconds": 0.0}})
for line in sys.stdin:
    if line.strip():
        r = json.loads(line)
        outs = []
        for ids, seed in zip(r["prompts"], r["seeds"]):
            toks = [60 + (seed + sum(ids) + 7 * i) % 300 for i in range(3)]
            cut = seed % 5 == 0
            outs.append({{"token_ids": toks if cut else toks + [r["stop_token_ids"][0]],
                         "finish_reason": "length" if cut else "stop"}})
        write(r["response"], {{"outputs": outs, "generate_seconds": 0.0}})
'''


def test_peagle_regenerate_on_two_gpu_groups_writes_what_one_engine_writes(tmp_path, chatml_tokenizer):
    """The command with the vllm backend (a stand-in vLLM worker) and 4 visible GPUs: with
    regenerate.tensor_parallel=2 it starts 2 engines, on CUDA_VISIBLE_DEVICES 0,1 and 2,3 with
    tensor_parallel_size 2, and writes the output, the drops and the manifest's counts that one
    engine (regenerate.data_parallel=1: GPU 0) writes."""
    import os
    import subprocess
    import sys

    from peagle_train.data.manifest import read_regenerated_manifest
    from tests.conftest import REPO_ROOT

    d = tmp_path / "target"
    tiny_llama(vocab_size=len(chatml_tokenizer)).save_pretrained(str(d))
    chatml_tokenizer.save_pretrained(str(d))
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"hello there {i}"}, {"role": "assistant", "content": "old"},
        {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "old"}]}) + "\n"
        for i in range(10)))
    fake = tmp_path / "vllm-python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "engines.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PEAGLE_DATA_CACHE": str(tmp_path / "cache"),
           "CUDA_VISIBLE_DEVICES": "0,1,2,3", "FAKE_VLLM_LOG": str(log)}
    runs = {}
    for name, extra in (("one", ["regenerate.data_parallel=1"]), ("two", ["regenerate.tensor_parallel=2"])):
        log.unlink(missing_ok=True)
        p = subprocess.run([sys.executable, "-m", "peagle_train.cli", "regenerate", f"target.path={d}",
                            f"data.path={data}", "data.num_conversations=null", "regenerate.backend=vllm",
                            f"regenerate.vllm_python={fake}", "regenerate.batch_size=3", "seed=1",
                            f"output_dir={tmp_path / name}", *extra], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = [json.loads(x) for x in log.read_text().splitlines()], p.stdout + p.stderr
    assert [(e["devices"], e["tp"]) for e in runs["one"][0]] == [("0", 1)]
    assert sorted((e["devices"], e["tp"]) for e in runs["two"][0]) == [("0,1", 2), ("2,3", 2)]
    assert len({e["pid"] for e in runs["two"][0]}) == 2
    one, two = tmp_path / "one" / "regenerated.jsonl", tmp_path / "two" / "regenerated.jsonl"
    assert two.read_bytes() == one.read_bytes() and len(one.read_text().splitlines()) >= 3
    m1, m2 = read_regenerated_manifest(one), read_regenerated_manifest(two)
    counts = ("complete", "conversations", "bytes", "sha256", "dropped", "duplicate_answers", "cut_answers_dropped")
    assert [m2[k] for k in counts] == [m1[k] for k in counts] and m1["dropped"]
    assert "data_parallel" not in m1 and m2["data_parallel"] == 2
    assert [(s["devices"], s["status"]) for s in m2["shards"]] == [("0,1", "merged"), ("2,3", "merged")]
    assert sum(s["conversations"] for s in m2["shards"]) == 10
    assert (tmp_path / "two" / "vllm_regenerate.engine-1.log").is_file()
    assert f"{'data_parallel':<26} 2" in runs["two"][1]
