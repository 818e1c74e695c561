"""Measure acceptance length τ, speed and latency of a trained head with the reference decoder.

    peagle evaluate head=runs/demo/checkpoint output_dir=runs/demo-eval [eval.num_prompts=80]
    peagle evaluate head=runs/p/checkpoint baseline_head=runs/e3/checkpoint eval.benchmark=mt_bench
    peagle evaluate head=... eval.benchmark=humaneval eval.temperature=0.7 eval.batch_size=4

`head` (and `baseline_head`) is a training checkpoint (draft_config.json) or an export directory
(config.json). The target alone, the head and the baseline head decode every prompt in the same run.
Writes output_dir/eval/acceptance.json, per_prompt.csv and acceptance.png. The target and heads
decode in `precision` (auto: bf16 on CUDA and on CPUs with AMX / AVX512-BF16, else fp32), resolved once at
the start, for our decoder and for vLLM alike.
A rerun into the same output_dir after an interruption decodes only what eval/results.jsonl lacks.

    peagle evaluate head=runs/demo/checkpoint eval.engine=both       # our decoder and vLLM, side by side
    peagle evaluate head=runs/demo/export eval.engine=vllm eval.vllm_python=/opt/vllm/bin/python

eval.engine=vllm serves the head's export (a checkpoint is exported to output_dir/eval/vllm_export)
in vLLM's offline `LLM` API, on the same first-turn prompt token ids, greedy, batch 1, and writes
eval/acceptance_vllm.json: τ and per-position acceptance from vLLM's own counters, lossless against
vLLM without the head (peagle_train/serving/vllm_engine.py). `both` also writes eval/engines.md.
With training.tracker=tensorboard|wandb, τ and the per-position acceptance (unconditional and
conditional) also go to that tracker under output_dir (peagle_train/training/tracking.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from peagle_train.draft.head_files import load_head
from peagle_train.config import check_config, register
from peagle_train.runtime import RESUME_EVALUATE, cli_main
from peagle_train.paths import CONF_DIR
from peagle_train.evaluation.benchmarks import prompts_from_config
from peagle_train.evaluation.run import MORE_HEAD, check_head_target, evaluate_acceptance
from peagle_train.evaluation.settings import EvalSettings
from peagle_train.io import atomic_write_text
from peagle_train.jobs.builders import build_target
from peagle_train.precision import ResolvedPrecision, resolve_precision
from peagle_train.target.capture import FeatureTarget
from peagle_train.training.tracking import eval_scalars, tracked_accelerator
from peagle_train.evaluation.benchmarks import first_turn_ids
from peagle_train.evaluation.run import eos_ids as _eos_ids
from peagle_train.export.speculators import validate_export, verifier_name, write_export
from peagle_train.serving.vllm_engine import evaluate_heads_with_vllm, vllm_dtype, vllm_python
from peagle_train.target.load import model_source

logger = logging.getLogger(__name__)


def load_head_and_metrics(path: str):
    """(head, training metrics or None). Metrics: the checkpoint's `train.last20_metrics`, or the mean
    `cond_acc` of the last 20 records of a train_log.jsonl next to the checkpoint/export."""
    p = Path(path)
    draft, meta = load_head(p)
    m = ((meta or {}).get("train") or {}).get("last20_metrics")
    if m and m.get("cond_acc"):
        return draft, {**m, "source": f"{p}/draft_config.json train.last20_metrics"}
    log = p.parent / "train_log.jsonl"
    if log.is_file():
        recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        recs = [r for r in recs if r.get("cond_acc")][-20:]
        if recs:
            cond = [sum(r["cond_acc"][d] for r in recs) / len(recs) for d in range(len(recs[0]["cond_acc"]))]
            return draft, {"cond_acc": cond, "source": f"{log} (mean of the last {len(recs)} steps)"}
    return draft, None


@cli_main(config_path=str(CONF_DIR), config_name="evaluate", version_base="1.3", resume=RESUME_EVALUATE)
def main(cfg: DictConfig) -> dict:
    check_config(cfg, "evaluate")  # every setting in range (config.py), before any work
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # resolved once, on the device that decodes (ours, and vLLM's: CUDA where there is one)
    prec = resolve_precision(cfg.precision, "cuda" if torch.cuda.is_available() else "cpu")
    head = cfg.get("head")
    if not head:
        raise SystemExit("Give the head to evaluate: head=runs/<run>/checkpoint (or an export directory).")
    draft, train_metrics = load_head_and_metrics(head)
    draft.eval()
    settings = EvalSettings.from_config(cfg.eval)
    settings.check_head(draft.config, f"head={head}")  # K ≤ K_train, before the target is loaded
    ids = list(draft.config.aux_layer_ids)
    if cfg.target.aux_layer_ids and list(cfg.target.aux_layer_ids) != ids:
        raise SystemExit(f"head={head} was trained on aux layers {ids}, but target.aux_layer_ids="
                         f"{list(cfg.target.aux_layer_ids)}. Fix: drop target.aux_layer_ids.")
    engine = str(cfg.eval.get("engine", "reference"))
    # vLLM alone needs the in-process target only for its tokenizer and config: kept off the GPU vLLM uses
    device = "cuda" if torch.cuda.is_available() and engine != "vllm" else "cpu"
    n_layers = None
    try:
        target, tok = build_target(cfg.target, device, draft.config.algorithm, aux_layer_ids=ids)
    except ValueError as e:  # aux layer ids outside the target
        raise SystemExit(f"head={head} does not fit target {cfg.target.path}: {e}") from e
    n_layers = target.config.num_hidden_layers
    check_head_target(draft, target, tok, f"head={head}")
    draft.to(device=target.model.device)
    def other_head(path: str, setting: str):
        """(head, the target giving its aux layers) for a head decoded beside `head`."""
        other = load_head(path)[0].eval()
        settings.check_head(other.config, f"{setting}={path}")
        oids = list(other.config.aux_layer_ids)
        if not all(0 <= i < n_layers for i in oids):
            raise SystemExit(f"{setting}={path}: aux layers {oids} outside the target's {n_layers} layers.")
        otarget = target if oids == ids else FeatureTarget(target.model, oids, aux_count=other.config.aux_count)
        check_head_target(other, otarget, tok, f"{setting}={path}")
        return other.to(device=target.model.device), otarget

    baseline, btarget = other_head(cfg.baseline_head, "baseline_head") if cfg.get("baseline_head") else (None, None)
    more = [(str(p), *other_head(str(p), "more_heads")) for p in (cfg.get("more_heads") or [])]
    if engine != "reference" and float(cfg.eval.temperature) > 0:
        raise SystemExit(f"eval.engine={engine} measures greedy decoding only. Fix: eval.temperature=0, or "
                         "eval.engine=reference for sampling.")
    prompts = prompts_from_config(cfg.eval)
    others = ([("baseline_head", str(cfg.baseline_head), baseline)] if baseline is not None else []) + \
        [(f"{MORE_HEAD}{i}", p, d) for i, (p, d, _) in enumerate(more, 1)]
    if engine == "vllm":
        return evaluate_in_vllm(cfg, head, draft, target, tok, prompts, prec, others=others)
    acc = tracked_accelerator(cfg.training.tracker, cfg.output_dir, config=OmegaConf.to_container(cfg, resolve=True),
                              cpu=device == "cpu")
    result = evaluate_acceptance(target, draft, tok, prompts, settings, out_dir=Path(cfg.output_dir) / "eval",
                                 precision=prec, baseline_draft=baseline, baseline_target=btarget,
                                 train_metrics=train_metrics, more_heads=more)
    acc.log(eval_scalars(result), step=0)  # τ, per-position acceptance (unconditional, conditional)
    acc.end_training()
    if engine == "both":
        result["vllm"] = evaluate_in_vllm(cfg, head, draft, target, tok, prompts, prec, reference=result, others=others)
    return result


def evaluate_in_vllm(cfg: DictConfig, head: str, draft, target, tok, prompts: list[dict], precision: ResolvedPrecision,
                     reference: dict | None = None, others: list[tuple[str, str, object]] = ()) -> dict:
    """τ of `head`, and of each further head of `others` [(decoder name: baseline_head | more_head_i,
    path, head)], served by vLLM on the first turns of `prompts` (their chat token ids, as our
    decoder sees them), greedy, batch 1, in `precision` (the run's: vLLM's dtype, and the dtype a
    checkpoint is exported in for it): one engine per head, and one target-alone run that all share
    (serving/vllm_engine.py `evaluate_heads_with_vllm`). Writes eval/acceptance_vllm.json (the head's;
    a further head's in eval/<decoder name>/) and, beside a `reference` result, eval/engines.md (the
    engines side by side, head by head). Returns the head's result, with the baseline's under
    "baseline" and the further heads' in the list "more_heads" (each with its "name"), as the
    reference's acceptance dict has them. Raises VllmError for a precision vLLM is not run in
    (serving/vllm_engine.py `vllm_dtype`), before anything is exported."""
    vllm_dtype(precision)  # refused now, not after the export
    out = Path(cfg.output_dir) / "eval"
    if target.model.device.type == "cuda":  # after the reference decoder: give vLLM the GPU memory
        target.model.to("cpu")
        for d in [draft, *(d for _, _, d in others)]:
            d.to("cpu")
        torch.cuda.empty_cache()
    heads = [("head", head, draft, out)] + [(name, path, d, out / name) for name, path, d in others]
    exports = [(_vllm_export(cfg, path, d, target, precision, head_out), head_out) for _, path, d, head_out in heads]
    ids = [first_turn_ids(q, tok) for q in prompts]
    ids = [x for x in ids if x]
    eos = _eos_ids(target, tok)
    results = evaluate_heads_with_vllm(
        model_source(cfg.target.path), exports, ids, K=int(cfg.eval.num_speculative_tokens),
        max_new_tokens=int(cfg.eval.max_new_tokens), stop_token_ids=sorted(eos), precision=precision,
        python=vllm_python(cfg.eval.get("vllm_python")), threads=cfg.threads,
        target_outputs_dir=cfg.eval.get("vllm_target_outputs"))
    for (name, path, _, _), r in zip(heads, results):
        logger.info("vLLM %s: τ = %.3f ± %.3f at K=%d over %d prompts | per-position acceptance [%s] | lossless %s "
                    "(%d mismatches, %s)%s", r["vllm_version"], r["acceptance_length"], r["acceptance_length_stderr"],
                    r["num_speculative_tokens"], r["num_prompts"],
                    ", ".join(f"{a:.3f}" for a in r["per_position_acceptance"]), r["lossless"],
                    r["lossless_mismatches"], r["precision"], f" | {name}={path}" if others else "")
    result = results[0]
    for (name, path, _, _), r in zip(heads[1:], results[1:]):
        if name == "baseline_head":
            result["baseline"] = r
        else:
            result.setdefault("more_heads", []).append({**r, "name": path})
    if reference is not None:
        table = engines_table(reference, result)
        atomic_write_text(out / "engines.md", table)
        logger.info("\n%s", table)
    return result


def _vllm_export(cfg: DictConfig, path: str, draft, target, precision: ResolvedPrecision, out: Path) -> Path:
    """The export directory vLLM serves for the head at `path`: an export as it is (validated: one
    vLLM would mis-read, in an older numbering or with fc_norm, is refused here); a checkpoint
    exported as `peagle export` would, in the run's dtype, to out/vllm_export."""
    export_dir = Path(path)
    if (export_dir / "config.json").is_file():
        validate_export(export_dir)
        return export_dir
    export_dir = out / "vllm_export"
    try:
        verifier = verifier_name(cfg.target.name_or_path, cfg.target.path)
    except ValueError:  # a local file: vLLM is given the target directory itself
        verifier = str(cfg.target.path)
    write_export(draft, export_dir, verifier_name_or_path=verifier,
                 verifier_architectures=list(target.config.architectures or ["LlamaForCausalLM"]),
                 dtype=precision.dtype, overwrite=True)
    return export_dir


