"""The `peagle` command: one subcommand per stage, every argument a Hydra-style `key=value`.

    peagle                                   # the subcommands, one line each
    peagle train recipe=smollm2-135m-demo output_dir=runs/demo
    peagle train --help                      # the keys of `train`, with their comments
    python -m peagle_train.cli train ...     # the same without the console script
    accelerate launch -m peagle_train.cli train ...

Each subcommand lives in `peagle_train/cli/<name>.py` as a Hydra main (`cli_main(config_path=CONF_DIR,
...)`, see peagle_train/runtime.py) behind `run(argv)`; `train.py` is a shim that calls the same
`run`. Subcommands composed on the typed schema (peagle_train/config.py) check the command line with
`check_or_exit` before Hydra starts. `sweep` and `convert-features` take `key=value` pairs too
(`parse_pairs`), without Hydra: they only read job or feature folders.
"""

from __future__ import annotations

import difflib
import importlib
import sys

# name → (module under peagle_train.cli, one line of help)
COMMANDS = {
    "prepare": ("prepare", "conversations → token rows, draft vocabulary, mask token (data.prepared_dir for train)"),
    "regenerate": ("regenerate", "rewrite the assistant turns of a conversation file with the target (self-distillation)"),
    "features": ("features", "write offline target features (aux + final hidden states) for a recipe's data"),
    "convert-features": ("convert_features", "re-store an offline features directory in another dtype (int8, bf16), without the target"),
    "train": ("train", "prepare data → train a P-EAGLE head → evaluate τ → export (the main job)"),
    "evaluate": ("evaluate", "acceptance length τ, speed and latency of a head with the reference decoder"),
    "export": ("export", "export a checkpoint in the speculators / vLLM format, or validate an export"),
    "recommend-k": ("recommend_k", "K (num_speculative_tokens) per batch size from measured acceptance and step costs"),
    "plan": ("plan", "memory per GPU, steps, warm-up and checkpoint cadence of a config at N GPUs, without weights"),
    "sweep": ("sweep", "table and plot over the jobs of a `peagle train -m` sweep (or of several sweeps)"),
}
HELP_FLAGS = ("-h", "--help")


def usage() -> str:
    """The subcommands with one line each (`peagle`, `peagle --help`)."""
    width = max(map(len, COMMANDS))
    lines = ["usage: peagle <command> [key=value ...]   (peagle <command> --help: its keys)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "Every argument is a key=value override (Hydra); e.g. peagle train recipe=smollm2-135m-demo "
              "output_dir=runs/demo"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`peagle <command> key=value ...`: runs the command's `run` with sys.argv set as for a script
    (program name "peagle <command>", so that errors read `peagle train: error: ...`).
    Returns the exit status; an unknown command exits 2 with the near matches."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in HELP_FLAGS:
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        near = difflib.get_close_matches(name.replace("_", "-"), list(COMMANDS), n=2, cutoff=0.5)
        hint = f" Did you mean {' or '.join(near)}?" if near else ""
        sys.stderr.write(f"peagle: error: unknown command '{name}'.{hint}\n\n{usage()}\n")
        return 2
    sys.argv = [f"peagle {name}", *rest]
    from ..runtime import guarded

    # Ctrl-C while the command's modules load prints one line too
    return guarded(lambda: importlib.import_module(f"{__name__}.{COMMANDS[name][0]}").run(rest) or 0)()


# --- shared by the subcommands ------------------------------------------------------------------


def run_hydra(hydra_main, argv: list[str] | None, doc: str, command: str) -> int:
    """Run one Hydra subcommand: `--help` prints `doc`, the recipes and the keys of the command's
    schema with their help (`command_line.describe`); otherwise misspelled keys, values outside a choice
    and unknown recipes are refused with the near matches before Hydra starts (`check_or_exit`);
    then `hydra_main()` parses sys.argv as usual. A recipe that is not valid YAML is one error line
    (file, line, column). Returns 0."""
    from .command_line import check_or_exit, recipe_names
    from ..runtime import guarded

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in HELP_FLAGS for a in argv):
        print(doc.strip() + "\n\nRecipes (recipe=NAME): " + ", ".join(recipe_names()) + "\n")
    guarded(check_or_exit)(argv, command=command)  # --help: prints the keys and exits 0; a recipe's YAML error: one line
    hydra_main()
    return 0


def parse_pairs(argv: list[str], schema, doc: str):
    """`key=value` arguments of a command without Hydra into an OmegaConf object of dataclass
    `schema` (values typed as OmegaConf parses them: `jobs=[a,b]` is a list; a nested dataclass
    field takes dotted keys, `features.dir=...`).

    `--help` prints `doc` and the keys, then exits 0. Raises ConfigError naming an argument
    that is not `key=value`, an unknown key (with the near matches), a value of the wrong type or
    outside the range its field declares (`config.opt(..., ge=1)`, `config.range_problems`, as for
    the Hydra commands); and a required key (a field without default) left unset."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ..config import range_problems
    from ..errors import ConfigError

    base = OmegaConf.structured(schema)
    keys = _leaf_keys(base)
    if any(a in HELP_FLAGS for a in argv):
        print(doc.strip() + "\n\nKeys: " + ", ".join(keys))
        raise SystemExit(0)
    for a in argv:
        if "=" not in a:
            raise ConfigError(f"argument '{a}' is not key=value. Keys: {', '.join(keys)}.")
        key = a.split("=", 1)[0]
        if key not in keys:
            near = difflib.get_close_matches(key, keys, n=2, cutoff=0.6)
            hint = f" Did you mean {' or '.join(near)}?" if near else ""
            raise ConfigError(f"unknown key '{key}' on the command line.{hint} Keys: {', '.join(keys)}.")
    try:
        cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(list(argv)))
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {str(e).splitlines()[0]}") from e
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"give {', '.join(f'{k}=...' for k in missing)}.")
    problems = range_problems(cfg, schema)  # the ranges written with the schema's fields (config.opt)
    if problems:
        raise ConfigError("\n  ".join(problems))
    return cfg


def _leaf_keys(node, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    out = []
    for k in node.keys():
        v = node._get_node(k)
        out += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, DictConfig) else [f"{prefix}{k}"]
    return out
