"""`draft.init_from` starts a run from a head that already exists (draft/head_files.py
`init_from_head`): an EAGLE-3 head starts a P-EAGLE one and back, another draft vocabulary is
remapped by target token id, a hub id is read from the Hugging Face cache, and a head that does not
fit is refused line by line before any weight is read."""

import json
import logging
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from peagle_train.data.vocab import DraftVocab
from peagle_train.draft.head_files import save_checkpoint
from peagle_train.errors import ConfigError, ExportError
from peagle_train.export.speculators import write_export
from peagle_train.jobs.builders import build_draft
from peagle_train.target.aux_layers import AuxLayers
from peagle_train.target.capture import FeatureTarget

IDS = torch.arange(0, 128, 2)


def recipe(init_from=None, **keys):
    return OmegaConf.create({"num_layers": 1, "num_depths": 4, "init_from": init_from, **keys})


def trained(target_model, algorithm, ids=IDS, aux=None, seed=0):
    """A head built as a run builds it, every weight then moved away from its init ("trained")."""
    torch.manual_seed(seed)
    t = FeatureTarget(target_model, aux)
    head = build_draft(t, recipe(), DraftVocab.from_ids(ids, 128), 127, algorithm)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return t, head


def fresh(t, algorithm, ids=IDS, seed=1, **keys):
    torch.manual_seed(seed)
    return build_draft(t, recipe(**keys), DraftVocab.from_ids(ids, 128), 127, algorithm).state_dict()


def test_an_eagle3_export_starts_a_peagle_head(tmp_path, target_model, caplog):
    """Every tensor of the EAGLE-3 export carries over; `mask_hidden` and the mask token's embedding
    row are P-EAGLE's own init (the draw of this run's seed, the target's row)."""
    t, src = trained(target_model, "eagle3")
    exp = write_export(src, tmp_path / "e3", verifier_name_or_path="x", verifier_architectures=["L"])
    exported = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(exp / "model.safetensors")).items()}
    own = fresh(t, "peagle")
    with caplog.at_level(logging.INFO, logger="peagle_train.draft.head_files"):
        warm = fresh(t, "peagle", init_from=str(exp))
    assert set(warm) - set(exported) == {"mask_hidden"}
    assert torch.equal(warm["mask_hidden"], own["mask_hidden"])
    for k, v in exported.items():
        if k == "embed_tokens.weight":
            assert torch.equal(warm[k][:127], v[:127]) and torch.equal(warm[k][127], own[k][127])
            assert torch.equal(own[k][127], target_model.get_input_embeddings().weight[127])
            assert not torch.equal(v[127], own[k][127])
        else:
            assert torch.equal(warm[k], v), k
    assert "the EAGLE-3 head starts this P-EAGLE head" in caplog.text and "own init: mask_hidden" in caplog.text


def test_a_peagle_checkpoint_starts_an_eagle3_head(tmp_path, target_model):
    t, src = trained(target_model, "peagle")
    ckpt = save_checkpoint(src, tmp_path / "ckpt")
    warm = fresh(t, "eagle3", init_from=str(ckpt))
    sd = src.state_dict()
    assert set(sd) - set(warm) == {"mask_hidden"}
    assert all(torch.equal(warm[k], sd[k]) for k in warm)


def test_another_draft_vocabulary_is_remapped_by_target_id(tmp_path, target_model, caplog):
    """Shared tokens keep the head's lm_head rows, new ones start from the target's LM-head rows, the
    rest go; the run keeps its own vocabulary buffers; the counts are logged."""
    t, src = trained(target_model, "peagle")
    ckpt = save_checkpoint(src, tmp_path / "ckpt")
    run_ids = torch.arange(32, 96)  # 32 even ids shared with IDS, 32 odd ones new; 32 of IDS dropped
    with caplog.at_level(logging.INFO, logger="peagle_train.draft.head_files"):
        warm = fresh(t, "peagle", ids=run_ids, init_from=str(ckpt))
    src_rows = dict(zip(IDS.tolist(), src.state_dict()["lm_head.weight"]))
    target_rows = target_model.get_output_embeddings().weight
    for j, tid in enumerate(run_ids.tolist()):
        want = src_rows[tid] if tid in src_rows else target_rows[tid]
        assert torch.equal(warm["lm_head.weight"][j], want), tid
    vocab = DraftVocab.from_ids(run_ids, 128)
    assert torch.equal(warm["d2t"], vocab.d2t) and torch.equal(warm["t2d"], vocab.t2d)
    assert torch.equal(warm["fc.weight"], src.state_dict()["fc.weight"])
    assert "draft vocabulary: shared 32, new 32, dropped 32" in caplog.text


