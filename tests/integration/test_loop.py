"""The training loop end to end on a tiny target, for both algorithms, and checkpoint round trips."""

import json

import datasets
import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from peagle_train.data.vocab import DraftVocab
from peagle_train.draft.peagle import Eagle3Draft, PEagleDraft
from peagle_train.export.speculators import validate_export, write_export
from peagle_train.draft.head_files import load_export
from peagle_train.jobs.builders import build_draft
from peagle_train.config import default_config
from peagle_train.target.capture import FeatureTarget
from peagle_train.draft.head_files import load_checkpoint, save_checkpoint
from peagle_train.training.checks import TrainSettings
from peagle_train.training.trainer import train


def tiny_rows(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 120, (int(torch.randint(20, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    masks = [[0] * 5 + [1] * (len(x) - 5) for x in ids]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_train_loop_runs_and_learns(tmp_path, target_model, algorithm):
    t = FeatureTarget(target_model)
    vocab = DraftVocab.from_ids(torch.arange(0, 128, 2), 128)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 3, "norm_before_fc": algorithm == "peagle",
                             "fc_norm": False,  # vLLM does not load fc_norm: exports refuse it (test_aux_numbering.py)
                             "norm_before_residual": False,
                             "gradient_checkpointing": False})
    draft = build_draft(t, dcfg, vocab, 127, algorithm)
    assert type(draft) is (Eagle3Draft if algorithm == "eagle3" else PEagleDraft)
    train_cfg = TrainSettings(OmegaConf.merge(default_config().training,
                                              {"tokens_per_step": 64, "epochs": 4, "lr": 3e-3, "warmup_steps": 2,
                                               "max_anchors": 16}), draft=dcfg, algorithm=algorithm, seed=0)
    res = train(Accelerator(cpu=True), draft, t, tiny_rows(), vocab.draft_ids, train_cfg, tmp_path)
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == res["steps"] > 10
    assert all(len(r["acc"]) == 3 for r in log)
    first, last = sum(r["loss"] for r in log[:3]) / 3, sum(r["loss"] for r in log[-3:]) / 3
    assert last < 0.8 * first
    ckpt = save_checkpoint(res["draft"], tmp_path / "ckpt")
    back, _ = load_checkpoint(ckpt)
    assert type(back) is type(res["draft"])
    for k, v in res["draft"].state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    exp = write_export(back, tmp_path / "export", verifier_name_or_path="tiny", verifier_architectures=["LlamaForCausalLM"])
    cfg = json.loads((exp / "config.json").read_text())
    assert cfg["speculators_model_type"] == algorithm
    assert ("mask_token_id" in cfg) == (algorithm == "peagle")
    validate_export(exp, reference=back)
    assert type(load_export(exp)) is type(back)
