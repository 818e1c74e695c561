"""Regeneration throughput by batch size and backend, beside the target's own forward throughput.
Prints a table and writes the "Regeneration throughput" section of docs/BENCHMARKS.md.

    python benchmarks/bench_regenerate.py [--batches 16 64 256] [--backends hf vllm] [--modes greedy sampled]
        [--new-tokens 128] [--temperature 0.7] [--forward-batch 8] [--forward-len 512] [--max-prompt-tokens 512]
        [--rows FILE] [--threads N]
        [--out FILE | --no-docs]
    python benchmarks/bench_regenerate.py --threads 1 --batches 2 --backends hf --new-tokens 4 \
        --forward-batch 1 --forward-len 16 --decode-steps 2 --no-docs          # a smoke run (seconds)

The target is the default config's (SmolLM2-135M, `pkg:smollm2`), the prompts the first user turns of
the default data (ShareGPT, shuffled with seed 0, sorted by length as `peagle regenerate` sorts them),
those over --max-prompt-tokens skipped for both backends (the in-process engine pads a batch to its
longest prompt: at batch 256 ShareGPT's longest first turns need more than 24 GiB).
Each (backend, mode, batch B) row is one backend call on B first turns, built as `peagle regenerate`
builds it (cli/regenerate.py `backend_from_config`): hf = the in-process target (greedy: the
package's batched engine, finished rows leaving the batch; sampled: HF `generate` with one seeded
draw per row, running until the batch's longest answer), vllm = vLLM's offline engine in its own
venv (~/.cache/peagle_train/vllm-venv, or $PEAGLE_VLLM_PYTHON; `max_num_seqs` = B; its engine start
is timed apart and not counted; a warm-up call on one prompt precedes the rows). answer tokens/s =
generated answer tokens (re-tokenised, as bench_vllm.py counts them) / the call's seconds, which
include the prompts' prefill (their tokens are given). Precision: what the command uses (hf: fp32 weights
and compute; vllm: `precision=auto`, bf16 where the CPU has a bf16 unit).

To explain the gap, the target alone is timed in-process (fp32, `--threads`):
- prefill: one forward of [forward-batch, forward-len] tokens, tokens/s = batch × len / seconds, the
  compute-bound ceiling (large matmuls);
- decode step at batch B: `--decode-steps` one-token forwards of B rows over a KV cache of
  `--forward-len` tokens, tokens/s = B / seconds per step. A decode step reads every weight and
  the cache for B tokens of work, so at small B it is memory- and per-step-overhead bound (Python,
  kernel launches, sampling); the gap between prefill and decode at B, and between decode at B and
  regeneration at B, is what batching, the engine and padding cost.

The machine line records the CPU model (lscpu), its bf16 unit, the threads, and the load average
before and after. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from bench_tables import bench_arguments, cpu_model, publish

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Regeneration throughput"


def lscpu_model() -> str:
    """lscpu's "Model name", else /proc/cpuinfo's (bench_tables.cpu_model)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return cpu_model()


def first_turns(n: int, tok, max_prompt_tokens: int | None = None) -> list[list[dict]]:
    """The first user turn (after any system turn) of n conversations of the default data, as
    `peagle regenerate` orders them, skipping first turns over max_prompt_tokens as
    regenerate.max_prompt_tokens does (drawn from 4n conversations)."""
    from peagle_train.cli.regenerate import conversations
    from peagle_train.config import compose

    over = [f"data.num_conversations={4 * n if max_prompt_tokens else n}"]
    if max_prompt_tokens:
        over.append(f"regenerate.max_prompt_tokens={max_prompt_tokens}")
    cfg = compose("regenerate", over)
    rows, _ = conversations(cfg, tok)
    out = []
    for _, msgs in rows:
        head = []
        for m in msgs:
            head.append(m)
            if m["role"] == "user":
                break
        if head[-1]["role"] == "user":
            out.append(head)
    return out[:n]


def answer_tokens(tok, gens) -> int:
    return sum(len(tok(g.text, add_special_tokens=False)["input_ids"]) for g in gens)


def prompt_tokens(tok, convs, template_kwargs) -> int:
    from peagle_train.data.regenerate import prompt_texts

    return sum(len(ids) for ids in tok(prompt_texts(tok, convs, template_kwargs), add_special_tokens=False)["input_ids"])


