"""Benchmark of a whole evaluation run: wall time of `evaluate` (the target alone, a P-EAGLE head and
an EAGLE-3 baseline head on MT-Bench first turns, greedy, K = 5) for another checkout's code and
this tree's, run one after the other on the same machine with the same command line.

    git worktree add --detach /tmp/base <commit>    # the code to compare with
    python benchmarks/bench_eval.py --head runs/p/checkpoint --baseline-head runs/e3/checkpoint --base /tmp/base

Each run is `python -m peagle_train.cli evaluate head=... baseline_head=... eval.num_prompts=N
eval.max_new_tokens=T eval.batch_size=B threads=...` in its own process (its own code on
PYTHONPATH) with its default precision, writing under --work. The table gives the wall time, the
ratio to the other checkout's and each run's τ, tokens/s and lossless figures from its
acceptance.json, and replaces the evaluation section of docs/BENCHMARKS.md (CPU model, bf16 unit,
load average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Evaluation wall time (benchmarks/bench_eval.py)"


def run(tree: Path, out: Path, args) -> dict:
    """One `evaluate` run of checkout `tree` into `out`; its wall time (s) and acceptance.json."""
    cmd = [sys.executable, "-m", "peagle_train.cli", "evaluate", f"head={args.head}", f"baseline_head={args.baseline_head}",
           f"output_dir={out}", f"eval.num_prompts={args.num_prompts}", f"eval.max_new_tokens={args.max_new_tokens}",
           f"eval.num_speculative_tokens={args.k}", f"eval.batch_size={args.batch_size}", "eval.plot=false",
           f"threads={args.threads}"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{tree}: evaluate failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"wall": wall, "acc": json.loads((out / "eval" / "acceptance.json").read_text())}


def main() -> None:
    from bench_tables import bench_arguments, cpu_model, write_section
    from peagle_train.precision import cpu_bf16_units

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="the P-EAGLE head (a training checkpoint)")
    ap.add_argument("--baseline-head", required=True, help="the EAGLE-3 head decoded in the same run")
    ap.add_argument("--base", required=True, help="the other checkout (e.g. git worktree add --detach /tmp/base COMMIT)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_eval"), help="where the runs write")
    ap.add_argument("--rounds", type=int, default=1, help="runs per code, alternating; the table gives medians")
    args = bench_arguments(ap, ROOT / "docs" / "BENCHMARKS.md", threads=os.cpu_count() or 1).parse_args()
    base = Path(args.base).resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=base, capture_output=True, text=True).stdout.strip()
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    runs = {f"base ({commit or base})": [], "this tree": []}
    for r in range(args.rounds):  # the codes alternate, so that both see the same load
        for name, tree in zip(runs, (base, ROOT)):
            print(f"{name}, round {r + 1} ...", flush=True)
            runs[name].append(run(tree, args.work / f"{name.split()[0].replace('this', 'new')}-{r}", args))
    res = {}
    for name, rs in runs.items():  # the run of median wall time, with every run's wall and tokens/s
        med = sorted(rs, key=lambda x: x["wall"])[(len(rs) - 1) // 2]
        res[name] = {**med, "walls": [x["wall"] for x in rs],
                     "head_tps": statistics.median(x["acc"]["tokens_per_second"] for x in rs),
                     "target_tps": statistics.median(x["acc"]["target_only_tokens_per_second"] for x in rs)}
    load1, minutes = os.getloadavg()[0], (time.perf_counter() - t0) / 60
    ref = next(iter(res.values()))["wall"]
    rows = ["| code | precision | wall (s) | ÷ base | τ head | τ EAGLE-3 | head tokens/s | target alone tokens/s | lossless mismatches | walls of the runs (s) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        a = r["acc"]
        turns = a.get("num_turns", a["num_prompts"])
        mism = a.get("lossless_mismatches", 0 if a.get("lossless") else "?")  # older codes: lossless only
        if mism is None:  # below fp32 in batches the check is not made; the differing turns are counted
            mism = f"not checked ({a.get('turns_differing_from_target_alone')} differ)"
        rows.append(f"| {name} | {a.get('precision', 'fp32')} | {r['wall']:.1f} | {r['wall'] / ref:.2f}× | "
                    f"{a['acceptance_length']:.3f} | {a['baseline']['acceptance_length']:.3f} | "
                    f"{r['head_tps']:.1f} | {r['target_tps']:.1f} | {mism}/{turns} | "
                    f"{', '.join(f'{w:.1f}' for w in r['walls'])} |")
    units = cpu_bf16_units() or "none"
    text = (f"{HEADING}\n\n`evaluate` of the target alone, a P-EAGLE head and an EAGLE-3 baseline head: "
            f"{args.num_prompts} MT-Bench first turns, {args.max_new_tokens} new tokens, K = {args.k}, greedy, "
            f"batch {args.batch_size}, {args.threads} threads, each code with its default precision, {args.rounds} "
            f"run(s) each, alternating (medians). {cpu_model()} "
            f"(bf16 unit: {units}); load average {load0:.1f} before / {load1:.1f} after ({minutes:.1f} min). "
            f"Wall = the whole process (loading included).\n\n" + "\n".join(rows) + "\n")
    print("\n" + text)
    if not args.no_docs:
        write_section(HEADING, text, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
