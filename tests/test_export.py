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
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
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
