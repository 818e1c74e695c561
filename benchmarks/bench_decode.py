"""Benchmark of decoding step costs at batch 1: target-alone step, speculative step (drafting, the
(K+1)-token verify and bookkeeping) and their ratio, in fp32 and bf16, for this tree's decoding
engine and, side by side in the same run, another checkout's code (e.g. main before the engine).

    git worktree add --detach /tmp/base main   # the code to compare with (optional)
    python benchmarks/bench_decode.py --head /tmp/h18/checkpoint --base /tmp/base [--num-prompts 2]

One process, one torch thread, on the SmolLM2-135M-Instruct target (pkg:smollm2) with the given
head, greedy, K = 5, MT-Bench first turns. The other checkout's per-sequence decoder (its
tests/reference_decoder.py; in checkouts before bd2cd07, the decoder.py of its package's decoding
folder) is loaded beside this tree's engine and runs on the same target and head weights. This
tree's engine runs on a copy whose bf16 linears are packed for oneDNN and, on a CPU with AMX, for
the AMX kernel, with its norms fused (`fuse_ops`) and the AMX attention, as
`peagle evaluate` decodes; with AMX a third copy runs oneDNN's kernels only. The codes alternate prompt by prompt, so that a shared machine's load hits
all of them. Step ms = wall time after the first token ÷ decoding steps (target alone: one token
per step; speculative: one verify step). The baseline of every ratio and speedup is the fastest
target-alone step in the table (fp32 or bf16, whichever is faster here). Prints a table and
replaces the decoding section of docs/BENCHMARKS.md (with CPU model, bf16 unit and load average).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "BENCHMARKS.md"  # where the table goes by default (--out)
HEADING = "## Decoding step costs (benchmarks/bench_decode.py)"
OLD_HEADING = "## Reference decoder (benchmarks/bench_decode.py)"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def _prompts(tok, n: int) -> list[list[int]]:
    from peagle_train.paths import resolve_path

    out = []
    for line in resolve_path("pkg:spec_bench").read_text().splitlines():
        q = json.loads(line)
        if q["category"] in MT_BENCH and len(out) < n:
            ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def _old_decoder(base: Path):
    """The per-sequence decoder of another checkout `base` (its tests/reference_decoder.py, or in
    checkouts before bd2cd07 the decoder.py of its package's decoding folder), loaded as a module of
    this tree's package, so that it runs on the same target and head objects. Raises SystemExit
    when `base` holds neither."""
    import importlib.util
    import sys

    found = [p for p in (base / "tests" / "reference_decoder.py", base / "peagle_train" / "decoding" / "decoder.py")
             if p.is_file()]
    if not found:
        raise SystemExit(f"--base {base}: no per-sequence decoder there (tests/reference_decoder.py, or the decoding "
                         "package's decoder.py before bd2cd07). Fix: --base <a checkout of this repository>")
    spec = importlib.util.spec_from_file_location("peagle_train.decoding._base_decoder", found[0])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def measure(args, dtype, name: str) -> list[dict]:
    """Decode the prompts with the target alone and with the head, with this tree's engine and
    (with --base) the other checkout's decoder, interleaved prompt by prompt and round by round so
    that both see the same load. Returns one row per code."""
    import copy

    import torch
    from omegaconf import OmegaConf

    from peagle_train.decoding.engine import generate
    from peagle_train.accel.cpu import fuse_ops, pack_linears
    from peagle_train.accel.cpu.attention import use_amx_attention
    from peagle_train.jobs.builders import build_target

    from peagle_train.draft.head_files import load_head

    head = load_head(args.head)[0].eval()
    target_cfg = OmegaConf.create(dict(path="pkg:smollm2", dtype="float32", aux_layer_ids=list(head.config.aux_layer_ids)))
    target, tok = build_target(target_cfg, "cpu")
    target.model.to(dtype)
    head.to(dtype)
    # this tree's engine decodes as `evaluate` does: bf16 linears packed for oneDNN (a second copy,
    # so that the other checkout's decoder keeps the plain modules)
    fast, fast_head = build_target(target_cfg, "cpu")[0], copy.deepcopy(head)
    fast.model.to(dtype)
    packed = pack_linears(fast.model) + pack_linears(fast_head)
    fuse_ops(fast.model), fuse_ops(fast_head), use_amx_attention(fast.model)
    prompts = _prompts(tok, args.num_prompts)
    eos, K, N = {tok.eos_token_id}, args.k, args.max_new_tokens
    amx = any(getattr(m, "amx", None) is not None for m in fast.model.modules())
    label = ("this tree (engine, AMX bf16 linears)" if amx else "this tree (engine, packed bf16 linears)" if packed
             else "this tree (engine)")
    codes = {label: (lambda ids: generate(fast, None, [ids], K, N, eos)[0],
                    lambda ids: generate(fast, fast_head, [ids], K, N, eos)[0])}
    if amx:  # the same engine with oneDNN's kernels only, side by side (what the AMX kernel replaces)
        dnn, dnn_head = build_target(target_cfg, "cpu")[0], copy.deepcopy(head)
        dnn.model.to(dtype)
        pack_linears(dnn.model), pack_linears(dnn_head), fuse_ops(dnn.model), fuse_ops(dnn_head), use_amx_attention(dnn.model)
        for m in [*dnn.model.modules(), *dnn_head.modules()]:
            if getattr(m, "amx", None) is not None:
                m.amx = None
        codes["this tree (engine, oneDNN bf16 linears)"] = (lambda ids: generate(dnn, None, [ids], K, N, eos)[0],
                                                            lambda ids: generate(dnn, dnn_head, [ids], K, N, eos)[0])
    if args.base:
        old = _old_decoder(Path(args.base))
        codes = {"main (per-sequence decoder)": (lambda ids: old.target_generate(target, ids, N, eos),
                                                 lambda ids: old.speculative_generate(target, head, ids, K, N, eos)),
                 **codes}
    runs = {c: ([], []) for c in codes}
    with torch.no_grad():
        for alone, spec in codes.values():  # warm-up
            alone(prompts[0][:32]), spec(prompts[0][:32])
        for _ in range(args.rounds):
            for p in prompts:
                for c, (alone, spec) in codes.items():
                    runs[c][0].append(alone(p))
                for c, (alone, spec) in codes.items():
                    runs[c][1].append(spec(p))

    def step_ms(results, steps):
        return 1000 * sum(r.seconds - r.first_token_seconds for r in results) / max(steps, 1)

    rows = []
    for c, (base, sp) in runs.items():
        n_steps = sum(len(r.accepted) for r in sp)
        rows.append({
            "code": c, "precision": name, "context": sum(len(p) for p in prompts) / len(prompts),
            "target_step_ms": step_ms(base, sum(len(r.tokens) - 1 for r in base)),
            "target_tps": sum(len(r.tokens) for r in base) / sum(r.seconds for r in base),
            "spec_step_ms": step_ms(sp, n_steps),
            "draft_ms": 1000 * sum(r.draft_seconds for r in sp) / max(n_steps, 1),
            "verify_ms": 1000 * sum(r.target_seconds - r.first_token_seconds for r in sp) / max(n_steps, 1),
            "tau": sum(a + 1 for r in sp for a in r.accepted) / max(n_steps, 1),
            "spec_tps": sum(len(r.tokens) for r in sp) / sum(r.seconds for r in sp),
            "mismatches": sum(s.tokens != b.tokens for s, b in zip(sp, base)), "turns": len(sp),
        })
    return rows




def table(rows: list[dict]) -> str:
    best = min(r["target_step_ms"] for r in rows)
    out = ["| code | precision | target step (ms) | target tokens/s | speculative step (ms) | draft + verify (ms) | "
           "speculative ÷ fastest target step | τ | speculative tokens/s | speedup vs fastest target | mismatches |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    best_tps = max(r["target_tps"] for r in rows)
    for r in rows:
        out.append(f"| {r['code']} | {r['precision']} | {r['target_step_ms']:.1f} | {r['target_tps']:.2f} | "
                   f"{r['spec_step_ms']:.1f} | {r['draft_ms']:.1f} + {r['verify_ms']:.1f} | "
                   f"{r['spec_step_ms'] / best:.2f}× | {r['tau']:.3f} | {r['spec_tps']:.2f} | "
                   f"{r['spec_tps'] / best_tps:.2f}× | {r['mismatches']}/{r['turns']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True, help="a training checkpoint (runs/<run>/checkpoint)")
    ap.add_argument("--base", default=None, help="another checkout (git worktree add --detach /tmp/base main) whose "
                    "per-sequence decoder (tests/reference_decoder.py) runs beside this tree's engine")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=2, help="times every prompt is decoded by every code (interleaved)")
    from bench_tables import bench_arguments, write_section

    args = bench_arguments(ap, DOCS).parse_args()
    from bench_tables import cpu_model
    from peagle_train.precision import cpu_bf16_units

    import torch

    torch.set_num_threads(args.threads)
    load_before, t0, rows = os.getloadavg(), time.time(), []
    for prec in args.precisions.split(","):
        print(f"{prec} ...", flush=True)
        rows += measure(args, {"fp32": torch.float32, "bf16": torch.bfloat16}[prec], prec)
    load_after = os.getloadavg()

    md = "\n".join([
        HEADING, "",
        f"SmolLM2-135M-Instruct target (pkg:smollm2), head `{args.head}`, batch 1, greedy, K = {args.k}, "
        f"{args.max_new_tokens} new tokens, {args.num_prompts} MT-Bench first turns (mean prompt "
        f"{rows[0]['context']:.0f} tokens). {cpu_model()} (bf16 unit: {cpu_bf16_units() or 'none'}), "
        f"{args.threads} torch thread(s), every prompt decoded {args.rounds}× by each code, interleaved, torch {torch.__version__}; load average {load_before[0]:.1f} before / "
        f"{load_after[0]:.1f} after ({(time.time() - t0) / 60:.1f} min; the machine was shared, so absolute "
        "times are noisy).", "",
        table(rows), "",
        "Step = wall time after the first token ÷ decoding steps (target alone: 1 token per step; speculative: "
        "one draft + (K+1)-token verify + bookkeeping per step). The fastest target-alone step of the table is the "
        "baseline of the ratio and of the speedup. Mismatches: turns whose speculative output differs from the "
        "target alone in the same precision (greedy; bf16 rounding differs between a 1-token and a "
        f"{args.k + 1}-token forward; `peagle evaluate` therefore compares below fp32 with the target alone decoded "
        "in the verifier's numerics, `lossless_mismatches` in acceptance.json).", "",
    ])
    print(md)
    if not args.no_docs:
        text = args.out.read_text() if args.out.is_file() else ""
        print(f"wrote {write_section(OLD_HEADING if OLD_HEADING in text else HEADING, md, args.out)}")


if __name__ == "__main__":
    main()
