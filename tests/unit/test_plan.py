"""`peagle plan` and the schedule rule `peagle train` applies at start-up (a GPU recipe's
500 warm-up steps against ~280-880 optimizer steps of ShareGPT on 8 GPUs).

Values checked by hand: the head's parameter count of a tiny config against the built head and a
formula, the memory terms of a tiny config, the COD element count against `cod_sample`, the saved
activations of a real forward against the per-element model, the refusals with the key and the fix;
the command prints the table of each GPU recipe offline (the target configs ship with the package)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig

from peagle_train.algorithms.cod import cod_mask, cod_sample
from peagle_train.config import compose
from peagle_train.draft import make_draft_head
from peagle_train.errors import ConfigError
from peagle_train.features.rows import PackedRow
from peagle_train.plan import data_counts, forward_seconds, make_plan, packs_documents
from peagle_train.training.checks import check_schedule, schedule_problems
from peagle_train.training.memory import (cod_elements, draft_config_for, draft_element_bytes, engine_state_bytes,
                                          estimate_step_memory, head_parameters, target_parameters)

from ..conftest import REPO_ROOT

GPU_RECIPES = ("llama-3.1-8b-instruct", "qwen3-8b", "gpt-oss-20b")


def tiny_target_config(**kw):
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
    return LlamaConfig(**{**base, **kw})


def test_head_parameters_of_a_tiny_config_equal_the_built_head_and_the_formula():
    hf = tiny_target_config()
    cfg = draft_config_for(hf, num_layers=2, num_depths=4, draft_vocab_size=100, norm_before_fc=True)
    counts = head_parameters(cfg)
    built = make_draft_head(cfg)
    assert counts["total"] == sum(p.numel() for p in built.parameters())
    assert counts["trainable"] == sum(p.numel() for p in built.parameters() if p.requires_grad)
    V, H, I, Q, KV, Vd = 1000, 64, 96, 64, 32, 100
    layer0 = 2 * H * Q + 2 * (2 * H * KV) + Q * H + 3 * H * I + 3 * H   # q, k, v read 2H; o; MLP; 3 norms
    layer1 = H * Q + 2 * H * KV + Q * H + 3 * H * I + 2 * H
    by_hand = V * H + 3 * H + 3 * H * H + layer0 + layer1 + H + Vd * H + 3 * H  # embed, input_norm, fc, ..., norm, lm_head, mask_hidden
    assert counts["total"] == by_hand
    assert (counts["embed_tokens"], counts["lm_head"], counts["fc"]) == (V * H, Vd * H, 3 * H * H)
    assert counts["layers"] == layer0 + layer1 and counts["per_layer"] == layer0
    assert counts["root"] == by_hand - layer0 - layer1


def test_target_parameters_on_the_meta_device_and_active_experts():
    hf = tiny_target_config()
    from transformers import AutoModelForCausalLM

    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    counts = target_parameters(hf)
    assert counts["total"] == real and counts["active"] == real - 1000 * 64  # the input embedding is a lookup
    from peagle_train.jobs.dry_run import tiny_target

    moe = tiny_target("gpt_oss", layers=2).config  # 4 experts, 2 per token
    experts = sum(p.numel() for n, p in tiny_target("gpt_oss", layers=2).named_parameters() if ".experts." in n)
    c = target_parameters(moe)
    assert c["active"] == c["total"] - moe.vocab_size * moe.hidden_size - experts // 2


def test_cod_elements_follow_cod_sample():
    # by hand: n=10 positions, S = 9 anchors, r 0.5: depth 1 keeps floor(8 · 0.5) = 4, depth 2 floor(7 · 0.25) = 1
    assert cod_elements(10, 3, None, 0.5, 0.2) == 10 + 4 + 1
    assert cod_elements(10, 3, 2, 0.5, 0.2) == 10 + 0  # S = 2: floor((2 - 1) · 0.5) = 0 ends the chains
    for n, K, anchors in ((64, 8, None), (300, 8, 32), (2048, 8, 512)):
        el = cod_sample(torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long), K, 0.7, 0.2, anchors,
                        torch.Generator().manual_seed(0))
        model = cod_elements(n, K, anchors, 0.7, 0.2)
        assert el.anchors.numel() <= model <= el.anchors.numel() + K  # an upper bound, tight for one document


def test_engine_states_by_hand():
    p = {"total": 1000, "trainable": 1000, "largest_module": 300, "root": 400, "per_layer": 150}
    assert engine_state_bytes(p, 4, "ddp") == {"head_weights": 4000, "head_grads": 4000, "optimizer": 8000,
                                               "engine_buffers": 0}
    assert engine_state_bytes(p, 4, "deepspeed", 2) == {"head_weights": 4000, "head_grads": 1000, "optimizer": 2000,
                                                        "engine_buffers": 1000 + 4000}  # fp32 partition + bucket
    assert engine_state_bytes(p, 4, "deepspeed", 3)["engine_buffers"] == 1000 + 4000 + 2 * 4 * 300
    assert engine_state_bytes(p, 4, "fsdp") == {"head_weights": 1000, "head_grads": 1000, "optimizer": 2000,
                                                "engine_buffers": 4 * 400 + 2 * 4 * 150}
    # several backward passes per step (partitions, grad_accum): the whole local gradient until the step's reduction
    for engine, stage in (("deepspeed", 2), ("deepspeed", 3), ("fsdp", 2)):
        assert engine_state_bytes(p, 4, engine, stage, backward_passes=6)["head_grads"] == 4000
    assert engine_state_bytes(p, 4, "ddp", backward_passes=6)["head_grads"] == 4000
    frozen = {**p, "trainable": 600}  # draft.train_embeddings=mask_row: frozen rows have weights only
    assert engine_state_bytes(frozen, 1, "ddp") == {"head_weights": 4000, "head_grads": 2400, "optimizer": 4800,
                                                    "engine_buffers": 0}


def test_memory_terms_of_a_tiny_config_by_hand():
    hf = tiny_target_config()
    cfg = draft_config_for(hf, num_layers=2, num_depths=4, draft_vocab_size=100, norm_before_fc=True)
    tp, hp = target_parameters(hf), head_parameters(cfg)
    m = estimate_step_memory(hf, cfg, 256, None, 4, world_size=2, engine="ddp", grad_accum=3, attention="flex",
                             act_bytes=2, feature_bytes=2, target_bytes=2)
    assert m["target_weights"] == 2 * tp["total"]
    assert (m["head_weights"], m["head_grads"], m["optimizer"]) == (4 * hp["total"], 4 * hp["total"], 8 * hp["total"])
    assert m["row_features"] == 3 * 256 * 3 * 64 * 2 and m["row_target_logits"] == 3 * 256 * 100 * 4
    M = cod_elements(256, 4, None)
    assert m["elements"] == m["elements_run"] == M and m["attention_mask"] == 16 * (-(-M // 128)) ** 2  # compiled
    eager = estimate_step_memory(hf, cfg, 256, None, 4, attention="flex", mask_compiled=False)
    assert eager["attention_mask"] == int(10.0 * M * M)  # the dense mask first (CPU)
    per = draft_element_bytes(cfg, 2, 2, "flex")
    kept = per["inputs"] + 2 * per["layer"] + per["first_layer_extra"] + per["final_norm"]
    casts = 2 * (hp["total"] - hp["embed_tokens"])
    assert m["draft_activations"] == M * (kept + max(per["head_loss"], per["head_backward"])) + casts
    fixed = sum(m[k] for k in ("target_weights", "head_weights", "head_grads", "optimizer", "engine_buffers"))
    assert m["peak"] == fixed + m["row_features"] + m["row_target_logits"] + max(
        m["target_forward"], m["draft_activations"] + m["attention_mask"])
    # partitions keep the context and one part's chains; the sparse plan builds nothing quadratic
    p2 = estimate_step_memory(hf, cfg, 256, None, 4, partitions=2, attention="sparse", act_bytes=4, feature_bytes=4)
    assert p2["elements_run"] == 256 + -(-(M - 256) // 2) and p2["attention_mask"] == 0


@pytest.mark.parametrize("layers", [1, 2])
def test_saved_activations_of_a_real_forward_match_the_model(layers):
    """What autograd keeps for the backward of a real fp32 forward over the COD axis (the saved
    tensors, weights excluded) against the per-element model: inputs, layers, final norm."""
    torch.manual_seed(0)
    hf = tiny_target_config(hidden_size=128, intermediate_size=256, head_dim=32)
    cfg = draft_config_for(hf, num_layers=layers, num_depths=8, draft_vocab_size=256, norm_before_fc=True)
    head = make_draft_head(cfg).train()
    weights = {p.untyped_storage().data_ptr() for p in head.parameters()}
    n = 256
    row = PackedRow(torch.randint(0, 999, (n,)), torch.randn(n, 3 * 128), torch.randn(n, 256),
                    torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long), torch.arange(n))
    el = cod_sample(row.valid, row.doc_ids, 8, 0.7, 0.2, None, torch.Generator().manual_seed(0))
    a, d = el.anchors, el.depths
    M = a.numel()
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights and st.nbytes() >= 8 * M:  # per-element tensors (not the small block plans)
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head(row.tokens[a][None], row.features[a][None], (row.pos_ids[a] + d)[None],
             cod_mask(a, d, row.doc_ids, "sparse"), None, is_slot=(d > 0)[None])
    per = draft_element_bytes(cfg, act_bytes=4, feature_bytes=4, attention="sparse")
    model = per["inputs"] + layers * per["layer"] + per["first_layer_extra"] + per["final_norm"]
    assert sum(saved.values()) / M == pytest.approx(model, rel=0.1)


def test_warmup_and_cadence_refused_with_the_key_and_the_fix():
    p = schedule_problems(280, 500, 1000, world_size=8, grad_accum=2, rows=4480, epochs=10)
    assert len(p) == 2
    assert p[0].startswith("training.warmup_steps=500 is more than half of the run's 280 optimizer steps (4,480 packed "
                           "rows over 10 epochs / (8 processes × grad_accum 2))")
    assert p[0].endswith("Fix: training.warmup_steps=28 (10% of the steps) or another value ≤ 140.")
    assert p[1].startswith("training.save_every=1000 exceeds the run's 280 optimizer steps")
    assert "Fix: training.save_every=28" in p[1]
    assert schedule_problems(280, 140, 280) == []  # half the run, and a checkpoint at the last step: allowed
    assert schedule_problems(1, 1, None) == []     # warmup 1 is no warm-up (the first step runs at the peak)
    assert len(schedule_problems(9, 5, None)) == 1
    with pytest.raises(ConfigError, match=r"training\.warmup_steps=3 is more than half of the run's 4"):
        check_schedule(4, OmegaConf.create({"warmup_steps": 3, "save_every": None, "grad_accum": 1, "epochs": 1}))


def test_the_trainer_refuses_a_run_that_never_leaves_warmup(tmp_path):
    """Fails on the code before 2026-12-04: the trainer warmed up linearly over any number of steps."""
    from accelerate import Accelerator

    from peagle_train.training.trainer import Trainer

    from ..integration.test_loop import tiny_rows
    from ..integration.test_resume import tiny_setup

    t, vocab, draft, cfg = tiny_setup(warmup_steps=10, max_steps=4, save_every=None, val_conversations=0)
    tr = Trainer(Accelerator(cpu=True), draft, t, tiny_rows(n=10), vocab.draft_ids, cfg, tmp_path / "a")
    with pytest.raises(ConfigError, match=r"^training\.warmup_steps=10 is more than half of the run's 4 optimizer steps "
                                          r".*Fix: training\.warmup_steps=1 \(10% of the steps\) or another value ≤ 2\.$"):
        tr.setup()
    t, vocab, draft, cfg = tiny_setup(max_steps=4, save_every=5, val_conversations=0)
    tr = Trainer(Accelerator(cpu=True), draft, t, tiny_rows(n=10), vocab.draft_ids, cfg, tmp_path / "b")
    with pytest.raises(ConfigError, match=r"training\.save_every=5 exceeds the run's 4 optimizer steps"):
        tr.setup()


def test_data_counts_from_the_key_a_prepared_dir_or_the_table(tmp_path):
    cfg = compose("plan", ["recipe=llama-3.1-8b-instruct"])
    assert data_counts(cfg, 1234)["tokens"] == 1234
    estimate = data_counts(cfg)  # the recipe's regenerate stage: its sources' counts × ShareGPT's mean conversation
    assert (estimate["tokens"], estimate["conversations"]) == (22_635_787 * 500_000 // 16_747, 500_000)
    assert estimate["source"].startswith("estimate: 500,000 conversations of data.sources × 1,352 tokens")
    cfg = compose("plan", ["recipe=llama-3.1-8b-instruct", "data.path=pkg:sharegpt", "data.sources=[]"])
    shipped = data_counts(cfg)
    assert shipped["tokens"] == 22_635_787 and shipped["conversations"] == 16_747  # ShareGPT at max_length 2048
    (tmp_path / "summary.json").write_text(json.dumps({"tokens": 5000, "conversations_kept": 7}))
    cfg.data.prepared_dir = str(tmp_path)
    assert data_counts(cfg)["tokens"] == 5000
    cfg.data.prepared_dir, cfg.data.path = None, "mine.jsonl"
    with pytest.raises(ConfigError, match="no token count for data.path=mine.jsonl. Fix: give data_tokens=N"):
        data_counts(cfg)


def test_forward_seconds_is_a_roofline_plus_layer_overhead():
    # 1B active parameters, 2 GB of weights, one token: max(2e9 / 1e14, 2e9 / 1e12) + 10 layers × 40 kernels × 7.5 µs
    assert forward_seconds(10**9, 2 * 10**9, 1, 10, 100.0, 1000.0) == pytest.approx(0.002 + 0.003)
    assert forward_seconds(10**9, 2 * 10**9, 10**4, 10, 100.0, 1000.0) == pytest.approx(0.2 + 0.003)


def test_the_8b_recipes_evaluation_estimate_by_hand():
    """Llama-3.1-8B's evaluation (80 prompts × 256 tokens, K 7, batch 1, bf16): the target's
    7,504,924,672 active parameters (8,030,261,248 less the 128,256 × 4,096 embedding) read as
    15,009,849,344 B at 2,000 GB/s = 7.504924672 ms (above 2 · 7.5e9 · 8 FLOP at 400 TFLOP/s =
    0.30 ms, so verify costs the same), + 32 layers × 40 kernels × 7.5 µs = 9.6 ms; the head's
    1,607,536,640 parameters × 2 B = 1.60753664 ms + 4 layers × 0.3 ms. Per token 3 target
    forwards + a draft = 54.122310656 ms; × 80 × 256 = 1,108.4 s (18.5 min). The target's
    attention is SDPA over a KV cache in the run's precision."""
    from peagle_train.plan import format_plan

    plan = make_plan(compose("plan", ["recipe=llama-3.1-8b-instruct", "world_size=8"]))
    ev = plan.evaluation
    assert plan.target["active"] == 8_030_261_248 - 128_256 * 4_096 == 7_504_924_672
    assert plan.head["total"] == 1_607_536_640
    assert (ev["prompts"], ev["max_new_tokens"], ev["K"]) == (80, 256, 7)
    assert ev["forward_s"] == pytest.approx(7.504924672e-3 + 9.6e-3, rel=1e-12)
    assert ev["verify_s"] == pytest.approx(17.104924672e-3, rel=1e-12)
    assert ev["draft_s"] == pytest.approx(1.60753664e-3 + 1.2e-3, rel=1e-12)
    assert ev["per_token_s"] == pytest.approx(54.122310656e-3, rel=1e-12)
    assert ev["seconds"] == pytest.approx(80 * 256 * 54.122310656e-3, rel=1e-12) and round(ev["seconds"] / 60, 1) == 18.5
    assert ev["attention"] == "SDPA over a bf16 KV cache"
    assert ("+ 0.3 ms per layer: 40 kernels at 7.5 µs; the target's attention SDPA over a bf16 KV cache) |"
            in format_plan(plan))
    fp32 = make_plan(compose("plan", ["recipe=llama-3.1-8b-instruct", "world_size=8", "precision=fp32"]))
    assert fp32.evaluation["attention"] == "SDPA over an fp32 KV cache"


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_the_gpu_recipes_plan_on_1_and_8_gpus(recipe):
    for world in (1, 8):
        plan = make_plan(compose("plan", [f"recipe={recipe}", f"world_size={world}", "gpu_memory_gb=80"]))
        assert plan.problems == [], plan.problems  # re-sized: they fit and leave warm-up on 1 and 8 GPUs
        assert plan.target["source"].startswith(("shipped", recipe)) or "local" in plan.target["source"]
        assert plan.schedule["warmup_share"] < 0.1 and plan.schedule["checkpoints_before_end"] >= 3


