"""Benchmark of the decoding forward's matrix products: the 211 linear layers of SmolLM2-135M-Instruct
(30 layers × q, k, v, o, gate, up, down, and the 49,152-row lm_head) applied to 1 row (a
target-alone step) and to 6 rows (a K = 5 verify), in fp32 (`F.linear`, MKL) and in bf16 through
`PackedLinear` (oneDNN, weights packed once), with oneDNN free to use every ISA of the CPU and,
in a second process, capped at AVX512-BF16 (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`, i.e. no AMX).

    python scripts/bench_linears.py [--repeats 10] [--threads 1] [--out FILE | --no-docs]

Random weights of the target's shapes (no model loaded); ms = one pass over the 211 layers, the
mean of --repeats passes after 3 warm-ups. The ISA cap is read by oneDNN once per process, so
each setting runs in its own subprocess. Prints a table and writes it into docs/BENCHMARKS.md
under its own heading, with CPU model, bf16 unit and load.
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

from peagle_train.benchmarks import bench_arguments, cpu_model, write_section
from peagle_train.precision import cpu_bf16_units

REPO = Path(__file__).resolve().parent.parent
HEADING = "## Decoding matrix products by precision and oneDNN ISA (scripts/bench_linears.py)"
H, INTER, VOCAB, KV = 576, 1536, 49152, 192  # SmolLM2-135M: hidden, MLP, vocabulary, kv heads × head_dim
SHAPES = [(H, H), (KV, H), (KV, H), (H, H), (INTER, H), (INTER, H), (H, INTER)] * 30 + [(VOCAB, H)]
ISAS = (("all (AMX where present)", None), ("capped at AVX512-BF16", "AVX512_CORE_BF16"))


def measure(repeats: int, threads: int) -> dict[str, float]:
    """ms per pass over SHAPES, keyed "fp32/1", "fp32/6", "bf16/1", "bf16/6" (precision/rows)."""
    from peagle_train.decoding.packed_linear import PackedLinear

    torch.set_num_threads(threads)
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        lins = [torch.nn.Linear(i, o, bias=False).to(dt) for o, i in SHAPES]
        if dt == torch.bfloat16:
            lins = [PackedLinear(lin) for lin in lins]
        for rows in (1, 6):
            xs = {i: torch.randn(1, rows, i, dtype=dt) for _, i in SHAPES}
            with torch.no_grad():
                for _ in range(3):
                    for lin, (_, i) in zip(lins, SHAPES):
                        lin(xs[i])
                t0 = time.perf_counter()
                for _ in range(repeats):
                    for lin, (_, i) in zip(lins, SHAPES):
                        lin(xs[i])
            out[f"{name}/{rows}"] = (time.perf_counter() - t0) / repeats * 1e3
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
    for label, isa in ISAS:
        env = dict(os.environ)
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        if isa:
            env["ONEDNN_MAX_CPU_ISA"] = isa
        proc = subprocess.run([sys.executable, __file__, "--worker", "--repeats", str(args.repeats), "--threads",
                               str(args.threads)], env=env, capture_output=True, text=True, check=True)
        rows.append((label, json.loads(proc.stdout.strip().splitlines()[-1])))
    lines = [HEADING, "",
             f"SmolLM2-135M-Instruct's {len(SHAPES)} linear layers (random weights), one pass, mean of {args.repeats}; "
             f"{cpu_model()} (bf16 unit: {cpu_bf16_units() or 'none'}), {args.threads} torch thread(s), torch "
             f"{torch.__version__}; load average {load0:.1f} before / {os.getloadavg()[0]:.1f} after. bf16 = "
             "`PackedLinear` (oneDNN, packed once, as `peagle evaluate` decodes); fp32 = `F.linear`. Run: "
             f"`python scripts/bench_linears.py --repeats {args.repeats} --threads {args.threads}`.", "",
             "| oneDNN ISA | fp32, 1 row (ms) | fp32, 6 rows | bf16, 1 row | bf16, 6 rows | bf16 6 rows ÷ fastest 1 row |",
             "|---|---|---|---|---|---|"]
    for label, r in rows:
        fastest1 = min(r["fp32/1"], r["bf16/1"])
        lines.append(f"| {label} | {r['fp32/1']:.1f} | {r['fp32/6']:.1f} | {r['bf16/1']:.1f} | {r['bf16/6']:.1f} | "
                     f"{r['bf16/6'] / fastest1:.2f}× |")
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        print(f"written to {write_section(HEADING, table, args.out)}")


if __name__ == "__main__":
    main()
