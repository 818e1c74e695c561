"""How `precision` reaches training: the target's weight dtype, the draft's autocast (with the
older `target.dtype` / `training.mixed_precision` keys still honoured), the target forward's
autocast inside the trainer, and the run.json record."""

import pytest
import torch

from peagle_train import precision as P
from peagle_train.precision import autocast_context


def test_target_weights_stay_float32_unless_set():
    assert P.target_weight_dtype(None) == torch.float32  # compute follows precision, weights do not
    assert P.target_weight_dtype("bfloat16") == torch.bfloat16  # the explicit older key wins
    assert P.target_weight_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="target.dtype='half'"):
        P.target_weight_dtype("half")


def test_draft_precision_and_the_older_mixed_precision_key(monkeypatch):
    monkeypatch.setattr(P, "cpu_bf16_units", lambda: "avx512_bf16")
    assert P.draft_precision("auto", None, "cpu").name == "bf16"
    assert P.draft_precision(None, None, "cpu").name == "fp32"  # callers that never set it: as before
    assert P.draft_precision("bf16", "no", "cpu").name == "fp32"  # mixed_precision=no forces fp32
    assert P.draft_precision("fp32", "bf16", "cpu").name == "bf16"
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        P.draft_precision("auto", "fp16", "cpu")
    monkeypatch.setattr(P, "cpu_bf16_units", lambda: None)
    assert P.draft_precision("auto", None, "cpu").name == "fp32"


def test_autocast_runs_the_draft_matmuls_in_bf16_and_keeps_fp32_elsewhere():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    for setting, dtype in (("bf16", torch.bfloat16), (P.resolve_precision("bf16", "cpu"), torch.bfloat16),
                           ("fp32", torch.float32), ("no", torch.float32)):
        with autocast_context(setting, torch.device("cpu")):
            y = lin(x)
        assert y.dtype == dtype, setting
    assert lin.weight.dtype == torch.float32  # master weights untouched
    with pytest.raises(ValueError, match="not one of auto, fp32, bf16"):
        autocast_context("fp16", torch.device("cpu"))


def test_precision_record_names_the_unit_and_dtypes(monkeypatch):
    monkeypatch.setattr(P, "cpu_bf16_units", lambda: "avx512_bf16")
    r = P.resolve_precision("fp32", "cpu")
    rec = P.precision_record(r, "cpu", torch.float32, P.resolve_precision("fp32", "cpu"))
    assert rec == {"precision": "fp32", "setting": "fp32", "reason": "forced", "device": "cpu",
                   "bf16_unit": "avx512_bf16", "target_weights": "float32", "draft_autocast": "fp32"}
