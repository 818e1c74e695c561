"""Calibrate `peagle plan`'s memory model on this CPU: the draft's activation estimate
(peagle_train/training/memory.py `estimate_step_memory`) beside the measured peak memory of one real
training step (algorithms/peagle.py `draft_step`, forward and backward, the trainer's own code).

    python benchmarks/calibrate_plan.py                  # the table, written to docs/BENCHMARKS.md
    python benchmarks/calibrate_plan.py --no-docs        # print it only

Each configuration runs in a forked child (benchmarks/forking.py), which builds the head and one packed
row (random features and target logits: memory does not depend on the values) and then measures the
growth of its peak RSS (ru_maxrss) over one step: the draft's activations plus the head's gradients
(4 B per parameter, allocated by the backward), the quantities the estimate gives as
draft_activations + attention_mask + head_grads. The row and the weights exist before the baseline.
The step runs as `peagle train` runs it on this machine: `precision=auto` (bf16 autocast where the
CPU multiplies bf16), `training.attention=auto` (the sparse plan on CPU: its mask builds nothing
quadratic). A second table measures FlexAttention's eager mask build (`create_block_mask` uncompiled, as on a
CPU; CUDA compiles it) at two sizes: bytes per (query, key) pair, the model's FLEX_MASK_BYTES_PER_PAIR.
Peak RSS counts live memory only if freed memory goes back to the system: the script runs under
MALLOC_MMAP_THRESHOLD_=131072 (it restarts itself with it), which stops glibc from raising its
threshold and keeping freed blocks of up to 32 MiB in its heap (without it, the RSS of a
gradient-checkpointed step grows by tens of MiB per layer that no tensor holds).
Memory only: other work on the machine changes no number here (each child's peak is its own).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

from forking import forked  # benchmarks/forking.py (benchmarks/ is on sys.path when a script runs)
from peagle_train.algorithms.cod import attention_kind, cod_block_mask, cod_sample
from peagle_train.algorithms.peagle import draft_step
from bench_tables import bench_arguments, publish
from peagle_train.draft import DraftConfig, make_draft_head
from peagle_train.features.rows import PackedRow
from peagle_train.precision import autocast_context, cpu_bf16_units, resolve_precision
from peagle_train.training.memory import FLEX_MASK_BYTES_PER_PAIR, GIB, estimate_step_memory, head_parameters

MMAP_THRESHOLD = 131072  # bytes: every larger block is its own mapping, returned to the system when freed
HEADING = "## Memory model of `peagle plan` against measured steps (benchmarks/calibrate_plan.py)"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"

# Heads: SmolLM2-135M's sizes (Llama layers) and a wider Qwen3-style one (q/k norms), both small enough
# for a CPU step; the target's own config only sizes the head here (no target is run).
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
               head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192, target_hidden_size=576,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, aux_layer_ids=[2, 15, 27])
WIDE = dict(vocab_size=65536, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=4,
            head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=8192, target_hidden_size=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, aux_layer_ids=[2, 14, 25],
            model_type="qwen3", qk_norm=True)
# (name, sizes, layers, draft vocabulary, row tokens, max_anchors, partitions, gradient checkpointing,
#  precision: auto = what `peagle train` resolves here; bf16 = the GPUs' autocast, forced)
CONFIGS = [
    ("smollm2, 1 layer", SMOLLM2, 1, 8192, 2048, None, 1, False, "auto"),
    ("smollm2, 4 layers, ckpt", SMOLLM2, 4, 8192, 2048, None, 1, True, "auto"),
    ("smollm2, 4 layers, ckpt, 2 parts", SMOLLM2, 4, 8192, 4096, 256, 2, True, "auto"),
    ("wide, 2 layers, ckpt", WIDE, 2, 16384, 2048, 512, 1, True, "auto"),
    ("smollm2, 4 layers, ckpt", SMOLLM2, 4, 8192, 2048, None, 1, True, "bf16"),
    ("wide, 2 layers, ckpt", WIDE, 2, 16384, 2048, 512, 1, True, "bf16"),
]


class _HF:
    """The few HF-config fields estimate_step_memory reads of the target."""

    def __init__(self, sizes: dict):
        self.hidden_size, self.intermediate_size = sizes["hidden_size"], sizes["intermediate_size"]
        self.vocab_size, self.num_hidden_layers = sizes["vocab_size"], 30


def measure(name, sizes, layers, vocab, n, anchors, parts, ckpt, precision="auto") -> dict:
    """One step of `draft_step` in this (forked) process: measured peak RSS growth and the estimate."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = DraftConfig(num_hidden_layers=layers, num_depths=8, draft_vocab_size=vocab, mask_token_id=sizes["vocab_size"] - 1,
                      norm_before_fc=True, gradient_checkpointing=ckpt, **sizes)
    head = make_draft_head(cfg).train()
    H3 = 3 * sizes["hidden_size"]
    prec = resolve_precision(precision, "cpu")
    g = torch.Generator().manual_seed(0)
    feat_dtype = torch.bfloat16 if prec.is_bf16 else torch.float32
    row = PackedRow(torch.randint(0, sizes["vocab_size"] - 1, (n,), generator=g), torch.randn(n, H3, generator=g).to(feat_dtype),
                    torch.randn(n, vocab, generator=g), torch.ones(n, dtype=torch.bool),
                    torch.zeros(n, dtype=torch.long), torch.arange(n))
    el = cod_sample(row.valid, row.doc_ids, 8, 0.7, 0.2, anchors, g)
    attention = attention_kind("auto", "cpu")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with autocast_context(prec, torch.device("cpu")):
        draft_step(head, row, el, "kl", 8, partitions=parts, attention=attention)
    measured = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    hp = head_parameters(cfg)
    est = estimate_step_memory(_HF(sizes), cfg, n, anchors, 8, 1, "ddp", partitions=parts, attention=attention,
                               act_bytes=2 if prec.is_bf16 else 4, feature_bytes=2 if prec.is_bf16 else 4,
                               online=False, head_params=hp, target_params={"total": 0, "active": 0}, mask_compiled=False)
    predicted = est["draft_activations"] + est["attention_mask"] + est["head_grads"]
    return {"name": name, "tokens": n, "anchors": anchors, "parts": parts, "elements": int(el.anchors.numel()),
            "model_elements": est["elements"], "params": hp["total"], "activations": est["draft_activations"],
            "grads": est["head_grads"], "predicted": predicted, "measured": measured, "precision": prec.name,
            "attention": attention}


