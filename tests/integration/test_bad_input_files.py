"""Faults outside the data: a cut-off or corrupted checkpoint or export, a config missing a key, a
full disk while writing feature shards. Each gives an error naming the file and the fix."""

import errno
import json

import datasets
import pytest
import torch
from accelerate import Accelerator

import peagle_train.features.shards as offline
from peagle_train.errors import CorruptFileError, UserError
from peagle_train.export.speculators import ExportError, write_export
from peagle_train.draft.head_files import load_export
from peagle_train.target.capture import FeatureTarget
from peagle_train.features.shards import OfflineFeatures
from peagle_train.features.shards import FeatureShardError, write_features
from peagle_train.training.checkpoint import check_output_dir, load_training_checkpoint, save_training_checkpoint
from peagle_train.training.engines import DDPEngine
from peagle_train.draft.head_files import load_checkpoint, save_checkpoint

from ..unit.test_decoding import make_draft


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def draft(target_model):
    return make_draft(target_model, torch.arange(0, 128, 2), K=3, layers=1)[1]


def cut(path, keep: float = 0.5):
    b = path.read_bytes()
    path.write_bytes(b[: int(len(b) * keep)])


def test_cut_checkpoint_or_missing_key_names_the_file(tmp_path, draft):
    ckpt = save_checkpoint(draft, tmp_path / "run" / "checkpoint")
    assert load_checkpoint(ckpt)[0].config == draft.config
    cut(ckpt / "model.safetensors")
    with pytest.raises(CorruptFileError, match=r"checkpoint/model\.safetensors: cannot read the draft weights .*"
                                               r"the file is cut off or corrupted\. Fix: re-save the checkpoint"):
        load_checkpoint(ckpt)
    ckpt = save_checkpoint(draft, tmp_path / "run2" / "checkpoint")
    meta = json.loads((ckpt / "draft_config.json").read_text())
    del meta["draft"]["hidden_size"]
    (ckpt / "draft_config.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptFileError, match=r"draft_config\.json: the 'draft' entry does not describe a head "
                                               r"\(missing 1 required keyword-only argument: 'hidden_size'\)"):
        load_checkpoint(ckpt)
    (ckpt / "draft_config.json").write_text('{"draft": {"vocab')
    with pytest.raises(CorruptFileError, match=r"draft_config\.json: the draft config is not valid JSON"):
        load_checkpoint(ckpt)


def test_cut_export_or_missing_key_names_the_file(tmp_path, draft):
    out = write_export(draft, tmp_path / "export", verifier_name_or_path="tiny", verifier_architectures=["X"],
                       dtype=torch.float32)
    assert torch.equal(load_export(out).fc.weight, draft.fc.weight)
    cfg = json.loads((out / "config.json").read_text())
    broken = dict(cfg)
    del broken["transformer_layer_config"]
    (out / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ExportError, match=r"export/config\.json: a required key is missing or malformed "
                                          r"\(KeyError: 'transformer_layer_config'\)\. Fix: re-export it"):
        load_export(out)
    (out / "config.json").write_text(json.dumps(cfg))
    cut(out / "model.safetensors", 0.3)
    with pytest.raises(CorruptFileError, match=r"export/model\.safetensors: cannot read the export weights"):
        load_export(out)
    from peagle_train.export.speculators import validate_export

    with pytest.raises(ExportError, match=r"model\.safetensors: cannot read the export weights"):
        validate_export(out)


