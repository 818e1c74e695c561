"""§6: export → read back gives the same head; the validator catches broken exports."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_train.export.speculators import ExportError, load_export, validate_export, write_export

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


def test_reloaded_export_decodes_like_the_checkpoint(tmp_path, target_model):
    """bf16 export → fp32 reload: the same greedy proposals and acceptance on the tiny target
    (logits agree to bf16 precision, ~1e-2 relative, far below the argmax margins here)."""
    from .reference_decoder import speculative_generate, target_generate
    from peagle_train.training.loop import load_checkpoint, save_checkpoint

    t, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=2)
    ckpt, _ = load_checkpoint(save_checkpoint(d, tmp_path / "ckpt"))
    back = load_export(write_export(ckpt, tmp_path / "exp", verifier_name_or_path="x", verifier_architectures=["L"]))
    for prompt in ([1, 2, 3, 4, 5], [90, 80, 70]):
        a = speculative_generate(t, ckpt, prompt, 4, 30, set())
        b = speculative_generate(t, back, prompt, 4, 30, set())
        assert a.tokens == b.tokens == target_generate(t, prompt, 30, set()).tokens
        assert a.accepted == b.accepted


def test_checkpoint_without_mask_hidden_is_refused(tmp_path, target_model):
    from peagle_train.training.loop import load_checkpoint, save_checkpoint

    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=1)
    ckpt = save_checkpoint(d, tmp_path / "ckpt")
    sd = load_file(str(ckpt / "model.safetensors"))
    del sd["mask_hidden"]
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['mask_hidden'\]"):
        load_checkpoint(ckpt)