def run_settings(args) -> dict:
    """What a row of `--rows` depends on besides its backend, mode and batch: the CPU, threads, answer
    length, sampled temperature and prompt cut."""
    return {"cpu": lscpu_model(), "threads": args.threads, "new_tokens": args.new_tokens,
            "temperature": args.temperature, "max_prompt_tokens": args.max_prompt_tokens}


def finished_rows(path: Path, settings: dict) -> dict[tuple, list]:
    """The rows of a `--rows` JSONL by (backend, mode, B): its first line is {"settings": ...}, each
    other line one row. {} if the file does not exist. Raises SystemExit when the file was written
    with other settings (naming them), or its first line is not a settings record."""
    if not path.is_file():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or not isinstance(lines[0], dict) or "settings" not in lines[0]:
        raise SystemExit(f"{path}: its first line is not a settings record of bench_regenerate.py; fix: give "
                         "--rows a new file")
    other = {k: (lines[0]["settings"].get(k), v) for k, v in settings.items() if lines[0]["settings"].get(k) != v}
    if other:
        raise SystemExit(f"{path}: its rows were measured with other settings ("
                         + ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in other.items())
                         + "); fix: give --rows a new file, or rerun with that file's settings")
    return {tuple(r[:3]): r for r in lines[1:]}


def append_row(path: Path, settings: dict, row: tuple) -> None:
    """Append one finished row to a `--rows` JSONL, starting the file with its settings record."""
    new = not path.is_file()
    with open(path, "a") as f:
        if new:
            f.write(json.dumps({"settings": settings}) + "\n")
        f.write(json.dumps(row) + "\n")


def time_regeneration(backend_name: str, mode: str, batches: list[int], args) -> list[tuple]:
    """(backend, mode, B, conversations, prompt tokens, answer tokens, seconds, engine start s) per batch size B."""
    from peagle_train.cli.regenerate import backend_from_config
    from peagle_train.config import compose

    over = [f"regenerate.backend={backend_name}", f"regenerate.max_new_tokens={args.new_tokens}",
            f"regenerate.batch_size={max(batches)}", "regenerate.drop_cut=false",
            f"regenerate.temperature={0 if mode == 'greedy' else args.temperature}",
            f"regenerate.output={args.tmp / 'unused.jsonl'}"]
    cfg = compose("regenerate", over)
    settings = run_settings(args)
    done = finished_rows(args.rows, settings) if args.rows else {}
    todo = [b for b in batches if (backend_name, mode, b) not in done]
    rows = [tuple(done[backend_name, mode, b]) for b in batches if b not in todo]
    if not todo:
        return rows
    backend, tok = backend_from_config(cfg.regenerate, cfg.target, cfg.data, "auto", seed=0)
    try:
        prompts = first_turns(max(batches), tok, args.max_prompt_tokens)
        backend.generate(prompts[:1], seeds=[0])  # warm-up (vllm: its engine start, timed apart)
        for b in todo:
            convs = prompts[:b]
            t0 = time.perf_counter()
            gens = backend.generate(convs, seeds=list(range(len(convs))))
            dt = time.perf_counter() - t0
            start = backend.summary()["load_seconds"] if backend_name == "vllm" else None
            rows.append((backend_name, mode, b, len(convs), prompt_tokens(tok, convs, backend.template_kwargs),
                         answer_tokens(tok, gens), dt, start))
            print(f"  {backend_name} {mode} B={b}: {rows[-1][5]} tokens in {dt:.1f} s", flush=True)
            if args.rows:
                append_row(args.rows, settings, rows[-1])
    finally:
        if hasattr(backend, "close"):
            backend.close()
    return sorted(rows, key=lambda r: r[2])


