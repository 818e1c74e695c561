"""Benchmark of the head's optimizer step: PyTorch's AdamW implementations side by side on the
trainable parameters of a SmolLM2-135M-sized head (the smollm2-135m recipe's: 2 layers, 8,192-token
draft vocabulary; embed_tokens is trainable, so most of the parameters are its 49,152 × 576 rows).

    python benchmarks/bench_optimizer.py [--layers 2] [--steps 10] [--threads 1] [--out FILE | --no-docs]

Each implementation (single-tensor, the CPU default; foreach; fused, which the trainer uses with
the ddp engine: `peagle_train.training.trainer.adamw`) steps the same fp32 parameters with random
gradients, after 3 warm-up steps; ms/step is the mean over --steps. Prints a table and writes it
into docs/BENCHMARKS.md under its own heading, with CPU model, bf16 unit and load.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from bench_draft import head  # benchmarks/ is on sys.path when a script runs
from bench_tables import bench_arguments, cpu_model, publish
from peagle_train.precision import cpu_bf16_units

REPO = Path(__file__).resolve().parent.parent
HEADING = "## Optimizer step (benchmarks/bench_optimizer.py)"
IMPLEMENTATIONS = (("single-tensor (CPU default)", {}), ("foreach", {"foreach": True}), ("fused (trainer, ddp engine)", {"fused": True}))


def time_step(params: list[torch.nn.Parameter], kw: dict, steps: int) -> float:
    """Mean seconds of one AdamW step (betas 0.9/0.95 as the trainer's) over `steps` after 3 warm-ups."""
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), **kw)
    for _ in range(3):
        opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_arguments(ap, REPO / "docs" / "BENCHMARKS.md")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    params = [p for p in head(args.layers, 8).parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    rows = [(name, time_step(params, kw, args.steps)) for name, kw in IMPLEMENTATIONS]
    base = rows[0][1]
    lines = [HEADING, "",
             f"AdamW step over the {n / 1e6:.1f}M trainable fp32 parameters of a {args.layers}-layer SmolLM2-135M head "
             f"({len(params)} tensors), mean of {args.steps} steps; {cpu_model()} (bf16 unit: {cpu_bf16_units() or 'none'}), "
             f"{args.threads} torch thread(s), torch {torch.__version__}; load average {load0:.1f} before / "
             f"{os.getloadavg()[0]:.1f} after. Run: `python benchmarks/bench_optimizer.py --layers {args.layers} "
             f"--steps {args.steps} --threads {args.threads}`.", "",
             "| AdamW | ms/step | vs single-tensor |", "|---|---|---|"]
    lines += [f"| {name} | {s * 1e3:.1f} | {base / s:.2f}× |" for name, s in rows]
    table = "\n".join(lines)
    publish(HEADING, table, args)


if __name__ == "__main__":
    main()
