"""The training job: a head trained, saved, evaluated and exported, in the one sequence that
`peagle train` (cli/train.py, on the recipe's target and data) and the dry run (jobs/dry_run.py, on a tiny
stand-in target and random rows) both run."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..data.vocab import DraftVocab
from ..draft.head_files import save_checkpoint
from ..evaluation.run import evaluate_acceptance
from ..evaluation.settings import EvalSettings
from ..export.speculators import write_export
from .builders import build_draft
from ..precision import ResolvedPrecision, dtype_of
from ..target.capture import FeatureTarget
from ..training.checks import TrainSettings
from ..training.engines import end_distributed
from ..training.tracking import eval_scalars
from ..training.trainer import train

logger = logging.getLogger("peagle_train.train")


@dataclass
class JobInputs:
    """What a training job runs on.

    target: the frozen target (its aux hidden states feed the head); tokenizer: its tokenizer (None
    when the prompts are token ids); rows: a datasets.Dataset of packed-row documents
    {input_ids, loss_mask}; vocab: the draft vocabulary (d2t, t2d); mask_token_id: the mask token;
    prompts: the evaluation prompts (evaluation/run.py's forms); features: None (online: the step
    runs the target) or a feature source such as features.shards.OfflineFeatures; data_summary:
    the data preparation's summary (into summary.json and the export's model card)."""

    target: FeatureTarget
    tokenizer: object | None
    rows: object
    vocab: DraftVocab
    mask_token_id: int
    prompts: list[dict]
    features: object | None = None
    data_summary: dict = field(default_factory=dict)


def run_training_job(cfg, accelerator, out: Path, inputs: JobInputs, train_settings: TrainSettings, *,
                     verifier: str, eval_settings: dict | None = None) -> dict:
    """Build the head of `cfg.draft` / `cfg.algorithm` on `inputs.target` (jobs/builders.py `build_draft`), train
    it (training/trainer.py, with `train_settings`, whose `precision` is the run's ResolvedPrecision: resolved
    once, at the command's start, and handed to the trainer and the evaluation alike), release the process group (`end_distributed`:
    the other processes return at once), then on the main process alone save it to `out`/checkpoint
    (with the target, `verifier` and the training summary), evaluate it when `cfg.eval.enabled`
    (`evaluate_acceptance` into `out`/eval, `eval_settings` overriding the eval group's keys; its
    τ goes to the trackers) and export it when `cfg.export.enabled` (`out`/export, validated, with
    the model card). Returns {"data", "training", "eval"?, "export"?}.
    Raises TypeError when `train_settings.precision` is not resolved (fix: peagle_train/precision.py
    `resolve_precision` at the command's start), and what the stages raise (ConfigError, ExportError, WriteError, ...)."""
    precision = train_settings.precision
    if not isinstance(precision, ResolvedPrecision):
        raise TypeError(f"run_training_job: train_settings.precision={precision!r} is a setting, not the run's "
                        "ResolvedPrecision. Fix: resolve it once at the command's start (peagle_train/precision.py "
                        "resolve_precision) and pass that.")
    out = Path(out)
    draft = build_draft(inputs.target, cfg.draft, inputs.vocab, inputs.mask_token_id, cfg.algorithm)
    result = train(accelerator, draft, inputs.target, inputs.rows, inputs.vocab.draft_ids, train_settings, out,
                   features=inputs.features)
    # the last collective: from here the main process works alone (evaluation and export can take longer
    # than any process-group timeout), the other processes return
    end_distributed(accelerator)
    draft = result.pop("draft")
    summary = {"data": inputs.data_summary, "training": result}
    logger.info(f"trained {result['steps']} steps, {result['tokens']} tokens in {result['seconds']:.0f}s "
                f"({result['tokens_per_second']:.0f} tok/s); last-20-step EAL {result['last20_metrics']['eal']:.3f}")
    if not accelerator.is_main_process:
        return summary
    architectures = list(inputs.target.config.architectures or [])
    save_checkpoint(draft, out / "checkpoint", {"target": cfg.target.path, "verifier_name_or_path": verifier,
                                                "verifier_architectures": architectures, "train": result})
    draft.eval()
    if cfg.eval.enabled:
        settings = EvalSettings.from_config(cfg.eval, **{"benchmark": "spec_bench", **(eval_settings or {})})
        summary["eval"] = evaluate_acceptance(
            inputs.target, draft, inputs.tokenizer, inputs.prompts, settings, out_dir=out / "eval",
            precision=precision, train_metrics={**result["last20_metrics"], "source": "last 20 training steps"})
        accelerator.log(eval_scalars(summary["eval"]), step=result["steps"])  # τ, per-position acceptance
    if cfg.export.enabled:
        used = {t for ids in inputs.rows["input_ids"] for t in ids}
        summary["export"] = str(write_export(
            draft, out / "export", verifier_name_or_path=verifier, verifier_architectures=architectures,
            dtype=dtype_of(cfg.export.dtype, "export.dtype"), data_token_ids=used, overwrite=True,
            card={"data": inputs.data_summary,
                  "acceptance": {summary["eval"]["benchmark"]: summary["eval"]} if "eval" in summary else {}}))
        logger.info(f"export written and validated: {out / 'export'}")
    return summary
