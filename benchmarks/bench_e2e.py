"""End to end, two code trees side by side in one run: the demo recipe's training tokens/s with online
and with offline features, and offline feature generation tokens/s, both trees with the same settings.

    git worktree add --detach /tmp/base <commit>     # the code to compare against
    python benchmarks/bench_e2e.py --base /tmp/base --conversations 40 --steps 8 [--rounds 2] [--precision auto]
                                [--threads 2] [--out FILE | --no-docs]

Each measurement is a subprocess of the tree's own entry points (`python -m peagle_train.cli features`,
train.py with eval and export off) with `precision=--precision`; the two trees alternate run by run,
`--rounds` times, so that both see the same machine load, and the table gives each tree's median.
Everything is written under a temporary directory. Prints the table and writes it to
docs/BENCHMARKS.md with the CPU model, its bf16 capability and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_tables import bench_arguments, write_section
from peagle_train.precision import resolve_precision

ROOT = Path(__file__).resolve().parent.parent  # this checkout: the "after" tree

HEADING = "## End to end: demo training and feature generation, before and after"


def cpu_description() -> str:
    """CPU model and its bf16 matrix support (/proc/cpuinfo flags amx_bf16, avx512_bf16)."""
    model, flags = platform.machine(), set()
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []
    for line in info:
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    bf16 = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    return f"{model}; bf16 units: {', '.join(bf16) if bf16 else 'none'}; {os.cpu_count()} cores"


def run(tree: Path, args: list[str], name: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed in {tree}:\n{proc.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the tree to compare against (e.g. a worktree of main)")
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each measurement per tree (alternating)")
    ap.add_argument("--precision", default="auto", help="the `precision` setting of every run (auto | fp32 | bf16)")
    args = bench_arguments(ap, ROOT / "docs" / "BENCHMARKS.md").parse_args()
    trees = {"before": Path(args.base).resolve(), "after": ROOT}
    common = ["recipe=smollm2-135m-demo", f"data.num_conversations={args.conversations}", "data.num_proc=1",
              f"threads={args.threads}", "features.storage=bfloat16", "features.docs_per_shard=16",
              f"precision={args.precision}"]
    train_args = [f"training.max_steps={args.steps}", "training.warmup_steps=1", "training.max_minutes=null", "eval.enabled=false",
                  "export.enabled=false"]
    res = {k: {"generation": [], "online": [], "offline": []} for k in trees}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            for which, tree in trees.items():  # generation first: the offline runs read these shards
                feats = tmp / f"feats-{which}-{r}"
                run(tree, ["-m", "peagle_train.cli", "features", *common, f"features.dir={feats}",
                           f"output_dir={tmp / f'gen-{which}-{r}'}"], f"gen-{which}")
                res[which]["generation"].append(
                    json.loads((feats / "generation_summary.json").read_text())["tokens_per_second"])
            for mode in ("online", "offline"):
                for which, tree in trees.items():
                    out = tmp / f"run-{mode}-{which}-{r}"
                    extra = [f"features.source={mode}"] + (
                        [f"features.dir={tmp / f'feats-{which}-{r}'}"] if mode == "offline" else [])
                    run(tree, ["train.py", *common, *train_args, *extra, f"output_dir={out}"], f"{mode}-{which}")
                    res[which][mode].append(json.loads((out / "summary.json").read_text())["training"]["tokens_per_second"])
    load1 = os.getloadavg()
    commit = {k: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True,
                                text=True).stdout.strip() for k, t in trees.items()}
    rows = [("training, online features (tokens/s)", "online"), ("training, offline bf16 features (tokens/s)", "offline"),
            ("feature generation, bf16 shards (tokens/s)", "generation")]
    prec = resolve_precision(args.precision, "cpu")
    lines = [f"{cpu_description()}; {args.threads} thread(s) per run, torch CPU; `precision={args.precision}` "
             f"({prec.name} here: {prec.reason}). Demo recipe (SmolLM2-135M-Instruct target, 1-layer head, K = 8, "
             f"1,024-token rows), {args.conversations} ShareGPT conversations, {args.steps} training steps (the first "
             f"included), eval and export off. Before = {commit['before']} (`{trees['before']}`), after = this tree "
             f"({commit['after']}); the two alternate run by run, {args.rounds} round(s), medians. Load average "
             f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end (`uptime`).", "",
             "| measurement | before | after | after / before | runs (before; after) |",
             "|---|---|---|---|---|"]
    for label, key in rows:
        b, a = statistics.median(res["before"][key]), statistics.median(res["after"][key])
        runs = "; ".join(", ".join(f"{x:.0f}" for x in res[w][key]) for w in trees)
        lines.append(f"| {label} | {b:.0f} | {a:.0f} | {a / b:.2f}× | {runs} |")
    lines += ["", f"Run: `python benchmarks/bench_e2e.py --base {trees['before']} --conversations {args.conversations} "
              f"--steps {args.steps} --rounds {args.rounds} --precision {args.precision} --threads {args.threads}`."]
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        write_section(HEADING, f"{HEADING}\n\n{text}\n", args.out)


if __name__ == "__main__":
    main()
