"""Benchmark of cache compaction in shared-forward decoding (decoding/engine.py): the same prompts
decoded with shared forwards with and without `compact`, their wall time, final cache length and
tokens (which must be equal).

    python benchmarks/bench_shared_cache.py --head runs/smollm2/peagle/checkpoint [--num-prompts 16]
        [--max-new-tokens 256] [--threads 2] [--out FILE | --no-docs]

SmolLM2-135M-Instruct target, greedy, K = 5, MT-Bench first turns of Spec-Bench. Prints a table and
replaces the "Shared-forward cache compaction" section of docs/BENCHMARKS.md. Timings on a shared
CPU are noisy: the load average (uptime) is written next to the numbers.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bench_tables import bench_arguments, machine_line, write_section
from peagle_train.decoding import engine as shared
from peagle_train.evaluation.benchmarks import MT_BENCH_CATEGORIES, chat_ids, load_benchmark
from peagle_train.jobs.builders import build_target
from peagle_train.draft.head_files import load_head

HEADING = "## Shared-forward cache compaction (benchmarks/bench_shared_cache.py)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True, help="a training checkpoint directory (runs/<run>/checkpoint)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = bench_arguments(ap, Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md", threads=2).parse_args()
    torch.set_num_threads(args.threads)
    draft, _ = load_head(args.head)
    draft.eval()
    target_cfg = OmegaConf.create(dict(path="pkg:smollm2", dtype="float32", aux_layer_ids=list(draft.config.aux_layer_ids)))
    target, tok = build_target(target_cfg, "cpu")
    prompts = load_benchmark("spec_bench", "pkg:spec_bench", MT_BENCH_CATEGORIES, args.num_prompts)
    ids = [chat_ids(tok, [{"role": "user", "content": p["turns"][0]}]) for p in prompts]
    load_before = os.getloadavg()
    rows = []
    for compact in (True, False):
        print(f"decoding {len(ids)} prompts × {args.max_new_tokens} tokens, {'compacted caches' if compact else 'caches with holes'} ...",
              flush=True)
        t0 = time.perf_counter()
        with torch.no_grad():  # the engine's state, kept to read its cache
            state = shared.DecodingBatch(target, draft, ids, 5, args.max_new_tokens, {tok.eos_token_id}, None, compact)
            res = state.run()
        wall = time.perf_counter() - t0
        n_tok = sum(len(r.tokens) for r in res)
        rows.append((compact, wall, n_tok, state.compactions, state.tcache.get_seq_length(), [r.tokens for r in res]))
    load_after = os.getloadavg()
    same = rows[0][5] == rows[1][5]
    table = ["| caches | wall (s) | tokens | tokens/s | compactions | final target cache (slots) |", "|---|---|---|---|---|---|"]
    for compact, wall, n_tok, n_comp, slots, _ in rows:
        table.append(f"| {'compacted' if compact else 'with holes'} | {wall:.1f} | {n_tok} | {n_tok / wall:.2f} | {n_comp} | {slots} |")
    md = "\n".join([
        HEADING, "",
        f"SmolLM2-135M-Instruct target, head `{args.head}`, greedy, K = 5, {args.max_new_tokens} new tokens, "
        f"{len(ids)} MT-Bench first turns in one batch (shared forwards), COMPACT_SLACK = {shared.COMPACT_SLACK}. "
        f"CPU ({machine_line()}, {args.threads} torch thread(s)), torch {torch.__version__}; load average "
        f"{load_before[0]:.1f} before / {load_after[0]:.1f} after. Same tokens with and without compaction: {same}.", "",
        *table, "",
        f"Wall time with holes ÷ compacted: {rows[1][1] / rows[0][1]:.2f}×. Attention, the GQA key/value expansion "
        "and the cache's concatenation scale with the cache's length, which without compaction grows by K + 1 slots "
        "per step while each row keeps about τ of them (short outputs never reach COMPACT_SLACK).", "",
    ])
    print(md)
    if not same:
        raise SystemExit("compaction changed the tokens: a bug in decoding/engine.py")
    if not args.no_docs:
        print(f"wrote {write_section(HEADING, md, args.out)}")


if __name__ == "__main__":
    main()