def flex_mask(n: int) -> dict:
    """Peak RSS growth of FlexAttention's `create_block_mask` over one row of n tokens, all anchors."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    docs = torch.zeros(n, dtype=torch.long)
    el = cod_sample(torch.ones(n, dtype=torch.bool), docs, 8, 0.7, 0.2, None, g)
    M = int(el.anchors.numel())
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cod_block_mask(el.anchors, el.depths, docs)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    return {"tokens": n, "elements": M, "bytes": grew, "per_pair": grew / (M * M)}


READING = ("How to read it: the estimate counts every gradient beside the activations' peak, though the "
           "largest (embed_tokens') is written last, when the activations are mostly freed, so it reads high by "
           "up to the gradients; the activations alone are modelled from what autograd keeps per COD element "
           "(tests/unit/test_plan.py checks the forward's saved tensors against the model within 10%). A ratio above "
           "1 would mean the planner under-estimates; `peagle plan` adds a 2 GiB reserve per GPU on top.\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = bench_arguments(ap, DOCS).parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MMAP_THRESHOLD):  # glibc reads it at start-up: run again
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
    load_before = os.getloadavg()
    rows = [forked(measure, *c) for c in CONFIGS]
    masks = [forked(flex_mask, n) for n in (1024, 2048)]
    load_after = os.getloadavg()
    bad = [r for r in rows + masks if "error" in r]
    if bad:
        raise SystemExit(f"calibrate_plan: {bad}")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((x.split(":", 1)[1].strip() for x in lscpu.splitlines() if x.startswith("Model name")), "?")
    out = ["| configuration | precision | row tokens | anchors | partitions | COD elements (model / sampled) | head "
           "parameters | estimate: activations + gradients (MiB) | measured peak growth (MiB) | measured / estimate |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['precision']} | {r['tokens']:,} | {r['anchors'] or 'all'} | {r['parts']} | {r['model_elements']:,} / "
                   f"{r['elements']:,} | {r['params'] / 1e6:.1f}M | {r['activations'] / 2**20:,.0f} + {r['grads'] / 2**20:,.0f} "
                   f"= {r['predicted'] / 2**20:,.0f} | {r['measured'] / 2**20:,.0f} | {r['measured'] / r['predicted']:.2f} |")
    mask_rows = ["| row tokens | COD elements M | create_block_mask peak growth (MiB) | bytes per (query, key) pair |",
                 "|---|---|---|---|"]
    mask_rows += [f"| {m['tokens']:,} | {m['elements']:,} | {m['bytes'] / 2**20:,.0f} | {m['per_pair']:.1f} |" for m in masks]
    section = (f"{HEADING}\n\n`python benchmarks/calibrate_plan.py`: CPU {model} (lscpu); bf16 unit: {cpu_bf16_units() or 'none'}; torch {torch.__version__}, "
               f"1 thread per configuration, each in a forked child; attention {rows[0]['attention']} and precision "
               f"{rows[0]['precision']} (what `peagle train` runs here), then bf16 autocast forced (the GPUs' precision; "
               f"bf16 features); load average {load_before[0]:.1f} before, "
               f"{load_after[0]:.1f} after (memory only: the load changes no number). K_train 8, r 0.7, r_min 0.2, "
               "forward KL, norm_before_fc; measured = growth of the process's peak RSS over one `draft_step` "
               f"(forward and backward) from after the head and the row exist, glibc's mmap threshold fixed at "
               f"{MMAP_THRESHOLD} bytes so that freed blocks leave the RSS; estimate = draft_activations + "
               "attention_mask + head_grads of `estimate_step_memory` (peagle_train/training/memory.py), the terms "
               "the step allocates.\n\n" + "\n".join(out)
               + f"\n\nFlexAttention's block mask built eagerly (CPU; CUDA compiles the build, block by block, and keeps "
               f"only the block tables), all anchors, K 8; the model takes FLEX_MASK_BYTES_PER_PAIR = "
               f"{FLEX_MASK_BYTES_PER_PAIR:g} bytes per pair for an eager build:\n\n"
               + "\n".join(mask_rows) + "\n\n" + READING)
    publish(HEADING, section, args)


if __name__ == "__main__":
    main()
