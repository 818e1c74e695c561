"""bf16 linear layers and attention on Intel AMX tiles for decoding's row counts
(csrc/amx_linear.cpp, csrc/amx_attention.cpp).

A decoding forward multiplies 1 to K+1 rows per sequence by every weight of the model, so it is
bound by reading the weights. oneDNN's bf16 kernels reach that bound only part of the time at
these shapes, and their time varies from one run to the next (docs/BENCHMARKS.md, "Decoding
matrix products"). This kernel packs every weight once in the AMX
(VNNI) layout and multiplies each group of 64 output features by up to 16 rows per tile, with
fp32 accumulation and one rounding to bf16, like oneDNN's AMX kernel (the outputs are
bit-identical to `F.linear`'s at decoding shapes, tests/unit/test_packed_linear.py). Every output row
depends on its own input row only, in the same order whatever the number of rows, so a 1-row
target step and a (K+1)-row verify round each token identically.

`amx_attention` is the decoding attention of a bf16 target over a bf16 cache (see its
docstring; attention.py hooks it into transformers' attention interface): q·k on the tiles, softmax and the weighted sum in fp32, every query independent of the
others, of the batch and of masked slots.

The kernels split their work over torch's threads with OpenMP (`-fopenmp`; without it
`at::parallel_for` runs on one thread). The extension (with csrc/amx_norm.cpp's RMSNorm and rotary
embedding) is compiled with torch.utils.cpp_extension at first use (≈ 1 min, cached under
TORCH_EXTENSIONS_DIR, rebuilt when the source changes). Where the CPU has no AMX, no compiler is
found, or PEAGLE_AMX=0 is set, `kernel()` returns None and `PackedLinear` keeps oneDNN.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "amx_linear.cpp"
SOURCES = [SOURCE, SOURCE.with_name("amx_attention.cpp"), SOURCE.with_name("amx_norm.cpp")]  # one extension
# up to this many rows per call the AMX kernel is faster than oneDNN on the 2-core Xeon (a batch
# of 16 verifying K = 5 drafts is 96 rows; docs/BENCHMARKS.md); above (prefill) oneDNN's blocking
# wins. Every input within the limit then rounds as it would alone (row-invariance).
MAX_ROWS = 96
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp"]
_state: dict = {}


def kernel():
    """The compiled extension (functions `pack(weight [N, K] bf16) -> packed`,
    `linear(x [..., K] bf16, packed, N, bias [N] | None) -> [..., N] bf16`, `attention` (see
    `amx_attention`), and `rms_norm` (see packed_linear.py `FusedRMSNorm`)), or None where AMX cannot be used (non-x86 or non-Linux, no amx_bf16 flag, PEAGLE_AMX=0, a failed build: logged
    once with the reason). Built once per process."""
    if "ext" in _state:
        return _state["ext"]
    _state["ext"] = None
    from ...precision import cpu_bf16_units

    if os.environ.get("PEAGLE_AMX", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or cpu_bf16_units() != "amx":
        return None
    try:
        from torch.utils.cpp_extension import load

        t0 = time.perf_counter()
        ext = load(name="peagle_amx", sources=[str(p) for p in SOURCES], extra_cflags=_FLAGS, verbose=False)
        if not ext.available():
            logger.warning("AMX kernels: the OS refused the AMX tile state; decoding keeps oneDNN and the fp32 attention")
            return None
        logger.info("AMX kernels ready (linears, attention, RMSNorm; %.1f s: compiled once per machine, then cached)", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - no compiler, headers or ninja: decoding still works
        logger.warning("AMX kernels not built (%s: %s); decoding keeps oneDNN and the fp32 attention. Fix: install a C++ compiler "
                       "(g++ >= 11) and ninja (pip install 'peagle-train[cpu-kernels]'), or set PEAGLE_AMX=0 to silence this.", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    _state["ext"] = ext
    return ext


def amx_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] bf16 (CPU) times the weight that `kernel().pack` packed, plus bias [N] →
    [..., out_features] bf16. Raises RuntimeError when the kernel is unavailable or the shapes do
    not match the packed weight."""
    ext = kernel()
    if ext is None:
        raise RuntimeError("the AMX linear kernel is not available on this machine")
    return ext.linear(x, packed, out_features, bias)


_lane_masks: list = []  # (mask, its version, queries per kv head, lane mask): one entry, reused by every layer


def _lane_mask(mask: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """The kernel's per-lane visibility [Bm, chunks, S, 16] uint8 from a bool mask [Bm, 1, n, S]:
    lane l of chunk c is query slot (16 c + l) mod n of its kv head's `rows` = g·n queries. Built
    once per forward (every layer gets the same mask object)."""
    if _lane_masks:
        m, version, r, lanes = _lane_masks[0]
        if m is mask and version == mask._version and r == rows:
            return lanes
    chunks = (rows + 15) // 16
    idx = torch.arange(chunks * 16, device=mask.device) % n
    lanes = mask[:, 0][:, idx].view(mask.shape[0], chunks, 16, -1).transpose(2, 3).contiguous().view(torch.uint8)
    _lane_masks[:] = [(mask, mask._version, rows, lanes)]
    return lanes


def amx_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """softmax(q·kᵀ · scale + mask) · v for a bf16 decoding forward on AMX (csrc/amx_attention.cpp).

    query [B, H, n, d]; key, value [B, kv_heads, S, d] (bf16, last dim contiguous; views of a
    preallocated cache are read in place); mask None (causal: new slot i sees slots ≤ S − n + i)
    or bool [B|1, 1, n, S] (True = attend). d a multiple of 32 up to 256, H a multiple of kv_heads.
    Returns [B, n, H, d] bf16. q·k is accumulated in fp32 in the AMX tiles, the softmax and the
    weighted sum of values run in fp32, the output is rounded once. Each query's output depends
    only on its query and on the slots it sees, in slot order (not on n, the batch or masked slots
    between them): the row-invariance that makes bf16 speculative decoding reproduce the target
    alone. A query that sees no slot gets zeros. Raises RuntimeError without the kernel or on
    shapes it does not take."""
    ext = kernel()
    if ext is None:
        raise RuntimeError("the AMX kernels are not available on this machine")
    H, n = query.shape[1], query.shape[2]
    rows = H // key.shape[1] * n
    lanes = _lane_mask(mask, rows, n) if mask is not None else torch.empty(0, dtype=torch.uint8)
    return ext.attention(query, key, value, lanes, float(scale))
