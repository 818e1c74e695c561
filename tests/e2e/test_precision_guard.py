"""Quality guard for `precision: bf16`: a small real run (SmolLM2-135M-Instruct, ShareGPT) trained
with the same data, seed and steps in fp32 and in bf16 (the target's forward and the draft under
bf16 autocast; master weights, optimizer state and the KL loss in fp32) reaches the same
validation EAL within 1% relative. On a CPU without a bf16 unit the bf16 run's matrix products are
fp32 GEMMs of the bf16 operands rounded to bf16 once, a bf16 unit's numbers (tests/bf16_unit.py), in
place of PyTorch's emulated bf16 GEMM."""

import contextlib
import json

import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from peagle_train.data.prepare import prepare_data
from peagle_train.jobs.builders import build_draft, build_target
from peagle_train.config import default_config
from peagle_train.paths import resolve_path
from peagle_train.training.checks import TrainSettings
from peagle_train.training.trainer import train
from tests.bf16_unit import bf16_as_on_a_unit_without_one

pytestmark = pytest.mark.real


def test_bf16_and_fp32_runs_reach_the_same_validation_eal(tmp_path):
    torch.set_num_threads(1)
    cfg = default_config()
    target, tok = build_target(cfg.target, "cpu")  # fp32 weights
    data = prepare_data(resolve_path(cfg.data.path), tok, target.config.vocab_size, num_conversations=48,
                        max_length=256, min_supervised_tokens=16, draft_vocab_size=2048, seed=0)
    results = {}
    for name in ("fp32", "bf16"):  # bf16: the target's forward and the draft under bf16 autocast
        torch.manual_seed(0)
        draft = build_draft(target, cfg.draft, data.vocab, data.mask_token_id)  # same fp32 init for both
        train_cfg = TrainSettings.from_config(cfg, seed=0, algorithm="peagle", precision=name, training=OmegaConf.merge(
            cfg.training, {"tokens_per_step": 1024, "max_steps": 9, "warmup_steps": 4,
            "lr": 3e-4,  # 5e-4 spikes at steps 4-5 on the aux states [2, 15, 27] (vLLM's numbering) and the
            # two runs then part by chance: val loss 3.8% apart (0.2% at 3e-4; 0.1% at 5e-4 on [3, 16, 28])
            "val_conversations": 12, "save_every": 9}))
        with bf16_as_on_a_unit_without_one() if name == "bf16" else contextlib.nullcontext():
            res = train(Accelerator(cpu=True), draft, target, data.rows, data.vocab.draft_ids, train_cfg, tmp_path / name)
        assert res["precision"] == name and res["steps"] == 9
        assert all(p.dtype == torch.float32 for p in res["draft"].parameters())  # master weights stay fp32
        results[name] = res["validation"]
    print(json.dumps(results))
    e32, e16 = results["fp32"]["val_eal"], results["bf16"]["val_eal"]
    assert e32 > 1.04  # the head learned something (an untrained head sits at ≈ 1.0)
    assert abs(e16 - e32) <= 0.01 * e32, (e16, e32)
    # bf16 changes the numbers (target features and logits, draft matmuls), not the result
    assert results["bf16"]["val_loss"] != results["fp32"]["val_loss"]
    assert results["bf16"]["val_loss"] == pytest.approx(results["fp32"]["val_loss"], rel=0.02)
