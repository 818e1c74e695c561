"""vLLM as the data engine beside our own paths, side by side in one run: target features
(`peagle features`, in-process target vs features.engine=vllm) and regeneration (`peagle regenerate`,
the hf backend's batched decoding engine vs regenerate.backend=vllm). Prints a table and writes the
"vLLM as the data engine" section of docs/BENCHMARKS.md.

    python benchmarks/bench_vllm.py [--feature-docs 64] [--regen-convs 32] [--new-tokens 128] [--batch 16] [--out FILE | --no-docs]

Every path runs as its own command, one after the other, on the demo recipe's target (SmolLM2-135M)
and data, in `precision=auto` (bf16 on a CPU with AMX / AVX512-BF16). Times are each command's own:
the in-process paths include loading the target (seconds), vLLM's include its engine start, which
is also given apart. Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_tables import bench_arguments, cpu_model, publish
from peagle_train.precision import cpu_bf16_units

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## vLLM as the data engine"


def peagle(*args) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "peagle_train.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return time.perf_counter() - t0


def regenerated_tokens(path: Path) -> int:
    from transformers import AutoTokenizer

    from peagle_train.target.load import model_source

    tok = AutoTokenizer.from_pretrained(model_source("pkg:smollm2"))
    n = 0
    for line in path.read_text().splitlines():
        for m in json.loads(line)["messages"]:
            if m["role"] == "assistant":
                n += len(tok(m["content"], add_special_tokens=False)["input_ids"])
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap = bench_arguments(ap, ROOT / "docs" / "BENCHMARKS.md", threads=os.cpu_count())
    ap.add_argument("--feature-docs", type=int, default=64)
    ap.add_argument("--regen-convs", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        common = ["recipe=smollm2-135m-demo", f"data.num_conversations={args.feature_docs}", f"threads={args.threads}"]
        for engine in ("target", "vllm"):
            d = tmp / f"feats-{engine}"
            wall = peagle("features", *common, f"features.dir={d}", f"features.engine={engine}",
                          f"output_dir={tmp / ('run-' + engine)}")
            s = json.loads((d / "generation_summary.json").read_text())
            v = s.get("vllm") or {}
            rows.append(("features", "in-process target (packed forwards)" if engine == "target" else
                         f"vLLM {v.get('vllm_version')} extract_hidden_states", s["docs"], s["tokens"], wall,
                         s["tokens"] / s["seconds"], v.get("load_seconds"),
                         s["tokens"] / v["generate_seconds"] if v.get("generate_seconds") else None))
        common = ["recipe=smollm2-135m-demo", f"data.num_conversations={args.regen_convs}", "regenerate.max_turns=1",
                  f"regenerate.max_new_tokens={args.new_tokens}", f"regenerate.batch_size={args.batch}",
                  "regenerate.temperature=0", "regenerate.drop_cut=false",  # greedy, every answer kept and counted
                  f"threads={args.threads}"]
        for backend in ("hf", "vllm"):
            d = tmp / f"regen-{backend}"
            wall = peagle("regenerate", *common, f"regenerate.backend={backend}", f"output_dir={d}")
            n = regenerated_tokens(d / "regenerated.jsonl")
            rows.append(("regeneration", "decoding engine, greedy batches (hf backend)" if backend == "hf" else
                         "vLLM offline engine (vllm backend)", args.regen_convs, n, wall, n / wall, None, None))
    load1 = os.getloadavg()[0]
    lines = [HEADING, "",
             f"`python benchmarks/bench_vllm.py --feature-docs {args.feature_docs} --regen-convs {args.regen_convs} "
             f"--new-tokens {args.new_tokens} --batch {args.batch} --threads {args.threads}`, "
             f"{time.strftime('%Y-%m-%d')}: {cpu_model()} (bf16 unit: {cpu_bf16_units() or 'none'}), "
             f"{os.cpu_count()} cores, load average {load0:.1f} before / {load1:.1f} after; SmolLM2-135M, demo data, "
             "precision auto (bf16). Each row is one command run alone, in this order.", "",
             "| pass | path | rows | tokens | wall s | tokens/s (wall) | engine start s | tokens/s (engine only) |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, path, n, toks, wall, tps, load, gen in rows:
        lines.append(f"| {kind} | {path} | {n} | {toks} | {wall:.1f} | {tps:.0f} | "
                     f"{'' if load is None else f'{load:.1f}'} | {'' if gen is None else f'{gen:.0f}'} |")
    lines += ["", "Features: tokens/s (wall) is the command's own feature pass (`generation_summary.json`), which "
              "for vLLM includes its engine start; engine only = prompt tokens / vLLM's generate seconds. "
              "Regeneration: tokens = the answers' tokens re-tokenised; wall = the whole command."]
    publish(HEADING, "\n".join(lines), args)


if __name__ == "__main__":
    main()
