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
from peagle_train.errors import ConfigError
from peagle_train.export.speculators import write_export
from peagle_train.jobs.builders import build_draft
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