def test_shipped_target_configs_and_document_packing():
    from peagle_train.paths import TARGET_CONFIGS_DIR
    from peagle_train.plan import target_config

    sizes = {}
    for name, packs in (("meta-llama/Llama-3.1-8B-Instruct", True), ("Qwen/Qwen3-8B", True), ("openai/gpt-oss-20b", False)):
        hf, source = target_config(OmegaConf.create({"path": "/nonexistent/dir", "name_or_path": name}))
        assert source == f"shipped {name.replace('/', '--')}.json" and packs_documents(hf) is packs
        sizes[name] = (hf.hidden_size, hf.num_hidden_layers, hf.vocab_size, target_parameters(hf)["total"])
    assert sizes["meta-llama/Llama-3.1-8B-Instruct"] == (4096, 32, 128256, 8_030_261_248)
    assert sizes["Qwen/Qwen3-8B"] == (4096, 36, 151936, 8_190_735_360)
    assert sizes["openai/gpt-oss-20b"][:3] == (2880, 24, 201088)
    assert len(list(TARGET_CONFIGS_DIR.glob("*.json"))) == 3


def test_the_command_prints_the_table_and_refuses_with_the_fix(capsys):
    from peagle_train.cli.plan import main

    assert main(["recipe=llama-3.1-8b-instruct", "world_size=8"]) == 0
    out = capsys.readouterr().out
    assert "| **peak (estimate)** |" in out and "1.608B parameters, 1.082B trainable" in out
    assert "| optimizer steps | 5,428 = 43,427 rows × 2 epochs / 16 rows per step (8 GPUs × grad_accum 2) |" in out
    assert "| warm-up | 109 steps = 2% of the run |" in out  # training.warmup_fraction 0.02
    assert main(["recipe=llama-3.1-8b-instruct", "world_size=8", "training.warmup_fraction=null",
                 "training.warmup_steps=5000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle plan: error: training.warmup_steps=5000 is more than half of the run's 5,428 optimizer "
                          "steps") and "Fix: training.warmup_steps=542 (10% of the steps)" in err
    assert main(["recipe=llama-3.1-8b-instruct", "world_size=1", "gpu_memory_gb=40"]) == 2
    err = capsys.readouterr().err
    assert "one training step needs ≈ " in err and "but the GPU has 40.0 GiB. Fix: lower training.tokens_per_step" in err


def test_the_command_works_offline_for_each_gpu_recipe(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    code = ("import sys; from peagle_train.cli import main; "
            "sys.exit(max(main(['plan', f'recipe={r}', 'world_size=8']) for r in sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, *GPU_RECIPES], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for recipe, head in zip(GPU_RECIPES, ("1.608B", "1.604B", "918.9M")):
        assert f"## recipe {recipe}: 8 GPUs of 80 GiB" in p.stdout and f"{head} parameters" in p.stdout
    assert p.stdout.count("(shipped ") == 3