def engines_table(reference: dict, vllm_result: dict) -> str:
    """Markdown: τ ± stderr, per-position acceptance, lossless (each with its definition) and
    tokens/s of our decoder and of vLLM, for the head and then for each further head (the
    reference's `baseline` and `more_heads` beside vLLM's, rows named by decoder)."""
    rows = ["| decoder | prompts | K | precision | τ | per-position acceptance | lossless¹ | tokens/s (target alone) |",
            "|---|---|---|---|---|---|---|---|"]
    common = {k: reference[k] for k in ("num_prompts", "num_speculative_tokens", "precision",
                                        "target_only_tokens_per_second") if k in reference}
    pairs = [("", reference, vllm_result)]
    if "baseline" in vllm_result and "baseline" in reference:
        pairs.append((" · baseline_head", {**common, **reference["baseline"]}, vllm_result["baseline"]))
    for i, (ref, vl) in enumerate(zip(reference.get("more_heads", []), vllm_result.get("more_heads", [])), 1):
        pairs.append((f" · {MORE_HEAD}{i}", {**common, **ref}, vl))
    named = [row for tag, ref, vl in pairs
             for row in ((f"reference decoder{tag}", ref), (f"vLLM {vl['vllm_version']}{tag}", vl))]
    for name, r in named:
        pos = " ".join(f"{a:.3f}" for a in r["per_position_acceptance"])
        lossless = ("not checked" if r["lossless"] is None  # below fp32 in batches (the definition says why)
                    else f"{r['lossless']} ({r['lossless_mismatches']} mismatches)")
        rows.append(f"| {name} | {r['num_prompts']} | {r['num_speculative_tokens']} | {r['precision']} | "
                    f"{r['acceptance_length']:.3f} ± {r.get('acceptance_length_stderr', 0.0):.3f} | {pos} | "
                    f"{lossless} | "
                    f"{r['tokens_per_second']:.1f} ({r['target_only_tokens_per_second']:.1f}) |")
    notes = ["", "¹ lossless, per engine:", f"- reference decoder: {reference.get('lossless_definition')}",
             f"- vLLM: {vllm_result.get('lossless_definition')}"]
    if vllm_result["precision"] != "fp32":
        notes.append("- below fp32 a (K+1)-token verify rounds otherwise than a 1-token step, so vLLM's output with "
                     "the head may differ from its output without it; run with precision=fp32 to check exactness "
                     "(both are then exact).")
    notes.append("τ ± its standard error over prompts; vLLM: first turns, batch 1, τ = 1 + accepted / drafts from "
                 "its own counters.")
    return "\n".join(rows + notes) + "\n"


register()  # the typed, strict schema (peagle_train/config.py) that conf/evaluate.yaml starts from


def run(argv: list[str] | None = None) -> int:
    """`peagle evaluate key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    return run_hydra(main, argv, __doc__, "evaluate")
