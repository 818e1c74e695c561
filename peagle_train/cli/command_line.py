"""The command-line layer over the schema (peagle_train/config.py): what runs before Hydra starts.

`check_or_exit(argv, command)` is called by every entry point: `--help` prints `describe(command)`
(every key with its type, default, help and allowed range); otherwise a misspelled key, a removed
key, a value outside a choice or an unknown recipe is refused with the near matches
(`check_command_line`), then the config Hydra will compose (every value of a `-m` sweep) is checked
by the schema's one validator, `config.config_problems` (`composed_problems`). A `-m` sweep
under several launched processes is refused (`multirun_problem`). Errors are one
`<program>: error:` line each on stderr, exit status 2.
"""

from __future__ import annotations

import difflib
import os
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

from ..config import (Key, _optional, _value_text, bad_value_message, compose, config_problems, schema_entries,
                      schema_keys, schema_of, type_name, unknown_key_message)
from ..paths import RECIPES_DIR


def describe(command: str = "train", group: str | None = None) -> str:
    """What `peagle <command> --help` prints: every key of the entry point's schema (or of one
    `group`), grouped, each with its type (the choices of an Enum), default and help.

    Raises ValueError for an unknown entry point or group (naming the groups)."""
    cls = schema_of(command)
    entries = schema_entries(cls)
    groups = [k.name for k in entries if k.is_group]
    if group is not None and group not in groups:
        near = difflib.get_close_matches(group, groups, n=2, cutoff=0.5)
        raise ValueError(f"no group '{group}' in {command}'s config." + (f" Did you mean {' or '.join(near)}?" if near
                         else "") + f" Groups: {', '.join(groups)}.")
    lines = [f"peagle {command}: {' '.join(cls.__doc__.split())}",
             "Settings are key=value (Hydra); recipe=NAME applies recipes/NAME.yaml first and the command line "
             "wins. Unknown keys, values outside a choice and numbers not allowed are refused."]
    width = max(len(k.name) for k in entries if not k.is_group) + 2

    def block(keys: list[Key]) -> None:
        for k in keys:
            lines.append(f"  {k.name:<{width}}{type_name(k.type)} = {_value_text(k.default)}")
            lines.extend(textwrap.wrap(k.help, 96, initial_indent=" " * 6, subsequent_indent=" " * 6))
            if k.range is not None:
                lines.append(" " * 6 + "allowed: " + k.range.text(False).removeprefix("a number ")
                             + (", null" if _optional(k.type) else ""))

    if group is None:
        block([k for k in entries if not k.is_group and "." not in k.name])
    for g in [k for k in entries if k.is_group and (group is None or k.name == group)]:
        lines += ["", f"{g.name}: {g.help}"]
        block([k for k in entries if not k.is_group and k.name.rsplit(".", 1)[0] == g.name])
    if group is None:
        lines += ["", f"recipes: {', '.join(recipe_names())}",
                  f"one group: peagle {command} --help GROUP ({', '.join(groups)})"]
    return "\n".join(lines) + "\n"


_OTHER_CONFIG = ("-cd", "--config-dir", "-cn", "--config-name", "-cp", "--config-path")
_MAX_SWEEP_CHECKS = 64


