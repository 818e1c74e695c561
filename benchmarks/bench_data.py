"""Benchmark data preparation: the whole recovered ShareGPT V3 (17,671 records) for SmolLM2.

    python benchmarks/bench_data.py [--num-proc 2] [--max-length 512] [--threads 1] [--out FILE | --no-docs]

Runs `prepare_data` twice on every conversation (num_conversations=None) with a fresh Arrow cache:
cold (read, normalise, tokenise and mask with `num_proc` workers, draft vocabulary, mask token) and
warm (the same inputs again: every stage is a datasets fingerprint-cache hit). Reports wall time and
peak memory (RSS of this process plus its workers, sampled every 0.1 s), prints a table and writes it
to docs/BENCHMARKS.md under "## Data preparation" (with the machine load from `uptime`).
Targets: cold run under 2 minutes on 2 cores with num_proc=2, peak memory under 4 GB.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import threading
import time
from pathlib import Path

import psutil
import torch

from bench_tables import bench_arguments, machine_line, publish
from peagle_train.data.prepare import prepare_data
from peagle_train.paths import resolve_path

HEADING = "## Data preparation"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"  # where the table goes by default (--out)


class PeakRSS:
    """Peak summed RSS (bytes) of this process and all its children, sampled in a thread."""

    def __init__(self, every_s: float = 0.1):
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()

    def _run(self):
        me = psutil.Process()
        while not self._stop.is_set():
            try:
                procs = [me] + me.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(self.every_s)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children (the map workers)."""
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from peagle_train.target.load import load_target_config, model_source

    d = model_source("pkg:smollm2")
    return AutoTokenizer.from_pretrained(str(d), local_files_only=True), load_target_config("pkg:smollm2").vocab_size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--cache-dir", default="/tmp/peagle_bench_data_cache")
    args = bench_arguments(ap, DOCS).parse_args()
    torch.set_num_threads(args.threads)
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    tok, vocab_size = smollm2_tokenizer()
    path = resolve_path("pkg:sharegpt")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results = []
    for run in ("cold", "warm"):
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), cpu_seconds()
            data = prepare_data(path, tok, vocab_size, num_conversations=None, max_length=args.max_length,
                                min_supervised_tokens=16, draft_vocab_size=8192, num_proc=args.num_proc,
                                cache_dir=args.cache_dir)
            secs, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        s = data.summary
        results.append((run, secs, cpu, mem.peak / 2**30, s["records_in_file"], s["conversations_kept"], s["tokens"],
                        s["supervised_tokens"]))
    rows = ["| run | wall (s) | CPU, all processes (s) | peak RSS, process + workers (GiB) | records | rows kept "
            "| tokens | supervised tokens | tokens/s (wall) |", "|---|---|---|---|---|---|---|---|---|"]
    rows += [f"| {r} | {t:.1f} | {c:.1f} | {m:.2f} | {n:,} | {k:,} | {tk:,} | {sp:,} | {tk / t:,.0f} |"
             for r, t, c, m, n, k, tk, sp in results]
    table = "\n".join(rows)
    section = (f"{HEADING}\n\nProduced by `python benchmarks/bench_data.py --num-proc {args.num_proc} --max-length "
               f"{args.max_length}`: the whole recovered ShareGPT V3 (`pkg:sharegpt`) rendered with SmolLM2's chat "
               f"template, tokenised and masked with `num_proc={args.num_proc}`, draft vocabulary 8,192; cold = fresh "
               f"Arrow cache, warm = the same inputs again (fingerprint-cache hits). CPU: {machine_line()}, {os.cpu_count()} cores. "
               f"Load before the run (`uptime`): `{load}`; the machine is shared, so wall times are upper bounds; CPU seconds / 2 roughly estimates the wall "
               f"time on two idle cores.\n\n"
               f"{table}\n\nTargets: cold under 120 s, peak memory under 4 GiB.\n")
    publish(HEADING, section, args)


if __name__ == "__main__":
    main()
