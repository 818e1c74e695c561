"""The `peagle plan` tables of the GPU recipes on 1 and 8 GPUs of 80 GB, for docs/TRAINING.md.

    python benchmarks/plan_tables.py              # print them and write the section into docs/TRAINING.md
    python benchmarks/plan_tables.py --no-docs    # print only

Runs the planner (peagle_train/plan.py `make_plan`, what `peagle plan recipe=NAME world_size=N
gpu_memory_gb=80` prints) for recipes/llama-3.1-8b-instruct.yaml, qwen3-8b.yaml and gpt-oss-20b.yaml:
a summary row per (recipe, GPUs), then each full table. No weights are read (the shipped target
configs, the head on the meta device).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_tables import publish
from peagle_train.config import compose
from peagle_train.plan import format_plan, make_plan
from peagle_train.training.memory import GIB, RESERVE_BYTES

HEADING = "## The GPU recipes planned (benchmarks/plan_tables.py)"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "TRAINING.md"
RECIPES = ("llama-3.1-8b-instruct", "qwen3-8b", "gpt-oss-20b")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DOCS, help=f"markdown file the section goes into (default {DOCS})")
    ap.add_argument("--no-docs", action="store_true", help="print the section only")
    ap.add_argument("--gpus", default="1,8")
    args = ap.parse_args()
    summary = ["| recipe | GPUs | engine | head (trainable) | peak per GPU (GiB, estimate) | optimizer steps | warm-up | "
               "checkpoints before the end | evaluation (min) | refused |", "|---|---|---|---|---|---|---|---|---|---|"]
    full = []
    for recipe in RECIPES:
        for world in (int(x) for x in args.gpus.split(",")):
            plan = make_plan(compose("plan", [f"recipe={recipe}", f"world_size={world}", "gpu_memory_gb=80"]))
            s, sc, hd = plan.settings, plan.schedule, plan.head
            eng = s["engine"] + (f" ZeRO-{s['zero_stage']}" if s["engine"] == "deepspeed" else "")
            summary.append(f"| {recipe} | {world} | {eng} | {hd['total'] / 1e9:.2f}B ({hd['trainable'] / 1e9:.2f}B) | "
                           f"{plan.memory['peak'] / GIB:.1f} (+ {RESERVE_BYTES / GIB:.0f} reserve) | {sc['steps']:,} | "
                           f"{sc['warmup_steps']} ({100 * sc['warmup_share']:.0f}%) | every {sc['save_every']}: "
                           f"{sc['checkpoints_before_end']} | {plan.evaluation.get('seconds', 0) / 60:.0f} | "
                           f"{'yes: ' + str(len(plan.problems)) if plan.problems else 'no'} |")
            full.append(format_plan(plan, title=f"recipe {recipe}").replace("## ", "### ", 1))
    section = (f"{HEADING}\n\n`python benchmarks/plan_tables.py`: `peagle plan recipe=NAME world_size=N gpu_memory_gb=80` for "
               "the three GPU recipes as they stand, on 1 and 8 GPUs. Estimates, not measurements (no GPU run has "
               "been made from this repository): the memory model is checked against real CPU steps "
               "(docs/BENCHMARKS.md, benchmarks/calibrate_plan.py); the steps count the recipes' 500,000 regenerated "
               "conversations at ShareGPT's mean length under SmolLM2's tokenizer (data.sources' counts × 1,352 "
               "tokens: an estimate until the regenerated file is prepared; a larger vocabulary cuts fewer tokens)."
               "\n\n"
               + "\n".join(summary) + "\n\n" + "\n".join(full))
    if args.no_docs:
        print(section)
        return

    class _Args:
        no_docs, out = False, args.out

    publish(HEADING, section, _Args)


if __name__ == "__main__":
    main()
