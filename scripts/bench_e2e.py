"""End to end, two code trees side by side in one run: the demo recipe's training tokens/s with online
and with offline features, and offline feature generation tokens/s.

    git worktree add /tmp/base main        # the code to compare against
    python scripts/bench_e2e.py --base /tmp/base --conversations 40 --steps 8 [--threads 1] [--out FILE | --no-docs]

Each measurement is a subprocess of the tree's own entry points (scripts/generate_hidden_states.py,
train.py with eval and export off), runs of the two trees interleaved so that both see the same
machine load; everything is written under a temporary directory. Prints the table and writes it
to docs/BENCHMARKS.md with the CPU model, its bf16 capability and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from peagle_train.bench_tables import bench_arguments, write_section
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


def target_forward_rates(threads: int, reps: int = 4) -> tuple[float, float, int]:
    """SmolLM2-135M target (fp32) on one packed row of 4 documents (420, 260, 180, 150 tokens):
    tokens/s of one forward per document (before) and of one forward per row (after), medians of
    `reps` interleaved repetitions. Returns (per document, per row, tokens)."""
    import statistics
    import time

    import torch
    from omegaconf import OmegaConf

    from peagle_train.job import build_target

    torch.set_num_threads(threads)
    t, _ = build_target(OmegaConf.create({"path": "pkg:smollm2", "dtype": "float32", "aux_layer_ids": None}), "cpu")
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, t.config.vocab_size, (n,), generator=g) for n in (420, 260, 180, 150)]
    draft_ids = torch.arange(0, t.config.vocab_size, 6)
    per_doc, per_row = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for d in docs:
            t(d[None], draft_ids=draft_ids)
        per_doc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        t.forward_documents(docs, draft_ids)
        per_row.append(time.perf_counter() - t0)
    n = sum(d.numel() for d in docs)
    return n / statistics.median(per_doc), n / statistics.median(per_row), n


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
    args = bench_arguments(ap, ROOT / "docs" / "BENCHMARKS.md").parse_args()
    trees = {"before": Path(args.base).resolve(), "after_fp32": ROOT, "after_auto": ROOT}
    # the base tree runs its own defaults (fp32); this tree once forced to fp32 (the structural changes
    # alone) and once with `precision: auto` (bf16 where the CPU has AVX512-BF16 or AMX)
    setting = {"before": [], "after_fp32": ["precision=fp32"], "after_auto": ["precision=auto"]}
    common = ["recipe=smollm2-135m-demo", f"data.num_conversations={args.conversations}", "data.num_proc=1",
              f"threads={args.threads}", "features.storage=bfloat16", "features.docs_per_shard=16"]
    train_args = [f"training.max_steps={args.steps}", "training.max_minutes=null", "eval.enabled=false",
                  "export.enabled=false"]
    res = {k: {} for k in trees}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        tmp = Path(tmp)
        for which, tree in trees.items():  # generation first: the offline runs read these shards
            feats = tmp / f"feats-{which}"
            run(tree, ["scripts/generate_hidden_states.py", *common, *setting[which], f"features.dir={feats}",
                       f"output_dir={tmp / f'gen-{which}'}"], f"gen-{which}")
            res[which]["generation"] = json.loads((feats / "generation_summary.json").read_text())["tokens_per_second"]
        for mode in ("online", "offline"):
            for which, tree in trees.items():
                out = tmp / f"run-{mode}-{which}"
                extra = [f"features.source={mode}"] + ([f"features.dir={tmp / f'feats-{which}'}"] if mode == "offline" else [])
                run(tree, ["train.py", *common, *train_args, *setting[which], *extra, f"output_dir={out}"], f"{mode}-{which}")
                res[which][mode] = json.loads((out / "summary.json").read_text())["training"]["tokens_per_second"]
    fwd_doc, fwd_row, fwd_n = target_forward_rates(args.threads)
    res["before"]["forward"] = fwd_doc
    res["after_fp32"]["forward"] = res["after_auto"]["forward"] = fwd_row
    load1 = os.getloadavg()
    commit = {k: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True,
                                text=True).stdout.strip() for k, t in trees.items()}
    rows = [("training, online features (tokens/s)", "online"), ("training, offline bf16 features (tokens/s)", "offline"),
            ("feature generation, bf16 shards (tokens/s)", "generation"),
            ("target forward alone, one packed row: per document → one forward (tokens/s)", "forward")]
    auto = resolve_precision("auto", "cpu")
    lines = [f"{cpu_description()}; {args.threads} thread(s) per run, torch CPU; `precision: auto` resolves to "
             f"{auto.name} here ({auto.reason}). Demo recipe (SmolLM2-135M-Instruct "
             f"target, 1-layer head, K = 8, 1,024-token rows), {args.conversations} ShareGPT conversations, "
             f"{args.steps} training steps (the first included), eval and export off. Before = {commit['before']} "
             f"(`{trees['before']}`, fp32), after = this tree ({commit['after_fp32']}) with precision=fp32 and with "
             f"precision=auto; runs interleaved. Load average "
             f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end (`uptime`; a machine shared by other jobs).", "",
             "| measurement | before | after, fp32 | after, auto | fp32 / before | auto / before |",
             "|---|---|---|---|---|---|"]
    for label, key in rows:
        b, f, a = res["before"][key], res["after_fp32"][key], res["after_auto"][key]
        lines.append(f"| {label} | {b:.0f} | {f:.0f} | {a:.0f} | {f / b:.2f}× | {a / b:.2f}× |")
    lines += ["", f"The last row runs in this process (the {fwd_n}-token row of 4 documents, medians of 4 interleaved "
              "repetitions, fp32 in both columns); the others are whole runs of each tree. Feature generation also stopped computing the "
              "full-vocabulary logits that it never stored.",
              "", f"Run: `python scripts/bench_e2e.py --base {trees['before']} --conversations {args.conversations} "
              f"--steps {args.steps} --threads {args.threads}`."]
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        write_section(HEADING, f"{HEADING}\n\n{text}\n", args.out)


if __name__ == "__main__":
    main()
