"""`precision: auto | fp32 | bf16` resolution (peagle_train/precision.py)."""

import pytest
import torch

from peagle_train import precision as P


def test_cpu_bf16_units_reads_the_flags_line():
    assert P.cpu_bf16_units("processor : 0\nflags : fpu sse avx512f amx_bf16 amx_tile\n") == "amx"
    assert P.cpu_bf16_units("flags : fpu avx512f avx512_bf16\n") == "avx512_bf16"
    assert P.cpu_bf16_units("flags : fpu sse avx2\n") is None
    # only the first flags line counts, and a name that merely contains the flag does not
    assert P.cpu_bf16_units("flags : avx2 xamx_bf16x\nflags : amx_bf16\n") is None


def test_auto_follows_the_cpu_and_forced_settings_win(monkeypatch):
    monkeypatch.setattr(P, "cpu_bf16_units", lambda: "amx")
    r = P.resolve_precision("auto", "cpu")
    assert (r.dtype, r.name, r.reason) == (torch.bfloat16, "bf16", "amx")
    assert r.as_dict() == {"precision": "bf16", "setting": "auto", "reason": "amx"}
    assert P.resolve_precision("fp32", "cpu").dtype == torch.float32
    monkeypatch.setattr(P, "cpu_bf16_units", lambda: None)
    r = P.resolve_precision(P.Precision.auto, "cpu")
    assert (r.dtype, r.name) == (torch.float32, "fp32")
    assert P.resolve_precision("bf16", "cpu").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not one of auto, fp32, bf16"):
        P.resolve_precision("half", "cpu")
