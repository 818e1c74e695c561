"""Plan a GPU run before renting the GPUs: memory per GPU, optimizer steps, warm-up, checkpoint and
validation cadence and the evaluation's time of a recipe at N GPUs, without loading any weights
(the target's config.json and the head on the meta device; peagle_train/plan.py).

    peagle plan recipe=llama-3.1-8b-instruct world_size=8 gpu_memory_gb=80
    peagle plan recipe=qwen3-8b world_size=1 data.prepared_dir=runs/qwen3/data     # the exact token count
    peagle plan recipe=gpt-oss-20b world_size=8 data_tokens=30000000 training.warmup_steps=20

Prints the tables (markdown) on stdout. A plan whose step cannot fit gpu_memory_gb (with a 2 GiB
reserve), whose warm-up is more than half of its optimizer steps, or whose checkpoint cadence never
fires before the end is refused: one `peagle plan: error:` line per problem with the fix, exit 2.
`peagle train` applies the same schedule rule once it knows the steps, and on a CUDA device the same
memory rule (training/checks.py, training/memory.py). The target's config comes from a local
directory or the HF cache, else from the config.json shipped for the GPU recipes' targets
(works offline). Data tokens: data_tokens=, else data.prepared_dir's summary.json, else the count
shipped for pkg:sharegpt (SmolLM2's tokenizer: an upper bound of the steps for larger vocabularies).
"""

from __future__ import annotations

import sys

HELP_FLAGS = ("-h", "--help")


def main(argv: list[str]) -> int:
    """The plan of `argv` (key=value overrides, recipe=NAME among them): prints the tables, then the
    refusals on stderr. Returns 0, or 2 when the plan is refused."""
    from peagle_train.config import check_config, compose
    from peagle_train.plan import format_plan, make_plan

    from .command_line import check_or_exit

    check_or_exit(argv, command="plan")
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    cfg = compose("plan", overrides)
    check_config(cfg, "plan")
    recipe = next((a.split("=", 1)[1] for a in overrides if a.startswith("recipe=")), None)
    plan = make_plan(cfg)
    sys.stdout.write(format_plan(plan, title=f"recipe {recipe}" if recipe else "peagle plan"))
    sys.stdout.flush()
    if plan.problems:
        sys.stderr.write("".join(f"peagle plan: error: {p}\n" for p in plan.problems))
        return 2
    return 0


def run(argv: list[str] | None = None) -> int:
    """`peagle plan key=value ...` (argv: the overrides, default sys.argv[1:]); `--help` prints this
    module's text, the recipes and the keys. A user error is one line and exit status 2."""
    from peagle_train.runtime import cli_main

    from .command_line import recipe_names

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in HELP_FLAGS for a in argv):
        print(__doc__.strip() + "\n\nRecipes (recipe=NAME): " + ", ".join(recipe_names()) + "\n")
    return cli_main(main)(argv)