def test_a_hub_id_is_read_from_the_hugging_face_cache_offline(tmp_path, target_model, monkeypatch):
    from huggingface_hub import constants

    t, src = trained(target_model, "eagle3")
    exp = write_export(src, tmp_path / "e3", verifier_name_or_path="x", verifier_architectures=["L"])
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny-eagle3" / "snapshots" / "abc123"
    shutil.copytree(exp, snap)
    (cache / "models--org--tiny-eagle3" / "refs").mkdir()
    (cache / "models--org--tiny-eagle3" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    warm = fresh(t, "peagle", init_from="org/tiny-eagle3")
    assert torch.equal(warm["fc.weight"], load_file(str(exp / "model.safetensors"))["fc.weight"].float())
    with pytest.raises(FileNotFoundError, match=r"draft.init_from=org/absent: HF_HUB_OFFLINE=1 and the hub model"):
        fresh(t, "peagle", init_from="org/absent")


def test_a_head_that_does_not_fit_is_refused_line_by_line_before_its_weights(tmp_path, target_model):
    """Each mismatch is one line naming both values and the fix; the weights file is never read (it
    is garbage here)."""
    t, src = trained(target_model, "peagle", aux=[1, 2, 3])
    ckpt = save_checkpoint(src, tmp_path / "ckpt")
    meta = json.loads((ckpt / "draft_config.json").read_text())
    meta["draft"].update(vocab_size=256, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    (ckpt / "draft_config.json").write_text(json.dumps(meta))
    (ckpt / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ConfigError) as e:
        fresh(FeatureTarget(target_model), "peagle", num_layers=2, init_from=str(ckpt))
    lines = str(e.value).splitlines()[1:]
    assert lines == [
        f"  vocab_size: 256 in {ckpt}, 128 from this run's target. Fix: target.path = the target the head was "
        "trained for",
        f"  rotary settings: {{'rope_type': 'default', 'rope_theta': 500000.0}} in {ckpt}, {{'rope_type': 'default', "
        f"'rope_theta': {target_model.config.rope_parameters['rope_theta']}}} from this run's target. Fix: "
        "target.path = the target the head was trained for",
        f"  aux_layer_ids: [1, 2, 3] in {ckpt}, {FeatureTarget(target_model).aux_layer_ids} in this run. "
        "Fix: target.aux_layer_ids=[1, 2, 3]",
        f"  num_hidden_layers: 1 in {ckpt}, 2 in this run. Fix: draft.num_layers=1",
    ]
    with pytest.raises(ConfigError, match=r"algorithm: peagle in .*, dflash in this run \(P-EAGLE and DFlash heads "
                                          r"share no layout\). Fix: algorithm=peagle"):
        fresh(t, "dflash", init_from=str(ckpt))


def write_zlab(head, out, block_size, **extra):
    """`head` (a DFlash head over the full vocabulary) in z-lab's layout (github.com/z-lab/dflash, as
    z-lab/Qwen3-8B-DFlash-b16 ships it): a Qwen3 config with block_size and dflash_config
    {mask_token_id, target_layer_ids: outputs of layers i}, the older rope_theta, and bf16 weights
    without embed_tokens, lm_head or d2t/t2d (the target's)."""
    from safetensors.torch import save_file

    c = head.config
    out.mkdir(parents=True)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
           "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in c.aux_layer_ids]},
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "head_dim": c.head_dim,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_parameters["rope_theta"], "rope_scaling": None, "vocab_size": c.vocab_size,
           "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
           "layer_types": ["full_attention"] * c.num_hidden_layers, "sliding_window": None,
           "tie_word_embeddings": False, "num_target_layers": 8, **extra}
    (out / "config.json").write_text(json.dumps(cfg))
    skip = {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"}
    save_file({k: v.detach().bfloat16().contiguous() for k, v in head.state_dict().items() if k not in skip},
              str(out / "model.safetensors"))
    return out


def test_a_zlab_dflash_head_starts_a_dflash_run_of_another_block_size(tmp_path, target_model, caplog):
    """z-lab's layout (block 16, full vocabulary, no embedding or LM head) starts a DFlash run of block
    5 over 64 draft tokens: every z-lab tensor carries over; the embedding, LM head rows and d2t/t2d
    are this run's (the target's, which z-lab's head reads); aux ids are target_layer_ids + 1."""
    from peagle_train.draft.head_files import head_description, load_head

    t, src = trained(target_model, "dflash", ids=torch.arange(128))
    zlab = write_zlab(src, tmp_path / "zlab", block_size=16)
    desc = head_description(zlab)
    assert (desc.algorithm, desc.num_depths, desc.draft_vocab_size, desc.mask_token_id) == ("dflash", 15, 128, 127)
    assert desc.aux_layer_ids == t.aux_layer_ids and desc.rope_parameters["rope_theta"] == \
        target_model.config.rope_parameters["rope_theta"] and not desc.block_causal and desc.sliding_window is None
    own = fresh(t, "dflash")
    with caplog.at_level(logging.INFO, logger="peagle_train.draft.head_files"):
        warm = fresh(t, "dflash", init_from=str(zlab))
    weights = load_file(str(zlab / "model.safetensors"))
    assert set(warm) - set(weights) == {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"}
    for k, v in weights.items():
        assert torch.equal(warm[k], v.float()), k
    for k in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
        assert torch.equal(warm[k], own[k]), k
    assert torch.equal(warm["lm_head.weight"], target_model.get_output_embeddings().weight[IDS])
    assert "the DFlash head starts this DFlash head" in caplog.text
    with pytest.raises(ExportError, match=r"z-lab's DFlash layout, without the target's embedding and LM head, .* "
                                          rf"Fix: train from it with draft.init_from={zlab} algorithm=dflash"):
        load_head(zlab)


def test_zlab_heads_we_cannot_compute_are_refused_in_one_line(tmp_path, target_model):
    from peagle_train.draft.head_files import head_description

    _, src = trained(target_model, "dflash", ids=torch.arange(128))
    cases = {"dflash2": ({"architectures": ["DFlash2DraftModel"]}, "architectures ['DFlash2DraftModel'] is not "
                         "z-lab's DFlash (DFlashDraftModel); its layers hold weights a peagle-train DFlash head does "
                         "not have."),
             "mixed": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
                       "layer_types mixes ['full_attention', 'sliding_attention']; a peagle-train DFlash head gives "
                       "every layer the same attention."),
             "scaled": ({"dflash_config": {"mask_token_id": 127, "target_layer_ids": [1, 3, 4],
                                           "input_embedding_scale": 8.0}},
                        "dflash_config.input_embedding_scale is not what a peagle-train DFlash head computes."),
             "nomask": ({"dflash_config": {"target_layer_ids": [1, 3, 4]}},
                        "z-lab's DFlash config lacks 'dflash_config.mask_token_id' or has it malformed.")}
    for name, (extra, line) in cases.items():
        d = write_zlab(src, tmp_path / name, block_size=16, **extra)
        with pytest.raises(ExportError) as e:
            head_description(d)
        assert str(e.value).splitlines() == [f"{d / 'config.json'}: {line} Fix: start from a speculators-format "
                                             "DFlash export, or from z-lab's own DFlash (DFlashDraftModel) heads."]
    # a sliding window on every layer, causal as z-lab's sliding layers are; without target_layer_ids, z-lab's
    # spread over num_target_layers
    d = write_zlab(src, tmp_path / "sliding", block_size=8, layer_types=["sliding_attention"], sliding_window=8,
                   dflash_config={"mask_token_id": 127})
    desc = head_description(d)
    assert (desc.sliding_window, desc.block_causal, desc.num_depths) == (8, True, 7)
    assert desc.aux_layer_ids == AuxLayers.spread(8, 1) == [5]


def test_our_dflash_export_starts_a_dflash_run_on_a_llama_target(tmp_path, target_model):
    """A DFlash head's layers are Qwen3's whatever the target (its export says model_type qwen3), so
    its description read back fits a run on a Llama target."""
    t, src = trained(target_model, "dflash")
    exp = write_export(src, tmp_path / "d", verifier_name_or_path="x", verifier_architectures=["L"])
    assert json.loads((exp / "config.json").read_text())["transformer_layer_config"]["model_type"] == "qwen3"
    assert src.config.model_type == "qwen3"
    warm = fresh(t, "dflash", init_from=str(exp))
    assert torch.equal(warm["fc.weight"], load_file(str(exp / "model.safetensors"))["fc.weight"].float())


def test_the_heads_vocabulary_is_kept_with_its_coverage_of_the_data(tmp_path, target_model):
    """data.draft_vocab_from_head: the head's ids (j + d2t[j]; the whole vocabulary without d2t),
    their share of the data's supervised tokens, the source named; without draft.init_from, refused."""
    import datasets

    from peagle_train.config import config_problems, default_config
    from peagle_train.data.prepare import PreparedData, with_draft_ids
    from peagle_train.draft.head_files import head_vocabulary

    _, src = trained(target_model, "peagle", ids=torch.tensor([2, 5, 9, 40]))
    ckpt = save_checkpoint(src, tmp_path / "ckpt")
    assert head_vocabulary(str(ckpt)).tolist() == [2, 5, 9, 40]
    from safetensors.torch import save_file

    from peagle_train.errors import CorruptFileError

    cut = save_checkpoint(src, tmp_path / "cut")  # weights without d2t: named, not a KeyError
    save_file({k: v for k, v in load_file(str(cut / "model.safetensors")).items() if k != "d2t"},
              str(cut / "model.safetensors"))
    with pytest.raises(CorruptFileError, match=rf"^{cut / 'model.safetensors'}: lacks the tensor 'd2t' \(draft weights\)"):
        head_vocabulary(str(cut))
    _, full = trained(target_model, "dflash", ids=torch.arange(128))
    assert head_vocabulary(str(write_zlab(full, tmp_path / "z", block_size=4))).tolist() == list(range(128))
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 5, 5, 7], [9, 3]], "loss_mask": [[0, 1, 1, 1, 1], [1, 1]]})
    data = PreparedData(rows, DraftVocab.from_ids(torch.tensor([1, 2]), 128), 127, {"draft_vocab_size": 2},
                        {"draft_vocab": {"size": 2}})
    kept = with_draft_ids(data, head_vocabulary(str(ckpt)), 128, f"draft.init_from={ckpt}")
    assert kept.vocab.draft_ids.tolist() == [2, 5, 9, 40] and kept.vocab.d2t.tolist() == [2, 4, 7, 37]
    assert kept.vocab.coverage == 4 / 6  # supervised 2, 5, 5, 7, 9, 3: four of six in the head's vocabulary
    assert kept.summary == {"draft_vocab_size": 4, "draft_vocab_coverage": 4 / 6,
                            "draft_vocab_source": f"draft.init_from={ckpt}"}
    assert kept.manifest["draft_vocab"]["size"] == 4 and kept.manifest["draft_vocab"]["source"] == f"draft.init_from={ckpt}"
    with pytest.raises(ConfigError) as e:  # a head made for a larger target: one line, before any weight is loaded
        with_draft_ids(data, torch.tensor([2, 130]), 128, "draft.init_from=x")
    assert str(e.value) == ("draft.init_from=x: its draft vocabulary holds target ids up to 130, beyond this target's "
                            "vocabulary of 128. Fix: target.path = the target the head was trained for, or "
                            "data.draft_vocab_from_head=false.")
    cfg = default_config()
    cfg.data.draft_vocab_from_head = True
    assert [p for p in config_problems(cfg) if "draft_vocab_from_head" in p] == [
        "data.draft_vocab_from_head=true keeps the draft vocabulary of the head draft.init_from names, but "
        "draft.init_from is not set. Fix: draft.init_from=<checkpoint, export or hub id>, or "
        "data.draft_vocab_from_head=false to build the vocabulary from the data."]
    cfg.draft.init_from = str(ckpt)
    assert not [p for p in config_problems(cfg) if "draft_vocab_from_head" in p]