def _sweep_variants(overrides: list[str]) -> list[list[str]]:
    """The override lists whose configs cover every value of a `-m` sweep: every swept key at its
    first value, then each other value of each swept key in turn (the others at their first), at most
    `_MAX_SWEEP_CHECKS`. Empty when Hydra's parser refuses the overrides (Hydra reports that)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        values = [list(o.sweep_string_iterator()) if o.is_sweep_override() else None for o in parsed]
    except Exception:  # noqa: BLE001 - an interval sweep or a syntax error: left to Hydra
        return []
    first = [line if v is None or not v else f"{o.get_key_element()}={v[0]}"
             for line, o, v in zip(overrides, parsed, values)]
    variants = [first]
    for i, (o, v) in enumerate(zip(parsed, values)):
        for value in (v or [])[1:]:
            variants.append(first[:i] + [f"{o.get_key_element()}={value}"] + first[i + 1:])
    return variants[:_MAX_SWEEP_CHECKS]


def composed_problems(argv: list[str], command: str = "train") -> list[str]:
    """`config_problems` of the config Hydra will compose from the overrides in `argv`, composed here
    before Hydra starts (so that nothing is created or loaded for a config out of range); for a `-m`
    sweep, of every swept value (`_sweep_variants`), before its first job. Empty for another config
    directory, and for a config that does not compose (Hydra reports that itself). Each problem once."""
    if any(a in _OTHER_CONFIG or a.startswith(("--config-dir=", "--config-name=", "--config-path=")) for a in argv):
        return []
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    multirun = any(a in ("-m", "--multirun") for a in argv)
    problems: list[str] = []
    for variant in _sweep_variants(overrides) if multirun else [overrides]:
        try:
            cfg = compose(command, variant)
        except Exception:  # noqa: BLE001 - Hydra composes it again and reports the error with its own message
            continue
        problems += [p for p in config_problems(cfg, command) if p not in problems]
    return problems


def recipe_names(extra_dirs: tuple[Path, ...] = ()) -> list[str]:
    """Recipes of the package (and of `extra_dirs`, folders holding recipe/<name>.yaml)."""
    return sorted({p.stem for d in (RECIPES_DIR, *(Path(x) / "recipe" for x in extra_dirs)) for p in d.glob("*.yaml")})


def recipe_path(name: str, extra_dirs: tuple[Path, ...] = ()) -> Path:
    """recipes/<name>.yaml, or <dir>/recipe/<name>.yaml of a `hydra.searchpath` folder (later ones win,
    as in Hydra)."""
    for d in reversed([Path(x) / "recipe" for x in extra_dirs]):
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    return RECIPES_DIR / f"{name}.yaml"


def _leaf_items(node, keys: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of a recipe's settings: a dict is descended into unless the schema's key there
    is itself a value (data.template_kwargs, data.mix entries)."""
    out = []
    for k, v in node.items():
        if k in ("defaults", "hydra") and not prefix:
            continue
        key = prefix + str(k)
        leaf = keys.get(key, None) is not None
        out += _leaf_items(v, keys, key + ".") if isinstance(v, dict) and v and not leaf else [(key, v)]
    return out


def check_recipe(name: str, command: str = "train", extra_dirs: tuple[Path, ...] = ()) -> list[str]:
    """Errors for recipe `name`: it does not exist (listing those that do), has unknown or removed keys,
    or a value outside a choice."""
    path = recipe_path(name, extra_dirs)
    if not path.is_file():
        return [f"recipe '{name}' does not exist in {RECIPES_DIR}"
                + "".join(f" or {Path(d) / 'recipe'}" for d in extra_dirs)
                + f". Existing recipes: {', '.join(recipe_names(extra_dirs))}."]
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    keys = schema_keys(schema_of(command))
    errors = []
    for key, value in _leaf_items(node, keys):
        if value == {} and key in keys and keys[key] is None:
            continue  # an empty group ({})
        errors.append(unknown_key_message(key, str(path), command) or bad_value_message(key, value, str(path), command))
    return [e for e in errors if e]


def _searchpath(argv: list[str]) -> tuple[Path, ...]:
    """The folders of a `hydra.searchpath=[file://DIR, ...]` override (where extra recipes live)."""
    for arg in argv:
        if arg.startswith("hydra.searchpath="):
            items = arg.split("=", 1)[1].strip("[]").split(",")
            return tuple(Path(x.strip().strip("'\"").removeprefix("file://")) for x in items
                         if x.strip() and not x.strip().startswith("pkg://"))
    return ()


