"""Measure acceptance length τ, speed and latency of a trained head with the reference decoder.

    peagle evaluate head=runs/demo/checkpoint output_dir=runs/demo-eval [eval.num_prompts=80]
    peagle evaluate head=runs/p/checkpoint baseline_head=runs/e3/checkpoint eval.benchmark=mt_bench
    peagle evaluate head=... eval.benchmark=humaneval eval.temperature=0.7 eval.batch_size=4

`head` (and `baseline_head`) is a training checkpoint (draft_config.json) or an export directory
(config.json). The target alone, the head and the baseline head decode every prompt in the same run.
Writes output_dir/eval/acceptance.json, per_prompt.csv and acceptance.png. The target and heads
decode in `precision` (auto: bf16 on CUDA and on CPUs with AMX / AVX512-BF16, else fp32).
A rerun into the same output_dir after an interruption decodes only what eval/results.jsonl lacks.
With training.tracker=tensorboard|wandb, τ and the per-position acceptance (unconditional and
conditional) also go to that tracker under output_dir (peagle_train/training/tracking.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from peagle_train.draft.io import load_head
from peagle_train.config import register
from peagle_train.errors import cli_main
from peagle_train.paths import CONF_DIR
from peagle_train.evaluation.benchmarks import prompts_from_config
from peagle_train.evaluation.run import check_head_target, evaluate_from_config
from peagle_train.job import build_target
from peagle_train.target.features import FeatureTarget
from peagle_train.training.tracking import eval_scalars, tracked_accelerator


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


@cli_main(config_path=str(CONF_DIR), config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    head = cfg.get("head")
    if not head:
        raise SystemExit("Give the head to evaluate: head=runs/<run>/checkpoint (or an export directory).")
    draft, train_metrics = load_head_and_metrics(head)
    draft.eval()
    ids = list(draft.config.aux_layer_ids)
    with open_dict(cfg.target):
        if cfg.target.aux_layer_ids and list(cfg.target.aux_layer_ids) != ids:
            raise SystemExit(f"head={head} was trained on aux layers {ids}, but target.aux_layer_ids="
                             f"{list(cfg.target.aux_layer_ids)}. Fix: drop target.aux_layer_ids.")
        cfg.target.aux_layer_ids = ids
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_layers = None
    try:
        target, tok = build_target(cfg.target, device)
    except ValueError as e:  # aux layer ids outside the target
        raise SystemExit(f"head={head} does not fit target {cfg.target.path}: {e}") from e
    n_layers = target.config.num_hidden_layers
    check_head_target(draft, target, tok, f"head={head}")
    draft.to(device=target.model.device)
    baseline, btarget = None, None
    if cfg.get("baseline_head"):
        baseline = load_head(cfg.baseline_head)[0].eval()
        bids = list(baseline.config.aux_layer_ids)
        if not all(0 <= i < n_layers for i in bids):
            raise SystemExit(f"baseline_head={cfg.baseline_head}: aux layers {bids} outside the target's {n_layers} layers.")
        btarget = target if bids == ids else FeatureTarget(target.model, bids)
        check_head_target(baseline, btarget, tok, f"baseline_head={cfg.baseline_head}")
        baseline.to(device=target.model.device)
    acc = tracked_accelerator(cfg.training.tracker, cfg.output_dir, config=OmegaConf.to_container(cfg, resolve=True),
                              cpu=device == "cpu")
    result = evaluate_from_config(cfg.eval, target, draft, tok, prompts_from_config(cfg.eval),
                                  out_dir=Path(cfg.output_dir) / "eval", precision=cfg.precision,
                                  baseline_draft=baseline, baseline_target=btarget, train_metrics=train_metrics)
    acc.log(eval_scalars(result), step=0)  # τ, per-position acceptance (unconditional, conditional)
    acc.end_training()
    return result


register()  # the typed, strict schema (peagle_train/config.py) that conf/evaluate.yaml starts from


def run(argv: list[str] | None = None) -> int:
    """`peagle evaluate key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    return run_hydra(main, argv, __doc__, "evaluate")
