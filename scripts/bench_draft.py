"""Draft-head benchmarks: training step time/memory vs row length, and drafting cost vs K.

    python scripts/bench_draft.py                 # full table, written to docs/BENCHMARKS.md
    python scripts/bench_draft.py --quick         # rows of 512 and 2048 only

Heads have SmolLM2-135M sizes (H 576, 9 heads, 3 KV heads, MLP 1536, vocabulary 49,152, draft
vocabulary 8,192) with random weights and random features: speed and memory do not depend on the
values. Training: K = 8, r = 0.8, r_min = 0.2, all valid positions as anchors, 4 layers.
Modes: `naive` (one dense mask over the whole packed axis, unpartitioned), `partitioned` (dense
masks, sequence partitioning into parts of 512 positions), `flex` (FlexAttention block mask,
compiled; CUDA only, since FlexAttention has no backward on CPU). Each configuration runs in its
own process so that its peak memory (CUDA: max allocated; CPU: peak RSS growth) is its own.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from peagle_train.draft.peagle import DraftConfig, Eagle3Draft, PEagleDraft  # noqa: E402
from peagle_train.training.cod import cod_sample  # noqa: E402
from peagle_train.training.loop import PackedRow, draft_step  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, target_hidden_size=576,
               draft_vocab_size=8192, mask_token_id=49151, aux_layer_ids=[2, 15, 27])


def head(layers: int, K: int, algorithm: str = "peagle", device="cpu"):
    torch.manual_seed(0)
    cfg = DraftConfig(num_hidden_layers=layers, num_depths=K, algorithm=algorithm, **SMOLLM2)
    return (Eagle3Draft if algorithm == "eagle3" else PEagleDraft)(cfg).to(device)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def bench_train(mode: str, n: int, device: str, repeats: int = 3) -> dict:
    """One configuration: median step time (s), tokens/s, peak memory (MB), elements on the axis.
    On CPU, rows of 8192 tokens and more take one step (no warm-up: nothing compiles on CPU)."""
    warmup = 1
    if device == "cpu" and n >= 8192:
        repeats, warmup = 1, 0
    d = head(4, 8, device=device).train()
    g = torch.Generator().manual_seed(0)
    row = PackedRow(torch.randint(0, 49152, (n,), generator=g).to(device), torch.randn(n, 1728, generator=g).to(device),
                    torch.randn(n, 8192, generator=g).to(device), torch.ones(n, dtype=torch.bool, device=device),
                    torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device))
    el = cod_sample(row.valid.cpu(), row.doc_ids.cpu(), 8, 0.8, 0.2, None, g)
    kw = {"naive": dict(partitions=1, attention="dense"), "partitioned": dict(partitions=max(1, n // 512), attention="dense"),
          "flex": dict(partitions=1, attention="flex")}[mode]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for i in range(repeats + warmup):
        d.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        draft_step(d, row, el, "kl", 8, **kw)
        sync(device)
        if i >= warmup:  # the warm-up step compiles, for flex
            times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    t = statistics.median(times)
    return {"mode": mode, "n": n, "elements": int(el.anchors.numel()), "step_s": t, "tokens_per_s": n / t, "peak_mb": peak}


@torch.no_grad()
def bench_drafting(device: str, context: int = 512, repeats: int = 20) -> list[dict]:
    """Time of producing K draft tokens with a warm KV cache of `context` real pairs:
    P-EAGLE = one forward of 1 real pair + K-1 slots; EAGLE-3 = K sequential forwards."""
    out = []
    for algorithm in ("peagle", "eagle3"):
        d = head(4, 8, algorithm, device).eval()
        feats = torch.randn(1, context, 1728, device=device)
        toks = torch.randint(0, 49152, (1, context), device=device)
        n = context - 1
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
        cache = d.propose(toks[:, :n], feats[:, :n], torch.arange(n, device=device)[None], causal, None, 1).cache
        last_mask = torch.ones(1, 1, context, dtype=torch.bool, device=device)
        last_pos = torch.tensor([[n]], device=device)
        for K in (1, 2, 4, 8):
            times = []
            for i in range(repeats + 2):
                sync(device)
                t0 = time.perf_counter()
                d.propose(toks[:, n:], feats[:, n:], last_pos, last_mask, cache, K)  # one decoding step's drafting
                sync(device)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            out.append({"algorithm": algorithm, "K": K, "ms": 1000 * statistics.median(times)})
    return out


def run_isolated(mode: str, n: int, device: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps({"mode": mode, "n": n, "device": device})],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"mode": mode, "n": n, "error": tail[:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(device_name: str, train: list[dict], drafting: list[dict]) -> str:
    lines = [f"### {device_name}", "", "Training step (4 layers, K = 8, r = 0.8, SmolLM2 sizes; median of 3 steps after a warm-up; "
             "on CPU one step at 8192):", "",
             "| mode | row tokens | elements on the axis | step (s) | tokens/s | peak memory (MB) |", "|---|---|---|---|---|---|"]
    for r in train:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['n']} | – | – | – | {r['error']} |")
        else:
            lines.append(f"| {r['mode']} | {r['n']} | {r['elements']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['peak_mb']:.0f} |")
    by = {(r["mode"], r["n"]): r for r in train if "error" not in r}
    for mode in ("partitioned", "flex", "naive"):
        if (mode, 2048) in by and (mode, 8192) in by:
            lines += ["", f"Peak memory 8192 / 2048 ({mode}): {by[(mode, 8192)]['peak_mb'] / by[(mode, 2048)]['peak_mb']:.2f}× "
                      "(target ≤ 5×, i.e. no faster than linear)."]
    lines += ["", "Drafting K tokens (4 layers, 512 tokens of context in the KV cache, batch 1; median of 20):", "",
              "| K | P-EAGLE, one forward (ms) | EAGLE-3, K forwards (ms) | P-EAGLE cost vs K=1 | EAGLE-3 cost vs K=1 |",
              "|---|---|---|---|---|"]
    dp = {r["K"]: r["ms"] for r in drafting if r["algorithm"] == "peagle"}
    de = {r["K"]: r["ms"] for r in drafting if r["algorithm"] == "eagle3"}
    for K in sorted(dp):
        lines.append(f"| {K} | {dp[K]:.2f} | {de[K]:.2f} | {dp[K] / dp[1]:.2f}× | {de[K] / de[1]:.2f}× |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="rows of 512 and 2048 only")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(REPO / "docs" / "BENCHMARKS.md"))
    ap.add_argument("--max-naive", type=int, default=8192 if torch.cuda.is_available() else 2048,
                    help="longest row run in naive mode (on CPU it needs minutes and GBs beyond 2048)")
    args = ap.parse_args()
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(bench_train(spec["mode"], spec["n"], spec["device"])))
        return
    sizes = (512, 2048) if args.quick else (512, 2048, 8192)
    modes = ["naive", "partitioned"] + (["flex"] if args.device == "cuda" else [])
    train = []
    for n in sizes:
        for mode in modes:
            if mode == "naive" and n > args.max_naive:
                train.append({"mode": mode, "n": n, "error": f"not run: one dense mask over the whole axis, above --max-naive={args.max_naive}"})
                continue
            r = run_isolated(mode, n, args.device)
            print(json.dumps(r), flush=True)
            train.append(r)
    drafting = bench_drafting(args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    md = markdown(f"{name}, torch {torch.__version__}", train, drafting)
    print(md)
    write_section(Path(args.out), f"### {name}", md)


def write_section(path: Path, heading: str, md: str) -> None:
    """Replace (or append) the section that starts with `heading` in docs/BENCHMARKS.md."""
    text = path.read_text() if path.exists() else (
        "# Benchmarks\n\nProduced by `python scripts/bench_draft.py` (see its docstring for the setup).\n")
    parts = text.split("\n### ")
    head, sections = parts[0], ["### " + p for p in parts[1:]]
    sections = [sec for sec in sections if not sec.startswith(heading)] + [md]
    path.write_text(head.rstrip() + "\n\n" + "\n".join(sec.rstrip() + "\n" for sec in sections))


if __name__ == "__main__":
    main()
