"""Benchmark target feature capture and offline shards; prints a table and writes the
"Target features" section of docs/BENCHMARKS.md.

    python benchmarks/bench_features.py [--tokens 2048] [--repeats 5] [--docs 32] [--steps 6] [--threads N] [--out FILE | --no-docs]

Measures, on the default target (SmolLM2-135M-Instruct, peagle_train/config.py; bf16 on a GPU):
1. capture overhead: FeatureTarget forward (hooks on 4 layers, full logits) vs the plain HF
   forward of the same [1, tokens] batch, median of `repeats` (target ≤ 1.05×);
2. bytes per token on disk for bfloat16 and int8 shards (total and features only) and the
   generation throughput (target tokens/s, shard writing included);
3. training step time (features + COD + draft forward/backward + optimizer) online vs offline
   (bfloat16 and int8 shards), same packed rows, median over `steps` steps (target: offline ≤ 1.05×
   online).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bench_tables import bench_arguments, machine_line, publish
from peagle_train.data.prepare import prepare_data
from peagle_train.jobs.builders import build_draft, build_target
from peagle_train.config import default_config
from peagle_train.paths import resolve_path
from peagle_train.algorithms.peagle import draft_step
from peagle_train.features.shards import OfflineFeatures
from peagle_train.features.rows import pack_documents
from peagle_train.features.online import packed_row
from peagle_train.features.shards import write_features
from peagle_train.algorithms.cod import cod_sample

HEADING = "## Target features"


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, repeats, dev):
    times = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--docs", type=int, default=32, help="ShareGPT rows written as shards")
    ap.add_argument("--steps", type=int, default=6, help="training steps timed per mode")
    args = bench_arguments(ap, Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md",
                           threads=None).parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = default_config()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        cfg.target.dtype = "bfloat16"
    target, tok = build_target(cfg.target, dev)
    rows = []

    # 1. capture overhead
    ids = torch.randint(0, target.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        target(ids), target.model(ids)  # warm-up
        plain, capture = [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit both alike
            plain.append(median_time(lambda: target.model(ids), 1, dev))
            capture.append(median_time(lambda: target(ids), 1, dev))
    t_plain, t_cap = statistics.median(plain), statistics.median(capture)
    rows.append(("capture overhead: plain HF forward", f"{t_plain * 1000:.0f} ms", f"[1, {args.tokens}], median of {args.repeats}"))
    rows.append(("capture overhead: forward with capture", f"{t_cap * 1000:.0f} ms", f"ratio {t_cap / t_plain:.3f}× (target ≤ 1.05×)"))

    # 2. shards: bytes per token, generation throughput
    data = prepare_data(resolve_path(cfg.data.path), tok, target.config.vocab_size, num_conversations=args.docs,
                        max_length=cfg.data.max_length, min_supervised_tokens=cfg.data.min_supervised_tokens,
                        draft_vocab_size=cfg.data.draft_vocab_size, mask_token_id=None, seed=0)
    n_tok = sum(len(x) for x in data.rows["input_ids"])
    H = target.config.hidden_size
    tmp = Path(tempfile.mkdtemp(prefix="bench_features_"))
    readers, summaries = {}, {}
    for storage, scale in (("bfloat16", "channel"), ("int8", "channel"), ("int8", "token")):
        name = storage if storage != "int8" else f"int8-{scale}"
        s = write_features(target, tok, data.rows, tmp / name, storage=storage, int8_scale=scale,
                           docs_per_shard=16)
        summaries[name] = s
        readers[name] = OfflineFeatures(tmp / name, target, tok, data.rows, int8_scale=scale)
    for name, s in summaries.items():
        feat = (s["bytes"] - 4 * n_tok) / n_tok
        rows.append((f"bytes/token on disk, {name}", f"{s['bytes_per_token']:.0f}",
                     f"features only {feat:.1f} (= {feat / (8 * H):.4f} × bf16's 8H = {8 * H})"))
    rows.append(("generation throughput (bf16 shards)", f"{summaries['bfloat16']['tokens_per_second']:.0f} tok/s",
                 f"{len(data.rows)} docs, {n_tok} tokens, one forward per packed row of documents"))

    # 3. step time online vs offline, same rows
    dcfg = OmegaConf.merge(cfg.draft, {"num_depths": 8})
    draft_ids = data.vocab.draft_ids.to(dev)
    batches = pack_documents([len(x) for x in data.rows["input_ids"]], 1024, 0)[:args.steps + 1]
    step_times = {}
    for mode in ("online", "bfloat16", "int8-channel"):
        torch.manual_seed(0)
        draft = build_draft(target, dcfg, data.vocab, data.mask_token_id).to(dev).train()
        opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        times = []
        for b in batches:
            docs = [(data.rows[i]["input_ids"], data.rows[i]["loss_mask"]) for i in b]
            sync(dev)
            t0 = time.perf_counter()
            row = packed_row(target, docs, draft_ids) if mode == "online" else readers[mode].packed_row(b, docs, draft_ids)
            el = cod_sample(row.valid.cpu(), row.doc_ids.cpu(), 8, 0.7, 0.2, 256, gen)
            draft_step(draft, row, el, "kl", 8)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(dev)
            times.append(time.perf_counter() - t0)
        step_times[mode] = statistics.median(times[1:])  # the first step warms up
    for mode, t in step_times.items():
        rows.append((f"training step, {mode} features", f"{t * 1000:.0f} ms",
                     f"{t / step_times['online']:.2f}× online; 1,024-token rows, K=8, median of {len(batches) - 1}"))

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    argv = " ".join(sys.argv[1:])
    header = (f"`python benchmarks/bench_features.py{' ' + argv if argv else ''}` ({time.strftime('%Y-%m-%d %H:%M')} UTC, {dev.type}, "
              f"{machine_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
              f"load: `{load}`). Target `{cfg.target.path}` in {cfg.target.dtype or 'float32'}, H = {H}.")
    table = ["| measurement | value | notes |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join([HEADING, "", header, "", *table, ""])
    publish(HEADING, text, args)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
