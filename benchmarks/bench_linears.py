"""Benchmark of the decoding forward's matrix products: the 211 linear layers of SmolLM2-135M-Instruct
(30 layers × q, k, v, o, gate, up, down, and the 49,152-row lm_head) applied to 1 row (a
target-alone step), 6 rows (a K = 5 verify), 16 rows (a batch of 16 target-alone steps) and 96
rows (a batch of 16 verifying K = 5 drafts): fp32
`F.linear` (MKL); bf16 `PackedLinear` on oneDNN's kernels (weights packed once), free to use every
ISA of the CPU and, in a second process, capped at AVX512-BF16 (`ONEDNN_MAX_CPU_ISA=
AVX512_CORE_BF16`, i.e. no AMX); and, on a CPU with AMX, bf16 `PackedLinear` on this project's
AMX kernel (accel/cpu/amx_linear.py), as `peagle evaluate` decodes.

    python benchmarks/bench_linears.py [--repeats 10] [--threads 1] [--out FILE | --no-docs]

Random weights of the target's shapes (no model loaded); ms = one pass over the 211 layers, the
median of --repeats passes after 3 warm-ups, the kernels taking turns pass by pass (a shared
machine's load hits all alike). The ISA cap is read by oneDNN once per process, so each setting
runs in its own subprocess. Prints a table and writes it into docs/BENCHMARKS.md under its own
heading, with CPU model, bf16 unit, load and the weights' bytes per pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_tables import bench_arguments, cpu_model, publish
from peagle_train.precision import cpu_bf16_units

REPO = Path(__file__).resolve().parent.parent
HEADING = "## Decoding matrix products: fp32, oneDNN and the AMX kernel (benchmarks/bench_linears.py)"
H, INTER, VOCAB, KV = 576, 1536, 49152, 192  # SmolLM2-135M: hidden, MLP, vocabulary, kv heads × head_dim
SHAPES = [(H, H), (KV, H), (KV, H), (H, H), (INTER, H), (INTER, H), (H, INTER)] * 30 + [(VOCAB, H)]
ISAS = (None, "AVX512_CORE_BF16")  # oneDNN free to use every ISA; capped at AVX512-BF16 (no AMX)


ROWS = (1, 6, 16, 96)
READ_MB = 256


def read_gbs(threads: int) -> float:
    """The memory's streaming read speed (GB/s, best of 5 sums over READ_MB of fp32): the floor
    under a kernel that reads its weights once."""
    torch.set_num_threads(threads)
    x = torch.randn(READ_MB * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def measure(repeats: int, threads: int) -> dict[str, float]:
    """Median ms per pass over SHAPES, keyed "<kernel>/<rows>" for kernels fp32, onednn and (with
    AMX) amx."""
    from peagle_train.accel.cpu.packed_linear import PackedLinear

    torch.set_num_threads(threads)
    kernels = {"fp32": [torch.nn.Linear(i, o, bias=False) for o, i in SHAPES]}
    bf16 = [torch.nn.Linear(i, o, bias=False).to(torch.bfloat16) for o, i in SHAPES]
    kernels["amx"] = [PackedLinear(lin) for lin in bf16]
    kernels["onednn"] = [PackedLinear(lin) for lin in bf16]
    for lin in kernels["onednn"]:
        lin.amx = None
    if kernels["amx"][0].amx is None:
        del kernels["amx"]
    out = {}
    with torch.no_grad():
        for rows in ROWS:
            times = {k: [] for k in kernels}
            for r in range(3 + repeats):
                for k, lins in kernels.items():
                    dt = torch.float32 if k == "fp32" else torch.bfloat16
                    xs = {i: torch.randn(1, rows, i, dtype=dt) for _, i in SHAPES}
                    t0 = time.perf_counter()
                    for lin, (_, i) in zip(lins, SHAPES):
                        lin(xs[i])
                    if r >= 3:
                        times[k].append((time.perf_counter() - t0) * 1e3)
            for k, ts in times.items():
                out[f"{k}/{rows}"] = sorted(ts)[len(ts) // 2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_arguments(ap, REPO / "docs" / "BENCHMARKS.md")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one setting, JSON on stdout
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.repeats, args.threads)))
        return
    load0 = os.getloadavg()[0]
    rows = []
    for isa in ISAS:
        env = dict(os.environ)
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        if isa:
            env["ONEDNN_MAX_CPU_ISA"] = isa
        proc = subprocess.run([sys.executable, __file__, "--worker", "--repeats", str(args.repeats), "--threads",
                               str(args.threads)], env=env, capture_output=True, text=True, check=True)
        rows.append((isa, json.loads(proc.stdout.strip().splitlines()[-1])))
    mb = sum(o * i for o, i in SHAPES) * 2 / 1e6
    lines = [HEADING, "",
             f"SmolLM2-135M-Instruct's {len(SHAPES)} linear layers (random weights; {mb:.0f} MB in bf16), one pass, "
             f"median of {args.repeats}, kernels in turn; {cpu_model()} (bf16 unit: {cpu_bf16_units() or 'none'}), "
             f"{args.threads} torch thread(s), torch {torch.__version__}; load average {load0:.1f} before / "
             f"{os.getloadavg()[0]:.1f} after. Run: `python benchmarks/bench_linears.py --repeats {args.repeats} "
             f"--threads {args.threads}`. GB/s = the weights' bytes in the kernel's precision ÷ the 1-row time; a "
             f"{READ_MB} MB streaming read (`Tensor.sum`) ran at {read_gbs(args.threads):.1f} GB/s here.", "",
             "| kernel | " + " | ".join(f"{r} row{'s' * (r > 1)} (ms)" for r in ROWS) + " | 1-row GB/s | "
             "6 rows ÷ fastest 1 row |", "|---|" + "---|" * (len(ROWS) + 2)]
    names = {"fp32": "fp32 `F.linear` (MKL)", "onednn": "bf16 oneDNN, packed", "amx": "bf16 AMX kernel (ours)"}
    results = [(f"{names[k]}{'' if isa is None or k != 'onednn' else ', ISA capped at AVX512-BF16'}", k, r)
               for isa, r in rows for k in names if f"{k}/1" in r and (isa is None or k == "onednn")]
    fastest1 = min(r[f"{k}/1"] for _, k, r in results)
    for name, k, r in results:
        per = " | ".join(f"{r[f'{k}/{n}']:.1f}" for n in ROWS)
        gbs = mb / r[f"{k}/1"] * (2 if k == "fp32" else 1)
        lines.append(f"| {name} | {per} | {gbs:.1f} | {r[f'{k}/6'] / fastest1:.2f}× |")
    table = "\n".join(lines)
    publish(HEADING, table, args)


if __name__ == "__main__":
    main()