def _in_a_dict_value(key: str, keys: dict[str, Any]) -> bool:
    """`key` lies inside a dict-valued key of the schema (data.template_kwargs.enable_thinking)."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        t = keys.get(".".join(parts[:i]))
        if t is not None and (t is dict or typing.get_origin(t) is dict):
            return True
    return False


def check_command_line(argv: list[str], command: str = "train") -> list[str]:
    """Errors for the command-line overrides of entry point `command` (`key=value`, `-m` sweeps):
    unknown keys with near matches (also those added with +key= / ++key=, which Hydra would add
    silently; keys inside a dict value such as +data.template_kwargs.enable_thinking= are free),
    removed keys with their replacement, values outside a choice, unknown recipes with the list of
    recipes. Hydra's own keys (hydra.*) and deletions (~key) are left to Hydra. Raises ValueError for
    an unknown entry point."""
    keys = schema_keys(schema_of(command))
    extra = _searchpath(argv)
    errors = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        added, key = key.startswith("+"), key.lstrip("+")  # +key= / ++key= add keys: only where a dict takes them
        if key.startswith(("~", "hydra.", "hydra/")) or key == "hydra" or (added and _in_a_dict_value(key, keys)):
            continue
        if key == "recipe":
            for name in value.split(","):
                errors += check_recipe(name, command, extra)
        elif (m := unknown_key_message(key, "the command line", command)):
            errors.append(m)
        elif "(" not in value:  # sweep functions (choice(...), range(...)) are left to Hydra
            errors += [m for v in value.split(",")
                       if (m := bad_value_message(key, v.strip().strip("'\""), "the command line", command))]
    return errors


_WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # as Accelerate reads them


def launched_processes() -> int:
    """How many processes the launcher started (`accelerate launch`, torchrun, DeepSpeed's or an MPI
    launcher: the first of WORLD_SIZE, PMI_SIZE, OMPI_COMM_WORLD_SIZE, MV2_COMM_WORLD_SIZE that is
    set), 1 without a launcher."""
    for var in _WORLD_SIZE_VARS:
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var])
    return 1


def multirun_problem(argv: list[str], command: str = "train", processes: int | None = None) -> str | None:
    """The error for a Hydra multirun (`-m`, `--multirun`, `hydra.mode=MULTIRUN`) of entry point
    `command` in more than one process (`processes`, default `launched_processes()`), else None.

    A sweep runs its jobs one after another in the same processes, and a job ends by destroying the
    process group (`peagle train`: training/engines.py `end_distributed`, after which the main
    process evaluates and exports alone; `peagle features`: `Accelerator.end_training`). Accelerate
    makes its group once per process, so the second job would run without one. A multirun in one
    process is fine (a DeepSpeed or FSDP job reuses make_engine's 1-process group)."""
    processes = launched_processes() if processes is None else processes
    multirun = any(a in ("-m", "--multirun") or a.replace(" ", "").upper() == "HYDRA.MODE=MULTIRUN" for a in argv)
    if not multirun or processes <= 1:
        return None
    train = command == "train"  # its jobs tabled together afterwards
    return (f"a -m sweep cannot run under {processes} launched processes: each job destroys the process group "
            "when it ends and Accelerate makes it once per process, so the second job would have none. Fix: launch "
            f"one `accelerate launch --num_processes {processes} ... -m peagle_train.cli {command} key=value"
            + (" output_dir=DIR" if train else "") + "` per job (a shell loop over the swept values)"
            + (", then table them with `peagle sweep output_dir=NEW_DIR jobs=[DIR,...]`" if train else "")
            + f"; or run the sweep in one process (`peagle {command} -m ...`).")


def check_or_exit(argv: list[str] | None = None, command: str = "train") -> None:
    """Run before Hydra by every entry point. `--help` / `-h` in `argv` (default sys.argv[1:]): print
    `describe(command)` (or of the group named after it) and exit 0. Otherwise `check_command_line`,
    `multirun_problem` (a `-m` sweep under several launched processes), then `composed_problems`
    (ranges and rules between keys of the composed config); errors are printed as
    `<program>: error: ...` on stderr and the process exits with status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        names = [a for a in argv if not a.startswith("-") and "=" not in a]
        try:
            text = describe(command, names[0] if names else None)
        except ValueError as e:
            _exit(str(e))
        sys.stdout.write(text)
        raise SystemExit(0)
    errors = check_command_line(argv, command)
    if errors:
        _exit("\n  ".join(errors))
    problem = multirun_problem(argv, command)
    if problem:
        _exit(problem)
    problems = composed_problems(argv, command)
    if problems:
        _exit("\n  ".join(problems))


def _exit(message: str) -> None:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "peagle"
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)
