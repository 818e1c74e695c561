"""Benchmark of the reference decoder (issue 7): speedup over the target alone and the share of each
step spent drafting, verifying and in bookkeeping (everything but the two models' forwards).

    python scripts/bench_decode.py [--head /tmp/demo3/checkpoint] [--num-prompts 3] [--baseline-head DIR]

Runs scripts/evaluate.py (SmolLM2-135M-Instruct target, greedy, K=5, 128 new tokens, MT-Bench
first turns), prints a table and replaces the "Reference decoder" section of docs/BENCHMARKS.md.
Timings on a shared CPU are noisy: the load average (uptime) is written next to the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from peagle_train.benchmarks import write_section

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Reference decoder (scripts/bench_decode.py)"


def table(r: dict, args) -> str:
    lat = r["latency"]
    rows = [("target alone", None, r["target_only_tokens_per_second"], 1.0, None, lat["target"])]
    rows.append((f"P-EAGLE head, K={r['num_speculative_tokens']}", r["acceptance_length"], r["tokens_per_second"],
                 r["speedup"], r["time_shares"], lat["head"]))
    if "baseline" in r:
        b = r["baseline"]
        rows.append((f"{b['algorithm']} head, K={r['num_speculative_tokens']}", b["acceptance_length"],
                     b["tokens_per_second"], b["speedup"], b["time_shares"], lat["baseline_head"]))
    out = ["| decoder | τ | tokens/s | speedup | drafting | verifying | bookkeeping | TTFT median (ms) | TPOT median (ms) | total median / p90 (s) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, tau, tps, sp, ts, la in rows:
        shares = " | ".join(f"{100 * ts[k]:.1f}%" for k in ("drafting", "verifying", "bookkeeping")) if ts else "– | – | –"
        out.append(f"| {name} | {'–' if tau is None else f'{tau:.3f}'} | {tps:.2f} | {sp:.2f}× | {shares} | "
                   f"{1000 * la['ttft_median_s']:.0f} | {1000 * la['tpot_median_s']:.0f} | "
                   f"{la['latency_median_s']:.2f} / {la['latency_p90_s']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="/tmp/demo3/checkpoint")
    ap.add_argument("--baseline-head", default=None)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the decoder (1 is steadiest on a shared CPU)")
    ap.add_argument("--out", default="/tmp/bench_decode")
    ap.add_argument("--no-docs", action="store_true", help="print only, leave docs/BENCHMARKS.md alone")
    args = ap.parse_args()
    cmd = [sys.executable, str(ROOT / "scripts/evaluate.py"), f"head={args.head}", f"output_dir={args.out}", f"threads={args.threads}",
           f"eval.num_prompts={args.num_prompts}", "eval.num_speculative_tokens=5", "eval.max_new_tokens=128",
           "eval.temperature=0.0", "eval.benchmark=spec_bench"]
    if args.baseline_head:
        cmd.append(f"baseline_head={args.baseline_head}")
    load_before = os.getloadavg()
    subprocess.run(cmd, check=True, cwd=ROOT)
    load_after = os.getloadavg()
    r = json.loads((Path(args.out) / "eval" / "acceptance.json").read_text())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()}, {args.threads} torch thread(s))"
    md = "\n".join([
        HEADING, "",
        f"SmolLM2-135M-Instruct target, head `{args.head}`, greedy, K = {r['num_speculative_tokens']}, "
        f"{r['max_new_tokens']} new tokens, {r['num_prompts']} MT-Bench first turns (round-robin categories), "
        f"lossless: {r['lossless']}. {device}, torch {torch.__version__}; load average "
        f"{load_before[0]:.1f} before / {load_after[0]:.1f} after (the machine was shared, so absolute speeds are noisy; "
        "shares within one decoder are more stable).", "",
        table(r, args), "",
        "Bookkeeping = wall time of the decoding loop minus the draft and target forwards (sampling/argmax, "
        "acceptance, KV rollback, list handling). Per-position acceptance: "
        + ", ".join(f"{a:.3f}" for a in r["per_position_acceptance"]) + ".", "",
    ])
    print(md)
    if not args.no_docs:
        print(f"wrote {write_section(HEADING, md)}")


if __name__ == "__main__":
    main()