def test_resume_from_a_damaged_checkpoint_names_the_file_and_the_fallback(tmp_path, draft):
    acc = Accelerator(cpu=True)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gen = torch.Generator().manual_seed(0)
    root, fp = tmp_path / "checkpoints", {"training.lr": 1e-3}
    for step in (1, 2):
        last = save_training_checkpoint(acc, root, step, draft, DDPEngine(draft, opt, acc, None), sched, {"step": step}, gen, fp, keep_last=None)
    assert load_training_checkpoint(acc, last, DDPEngine(draft, opt, acc, None), sched, gen)["step"] == 2
    good = (last / "model.safetensors").read_bytes()
    cut(last / "model.safetensors")
    with pytest.raises(CorruptFileError, match=r"step_000002/model\.safetensors: cannot read the draft weights .*"
                                               r"Fix: delete .*step_000002 and resume again \(from the previous "
                                               r"checkpoint step_000001\)"):
        load_training_checkpoint(acc, last, DDPEngine(draft, opt, acc, None), sched, gen)
    (last / "model.safetensors").write_bytes(good)
    cut(last / "state.pt")
    with pytest.raises(CorruptFileError, match=r"step_000002/state\.pt: cannot read the training state"):
        load_training_checkpoint(acc, last, DDPEngine(draft, opt, acc, None), sched, gen)
    (last / "fingerprint.json").write_text('{"training.lr": ')
    with pytest.raises(CorruptFileError, match=r"step_000002/fingerprint\.json: the checkpoint fingerprint is not "
                                               r"valid JSON"):
        check_output_dir(root, True, fp)


def test_full_disk_keeps_finished_shards_and_says_how_to_resume(tmp_path, target_model, chatml_tokenizer,
                                                                monkeypatch):
    t = FeatureTarget(target_model, [1, 3, 5])
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 120, (16,), generator=g).tolist() for _ in range(7)]
    data = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * 4 + [1] * 12] * 7})
    real_save, calls = offline.save_file, []

    def full_disk(tensors, path):
        calls.append(path)
        if len(calls) == 2:  # the disk fills while the second shard is written
            open(path, "wb").write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(offline, "save_file", full_disk)
    d = tmp_path / "feats"
    with pytest.raises(FeatureShardError, match=r"writing .*shard-00001\.safetensors failed \(No space left on device\); "
                                                r"the 1 shards recorded in .*manifest\.json are complete and verified.*"
                                                r"rerun the same command: it resumes at this shard"):
        write_features(t, chatml_tokenizer, data, d, storage="float32", docs_per_shard=3)
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "shard-00000.safetensors"]  # no temp file left
    manifest = json.loads((d / "manifest.json").read_text())
    assert list(manifest["shards"]) == ["0"] and offline._shard_is_complete(d, manifest, 0)
    monkeypatch.setattr(offline, "save_file", real_save)
    s = write_features(t, chatml_tokenizer, data, d, storage="float32", docs_per_shard=3)
    assert (s["shards_written"], s["shards_skipped"]) == (2, 1)
    OfflineFeatures(d, t, chatml_tokenizer, data)  # complete and verified


def test_feature_shard_errors_are_user_errors():
    assert issubclass(FeatureShardError, UserError) and issubclass(ExportError, UserError)


def test_resume_of_a_checkpoint_written_before_a_key_existed(tmp_path):
    """A key added to the schema since a checkpoint was written is the same run when its value is
    the key's default (what the earlier code did), and a different run otherwise, named."""
    from peagle_train.errors import ConfigError
    from peagle_train.training.checkpoint import fingerprint_defaults

    root = tmp_path / "checkpoints"
    old = {"training.lr": 1e-3, "draft.num_hidden_layers": 2}  # written before draft.block_causal existed
    (root / "step_000096").mkdir(parents=True)
    (root / "step_000096" / "fingerprint.json").write_text(json.dumps(old))
    (root / "step_000096" / "state.pt").write_bytes(b"")  # a complete checkpoint holds one
    assert fingerprint_defaults()["draft.block_causal"] is False
    assert check_output_dir(root, True, {**old, "draft.block_causal": False}) == root / "step_000096"
    with pytest.raises(ConfigError, match=r"different config \(draft\.block_causal: '<absent>' → True\)"):
        check_output_dir(root, True, {**old, "draft.block_causal": True})
    with pytest.raises(ConfigError, match=r"training\.lr: 0\.001 → 0\.002"):
        check_output_dir(root, True, {**old, "training.lr": 2e-3, "draft.block_causal": False})
    with pytest.raises(ConfigError, match=r"draft\.not_a_key: '<absent>' → 1"):  # no default known: differs
        check_output_dir(root, True, {**old, "draft.not_a_key": 1})
