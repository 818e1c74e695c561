"""Compute precision for the frozen target and the draft head: `precision: auto | fp32 | bf16`.

One resolver for training and decoding. `auto` picks bf16 where the hardware multiplies bf16
natively (CUDA with bf16 support; CPUs with Intel AMX or AVX512-BF16) and fp32 elsewhere. Master
weights, optimizer state, losses and metrics always stay fp32; `precision` only decides the dtype
of the target's forward and of the draft's autocast region.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import Precision  # the `precision` key: auto | fp32 | bf16

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedPrecision:
    """What `resolve_precision` chose: `dtype` (torch.float32 or torch.bfloat16), `name`
    ("fp32" | "bf16"), the `setting` it came from and the `reason` (the hardware feature found, or
    "forced"). `as_dict()` is what run.json records."""

    dtype: torch.dtype
    name: str
    setting: str
    reason: str

    @property
    def is_bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    def as_dict(self) -> dict:
        return {"precision": self.name, "setting": self.setting, "reason": self.reason}


def cpu_bf16_units(cpuinfo: str | None = None) -> str | None:
    """The native bf16 matrix unit of this CPU: "amx" (Intel AMX, flag amx_bf16), "avx512_bf16"
    (AVX512-BF16, e.g. AMD Zen 4 / Intel Cooper Lake), or None. Reads /proc/cpuinfo's flags (or the
    text given); None where that file does not exist."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.is_file():
            return None
        cpuinfo = path.read_text(errors="replace")
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return None


def resolve_precision(setting: str | Precision, device: torch.device | str) -> ResolvedPrecision:
    """Resolve `precision` for `device`.

    auto: bf16 on CUDA when `torch.cuda.is_bf16_supported()`, bf16 on a CPU with AMX or
    AVX512-BF16 (`cpu_bf16_units`), fp32 otherwise. fp32 / bf16: forced.

    Raises:
        ValueError: an unknown setting (names the valid ones), or bf16 forced on a CUDA device
            without bf16 support (fix: precision=fp32).
    """
    try:
        setting = Precision(str(setting))
    except ValueError:
        raise ValueError(f"precision={setting!r} is not one of auto, fp32, bf16") from None
    device = torch.device(device)
    if device.type == "cuda":
        has = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        unit = "cuda bf16" if has else None
    else:
        unit = cpu_bf16_units()
    if setting is Precision.fp32:
        return ResolvedPrecision(torch.float32, "fp32", setting.value, "forced")
    if setting is Precision.bf16:
        if device.type == "cuda" and unit is None:
            raise ValueError("precision=bf16: this GPU has no bf16. Fix: precision=fp32")
        return ResolvedPrecision(torch.bfloat16, "bf16", setting.value, "forced")
    if unit is None:
        return ResolvedPrecision(torch.float32, "fp32", setting.value,
                                 f"no native bf16 unit on this {device.type}")
    return ResolvedPrecision(torch.bfloat16, "bf16", setting.value, unit)


def log_precision(resolved: ResolvedPrecision) -> None:
    """Log the choice once, e.g. "precision: bf16 (auto: avx512_bf16)"."""
    logger.info("precision: %s (%s: %s)", resolved.name, resolved.setting, resolved.reason)


def detected_unit(device: torch.device | str) -> str | None:
    """The bf16 unit found on `device` whatever the setting: "cuda bf16", "amx", "avx512_bf16" or None."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    return cpu_bf16_units()


def target_weight_dtype(explicit: str | None) -> torch.dtype:
    """The frozen target's weight *storage* dtype, `target.dtype` (a memory setting, not a compute
    one): null = float32; bfloat16 | float16 halve a large target's memory. The target's compute
    follows `precision` (bf16 autocast over its forward in training), so with fp32 weights
    evaluation and decoding after training still run the exact fp32 target. Raises ValueError for
    another name."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if not explicit:
        return torch.float32
    if explicit not in names:
        raise ValueError(f"target.dtype={explicit!r} must be null (float32) or one of {sorted(names)}")
    return names[explicit]


def precision_record(resolved: ResolvedPrecision, device, target_weights: torch.dtype | None = None,
                     draft: ResolvedPrecision | None = None) -> dict:
    """What run.json records: the choice (its name is the target forward's compute precision), its
    setting and reason, the bf16 unit detected on `device`, the target's weight dtype and the
    draft's autocast precision."""
    rec = {**resolved.as_dict(), "device": torch.device(device).type, "bf16_unit": detected_unit(device)}
    if target_weights is not None:
        rec["target_weights"] = str(target_weights).removeprefix("torch.")
    if draft is not None:
        rec["draft_autocast"] = draft.name
    return rec


def autocast_context(precision, device: torch.device):
    """torch.autocast for the compute precision on `device`: a `ResolvedPrecision` or a setting
    (auto | fp32 | bf16, resolved with `resolve_precision`; None = fp32). bf16 runs matmuls and
    attention in bfloat16 on CUDA and on CPU; weights, optimizer state, the KL loss (algorithms/loss.py
    casts logits to fp32) and metrics stay fp32. Raises ValueError for another value, or bf16 on a
    CUDA device without bf16 support."""
    import contextlib

    if not isinstance(precision, ResolvedPrecision):
        precision = resolve_precision(precision or "fp32", device)
    if not precision.is_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