def time_forward(batches: list[int], args) -> tuple[float, list[tuple[int, float]]]:
    """(prefill tokens/s, [(B, decode tokens/s)]) of the target alone, in fp32."""
    import torch
    from transformers import DynamicCache

    from peagle_train.target.load import load_target

    import inspect

    model, _ = load_target("pkg:smollm2")
    V = model.config.vocab_size
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers ≥ 5.2x
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        x = torch.randint(0, V, (args.forward_batch, args.forward_len), generator=g)
        model(x[:, :8])  # warm-up
        t0 = time.perf_counter()
        model(x)
        prefill = x.numel() / (time.perf_counter() - t0)
        decode = []
        for b in batches:
            # the cache of `--forward-len` tokens: computed for up to 16 rows and repeated to b (a decode step's
            # cost does not depend on what the cache holds); only the last position's logits
            seed_rows = min(b, 16)
            ctx = torch.randint(0, V, (seed_rows, args.forward_len), generator=g)
            cache = DynamicCache(config=model.config)  # filled in place by each forward
            nxt = model(ctx, use_cache=True, logits_to_keep=1, **{kw: cache}).logits[:, -1:].argmax(-1)
            if b > seed_rows:
                cache.batch_repeat_interleave(-(-b // seed_rows))
                cache.batch_select_indices(torch.arange(b))
                nxt = nxt.repeat_interleave(-(-b // seed_rows), 0)[:b]
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                nxt = model(nxt, use_cache=True, **{kw: cache}).logits[:, -1:].argmax(-1)
            decode.append((b, b * args.decode_steps / (time.perf_counter() - t0)))
    return prefill, decode


def main() -> None:
    import tempfile

    import torch

    from peagle_train.precision import cpu_bf16_units

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap = bench_arguments(ap, ROOT / "docs" / "BENCHMARKS.md", threads=os.cpu_count())
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    ap.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    ap.add_argument("--new-tokens", type=int, default=128, help="max_new_tokens per answer")
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled mode's temperature")
    ap.add_argument("--forward-batch", type=int, default=8, help="rows of the prefill forward")
    ap.add_argument("--forward-len", type=int, default=512, help="tokens per row of the prefill forward, and the "
                                                                  "KV cache length of the decode steps")
    ap.add_argument("--decode-steps", type=int, default=16, help="one-token forwards timed per batch size")
    ap.add_argument("--rows", type=Path, help="a JSONL of finished rows: rows found there (same backend, mode and "
                                              "batch) are not run again, new ones are appended (a run cut short "
                                              "resumes); a file of other settings (CPU, threads, lengths) is refused")
    ap.add_argument("--max-prompt-tokens", type=int, default=512,
                    help="first turns longer than this are skipped, for both backends (0 = none): the in-process "
                         "engine pads a batch to its longest prompt, and 256 of ShareGPT's longest do not fit in 24 GiB")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}" if args.threads > 1 else "0")
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = Path(tmp)
        for backend in args.backends:
            for mode in args.modes:
                rows += time_regeneration(backend, mode, args.batches, args)
    prefill, decode = time_forward(args.batches, args)
    load1 = os.getloadavg()[0]
    cmd = (f"python benchmarks/bench_regenerate.py --batches {' '.join(map(str, args.batches))} --backends "
           f"{' '.join(args.backends)} --modes {' '.join(args.modes)} --new-tokens {args.new_tokens} --temperature "
           f"{args.temperature} --forward-batch {args.forward_batch} --forward-len {args.forward_len} "
           f"--decode-steps {args.decode_steps} --max-prompt-tokens {args.max_prompt_tokens} --threads {args.threads}")
    lines = [HEADING, "",
             f"`{cmd}`, {time.strftime('%Y-%m-%d')}: {lscpu_model()} (bf16 unit: {cpu_bf16_units() or 'none'}), "
             f"{args.threads} threads of {os.cpu_count()} cores, load average {load0:.1f} before / {load1:.1f} after; "
             f"SmolLM2-135M, first user turns of the default data (those over {args.max_prompt_tokens} tokens skipped). "
             "One backend call per row (first turns only).", "",
             "| backend | mode | batch | conversations | prompt tokens | answer tokens | seconds | answer tokens/s | "
             "engine start s |", "|---|---|---|---|---|---|---|---|---|"]
    for backend, mode, b, n, ptoks, toks, dt, start in rows:
        lines.append(f"| {backend} | {mode} | {b} | {n} | {ptoks} | {toks} | {dt:.1f} | {toks / dt:.0f} | "
                     f"{'' if start is None else f'{start:.1f}'} |")
    lines += ["", f"The target alone (in-process, fp32): prefill [{args.forward_batch} × {args.forward_len}] "
              f"{prefill:.0f} tokens/s; decode step over a {args.forward_len}-token cache: "
              + ", ".join(f"batch {b} {tps:.0f} tokens/s" for b, tps in decode) + ".", "",
              "Decode does a batch's worth of tokens per forward and reads every weight and the KV cache each "
              "step, so below a few hundred rows it is bound by memory bandwidth and per-step overhead, far under "
              "the prefill ceiling; regeneration adds padding (a sampled HF batch runs to its longest answer), "
              "sampling and re-rendering on top of the decode step."]
    publish(HEADING, "\n".join(lines), args)


if __name__ == "__main__":
    main()
