"""Benchmark: share of the training step spent outside target and draft compute (online features).

    python benchmarks/bench_train_overhead.py [--steps 12] [--conversations 60] [--tokens-per-step 1024] [--threads N]
        [--out FILE | --no-docs]

Runs `training.trainer.train` on SmolLM2-135M-Instruct (pkg:smollm2) and ShareGPT with the demo
recipe's head (1 layer, K = 8), timing every target forward (FeatureTarget.__call__), every draft
forward+backward (`draft_step`) and the optimizer step; "other" = step − those three (row packing,
EAGLE alignment, COD sampling, metric reduction, logging, checkpoint-free). The first step is a
warm-up and excluded. Prints a table and writes it into docs/BENCHMARKS.md under its own heading.
Goal: other < 5% of the step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from bench_tables import bench_arguments, machine_line, write_section
from peagle_train.config import default_config
from peagle_train.data.prepare import prepare_data
from peagle_train.jobs.builders import build_draft, build_target
from peagle_train.paths import RECIPES_DIR, resolve_path
from peagle_train.target.capture import FeatureTarget
from peagle_train.algorithms import peagle
from peagle_train.training import trainer
from peagle_train.training.checks import TrainSettings

HEADING = "## Training-step overhead with online features"


def timed(fn, bucket: list):
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        bucket.append((time.perf_counter(), time.perf_counter() - t))  # (end time, duration)
        return out
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--conversations", type=int, default=80)
    ap.add_argument("--tokens-per-step", type=int, default=1024)
    args = bench_arguments(ap, Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md",
                           threads=None).parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = default_config()
    recipe = OmegaConf.load(RECIPES_DIR / "smollm2-135m-demo.yaml")
    cfg = OmegaConf.merge(cfg, recipe)
    target, tok = build_target(cfg.target, "cpu")
    data = prepare_data(resolve_path(cfg.data.path), tok, target.config.vocab_size,
                        num_conversations=args.conversations, max_length=cfg.data.max_length,
                        min_supervised_tokens=cfg.data.min_supervised_tokens, draft_vocab_size=cfg.data.draft_vocab_size,
                        seed=0)
    draft = build_draft(target, cfg.draft, data.vocab, data.mask_token_id)
    train_cfg = TrainSettings(OmegaConf.merge(cfg.training, {"tokens_per_step": args.tokens_per_step,
                                                             "max_steps": args.steps, "max_minutes": None,
                                                             "warmup_steps": 1}),  # a few timed steps: no warm-up
                              draft=cfg.draft, algorithm="peagle", seed=0)
    t_target, t_draft, t_opt = [], [], []
    FeatureTarget.__call__ = timed(FeatureTarget.__call__, t_target)
    peagle.draft_step = timed(peagle.draft_step, t_draft)
    torch.optim.AdamW.step = timed(torch.optim.AdamW.step, t_opt)
    marks = []
    real_metrics = trainer.metrics_from_counts
    trainer.metrics_from_counts = lambda c: (marks.append(time.perf_counter()), real_metrics(c))[1]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        res = trainer.train(Accelerator(cpu=True), draft, target, data.rows, data.vocab.draft_ids, train_cfg, Path(tmp))
    n = res["steps"]
    # step boundaries: the per-step metrics call; steps 2..n (step 1 is the warm-up)
    step_marks = [t0] + marks[:n]
    calls_per_step = len(t_target) / n
    after_warmup = step_marks[1]  # everything that ended after step 1 belongs to the timed steps 2..n
    step_total = step_marks[n] - after_warmup
    target_total, draft_total, opt_total = (sum(d for end_t, d in b if end_t > after_warmup)
                                            for b in (t_target, t_draft, t_opt))
    other = step_total - target_total - draft_total - opt_total
    rows = [("target forward (features + logits)", target_total), ("draft forward + backward", draft_total),
            ("optimizer step", opt_total), ("other (packing, alignment, COD, metrics, logging)", other)]
    load = os.getloadavg()
    table = [f"SmolLM2-135M-Instruct target (fp32, online), demo head (1 layer, K = 8), {n - 1} timed steps of "
             f"~{args.tokens_per_step} tokens after 1 warm-up, {res['tokens']} tokens in all; "
             f"{machine_line()}, {torch.get_num_threads()} threads, torch {torch.__version__}; load average "
             f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (`uptime`, machine shared by other jobs). "
             f"{calls_per_step:.1f} target forwards per step (one per packed row).", "",
             "| part | seconds per step | share of step |", "|---|---|---|"]
    table += [f"| {name} | {t / (n - 1):.3f} | {100 * t / step_total:.1f}% |" for name, t in rows]
    table += [f"| step | {step_total / (n - 1):.3f} | 100% |", "",
              f"Outside target and draft compute (optimizer included): "
              f"{100 * (other + opt_total) / step_total:.1f}%; excluding the optimizer: {100 * other / step_total:.1f}% "
              f"(goal < 5%). Run: `python benchmarks/bench_train_overhead.py --steps {args.steps} --conversations "
              f"{args.conversations} --tokens-per-step {args.tokens_per_step}`."]
    text = "\n".join(table)
    print(text)
    if not args.no_docs:
        write_section(HEADING, f"{HEADING}\n\n{text}\n", args.out)


if __name__ == "__main__":
    main()
