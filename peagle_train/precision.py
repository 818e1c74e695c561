"""Compute precision for the frozen target and the draft head: `precision: auto | fp32 | bf16`.

One resolver for training and decoding, called once per command, at its start (`peagle train`, its
dry run, `peagle evaluate`, `peagle features`, `peagle regenerate` with vLLM): the `ResolvedPrecision`
it returns is what the trainer, the evaluation, the feature pass and the vLLM jobs are handed.
`auto` picks bf16 where the hardware multiplies bf16 natively (CUDA with bf16 support; CPUs with
Intel AMX or AVX512-BF16) and fp32 elsewhere. Master weights, optimizer state, losses and metrics
always stay fp32; `precision` only decides the dtype of the target's forward and of the draft's
autocast region. `DTYPE_NAMES` is the package's one table of dtype names (`dtype_of`, `dtype_name`,
`short_name`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import Precision  # the `precision` key: auto | fp32 | bf16
from .errors import ConfigError

logger = logging.getLogger(__name__)

# The package's one dtype-name table: torch dtype → (its name in the configs, which is also vLLM's
# `dtype`; its short precision name). Every name ↔ dtype conversion goes through it
# (tests/unit/test_layout.py keeps it the only one).
DTYPE_NAMES = {torch.float32: ("float32", "fp32"), torch.bfloat16: ("bfloat16", "bf16"),
               torch.float16: ("float16", "fp16")}


def dtype_of(name: str | None, key: str = "dtype") -> torch.dtype:
    """The torch dtype of a config name: float32 | bfloat16 | float16 (None = float32, the default
    of `target.dtype`). Raises ConfigError (a ValueError) naming `key`, the value and the accepted names."""
    if not name:
        return torch.float32
    by_name = {config_name: dtype for dtype, (config_name, _) in DTYPE_NAMES.items()}
    if str(name) not in by_name:
        raise ConfigError(f"{key}={str(name)!r} must be null (float32) or one of {sorted(by_name)}")
    return by_name[str(name)]


def dtype_name(dtype: torch.dtype) -> str:
    """The config (and vLLM) name of a torch dtype: "float32" | "bfloat16" | "float16"; another
    dtype: str(dtype) without "torch."."""
    return DTYPE_NAMES[dtype][0] if dtype in DTYPE_NAMES else str(dtype).removeprefix("torch.")


def short_name(dtype: torch.dtype) -> str:
    """The short precision name of a torch dtype: "fp32" | "bf16" | "fp16"; another dtype: str(dtype)."""
    return DTYPE_NAMES[dtype][1] if dtype in DTYPE_NAMES else str(dtype)


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

    @property
    def dtype_name(self) -> str:
        """The dtype's config name, which vLLM's `dtype` takes too: "float32" | "bfloat16"."""
        return dtype_name(self.dtype)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype of the loop's autocast region: torch.bfloat16 under bf16, None (no autocast) for fp32."""
        return torch.bfloat16 if self.is_bf16 else None

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


def as_resolved(precision: ResolvedPrecision | str | Precision | None, device) -> ResolvedPrecision:
    """`precision` as a ResolvedPrecision: one already resolved (what a command resolved at its start)
    is returned as it is; a setting auto | fp32 | bf16 (None = fp32), as a caller that holds only the
    setting passes it (a test, a script), is resolved on `device` (`resolve_precision`, whose errors it raises)."""
    if isinstance(precision, ResolvedPrecision):
        return precision
    return resolve_precision(precision or "fp32", device)


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
    evaluation and decoding after training still run the exact fp32 target. Raises ConfigError (a
    ValueError) for another name (`dtype_of`)."""
    return dtype_of(explicit, "target.dtype")


def precision_record(resolved: ResolvedPrecision, device, target_weights: torch.dtype | None = None,
                     draft: ResolvedPrecision | None = None) -> dict:
    """What run.json records: the choice (its name is the target forward's compute precision), its
    setting and reason, the bf16 unit detected on `device`, the target's weight dtype and the
    draft's autocast precision."""
    rec = {**resolved.as_dict(), "device": torch.device(device).type, "bf16_unit": detected_unit(device)}
    if target_weights is not None:
        rec["target_weights"] = dtype_name(target_weights)
    if draft is not None:
        rec["draft_autocast"] = draft.name
    return rec


def autocast_context(precision, device: torch.device):
    """torch.autocast for the compute precision on `device`: a `ResolvedPrecision` or a setting
    (auto | fp32 | bf16, resolved with `as_resolved`; None = fp32). bf16 runs matmuls and
    attention in bfloat16 on CUDA and on CPU; weights, optimizer state, the KL loss (algorithms/loss.py
    casts logits to fp32) and metrics stay fp32. Raises ValueError for another value, or bf16 on a
    CUDA device without bf16 support."""
    import contextlib

    precision = as_resolved(precision, device)
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.autocast_dtype)
