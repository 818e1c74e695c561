"""`peagle train`: prepare data → train a P-EAGLE head (online target features) → evaluate τ → export.

    peagle train recipe=smollm2-135m-demo output_dir=runs/demo
    accelerate launch train.py recipe=smollm2-135m-demo output_dir=runs/demo      # train.py: the same job
    accelerate launch -m peagle_train.cli train recipe=smollm2-135m-demo output_dir=runs/demo
    peagle train -m recipe=smollm2-135m-demo draft.num_depths=5,8,12 output_dir=runs/sweep-k   # a sweep

Writes under output_dir: data/ (summary, draft vocabulary, rows), checkpoint/, train_log.jsonl,
eval/acceptance.json (+ per_prompt.csv), export/ (config.json, model.safetensors), summary.json,
train.log (every message of the run) and the tracker's files (training.tracker: peagle-train/ or wandb/).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from peagle_train.config import check_config, register
from peagle_train.errors import ConfigError
from peagle_train.runtime import RESUME_TRAIN, cli_main, exit_at_once, usable_cores
from peagle_train.paths import CONF_DIR
from peagle_train.training.run_lock import check_not_locked, claim_at_run_start, claim_output_dir, release_lock

# torch, transformers and the trainer load in `train_job`, after the command line is checked: `--help` and a
# refused setting answer without them

logger = logging.getLogger("peagle_train.train")  # a package logger: info from the main process only (logs.py)


def cpu_threads(threads: int | None) -> int:
    """torch CPU threads: `threads`, or null = this process's share of the cores it may run on
    (runtime.usable_cores / processes on this node). `accelerate launch` sets OMP_NUM_THREADS=1 for
    CPU runs, which halves a 2-core run."""
    if threads:
        return threads
    return max(1, len(usable_cores()) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def check_data_preparation(cfg, tokenizer, target_vocab_size: int, world: int, gather=None) -> None:
    """Refuse, before the main process prepares the data inside `main_process_first`, a run of
    `world` > 1 processes whose data is not prepared (no data.prepared_dir, and a cold cache on some
    process's node: data/prepare.py `prepared_in_cache`) when the preparation's estimate
    (plan.py `preparation_estimate`) outlasts the process-group timeout the others wait in.
    `gather(flag)` returns every process's flag (all_gather_object; the default: this process's
    alone), so every process decides alike. Raises ConfigError (plan.py `preparation_problem`:
    the estimate, the timeout and the fixes) on every process; DataFileError when data.path is the
    regenerate stage's output and does not exist yet."""
    from peagle_train.data.prepare import check_regenerate_stage, prepared_in_cache
    from peagle_train.plan import preparation_estimate, preparation_problem

    if world <= 1 or cfg.data.prepared_dir:
        return
    est = preparation_estimate(cfg)
    if not (problem := preparation_problem(est, world)):
        return
    check_regenerate_stage(cfg.data)  # a missing stage-1 output is named as such, not as a slow preparation
    cold = not prepared_in_cache(cfg.data, tokenizer, target_vocab_size, seed=cfg.seed)
    flags = gather(cold) if gather is not None else [cold]
    if any(flags):
        raise ConfigError(f"{problem} ({sum(flags)} of {len(flags)} processes find no prepared copy in data.cache_dir)")


def run_dir(cfg) -> Path:
    """output_dir, or in a -m sweep the job's own folder (output_dir/<job number>)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(cfg.output_dir)


@cli_main(config_path=str(CONF_DIR), config_name="train", version_base="1.3", resume=RESUME_TRAIN)
def main(cfg: DictConfig) -> dict:
    try:
        return train_job(cfg)
    finally:  # also on an error or Ctrl-C: the next run on this output_dir starts without a stale lock
        release_lock(run_dir(cfg))


def train_job(cfg: DictConfig) -> dict:
    """The job of `peagle train` (see the module docstring); one run per output_dir: the main process holds
    output_dir/.peagle_run.lock from before anything is written (training/run_lock.py; `main` releases it)."""
    import torch

    from peagle_train.export.speculators import verifier_name
    from peagle_train.jobs.builders import write_json
    from peagle_train.training.checks import TrainSettings, check_training_config
    from peagle_train.training.engines import check_distributed_config

    check_config(cfg, "train")  # every setting in range (config.py), before any work
    t_start = time.perf_counter()
    torch.set_num_threads(cpu_threads(cfg.threads))
    settings = TrainSettings.from_config(cfg)  # the training group and the values of other groups the trainer reads
    torch.manual_seed(settings.seed)  # the head's initialisation: training.seed, else seed
    check_training_config(settings)  # fail at start-up, naming the setting
    check_distributed_config(cfg.distributed.engine, cfg.distributed.zero_stage)
    verifier = verifier_name(cfg.target.name_or_path, cfg.target.path) if cfg.export.enabled and not cfg.dry_run \
        else cfg.target.name_or_path  # the verifier the export names: refused now, not after training
    if cfg.export.enabled and cfg.draft.fc_norm:  # refused now, not by the export after training
        raise ConfigError("draft.fc_norm=true heads do not load in vLLM (its P-EAGLE loader does not build fc_norm), "
                          "so the export would fail after training. Fix: draft.fc_norm=false (draft.norm_before_fc=true "
                          "is served), or export.enabled=false to train one for study only.")
    if cfg.dry_run:
        from peagle_train.jobs.dry_run import dry_run

        check_not_locked(run_dir(cfg))  # takes no lock, but never writes into a live run's output_dir
        res = dry_run(cfg, run_dir(cfg))
        write_json(run_dir(cfg) / "summary.json", {"dry_run": res, "training": res["training"]})
        return res
    return _run_job(cfg, settings, verifier, t_start)


def _run_job(cfg: DictConfig, settings, verifier: str, t_start: float) -> dict:
    """`train_job` once its checks passed: the run itself, from the accelerator to summary.json.
    settings: its TrainSettings; verifier: the name the export gives the target; t_start: its
    perf_counter start (the summary's wall_seconds)."""
    import torch

    from peagle_train.data.prepare import data_from_config, format_summary, save_prepared
    from peagle_train.evaluation.benchmarks import prompts_from_config
    from peagle_train.features import open_features
    from peagle_train.jobs.builders import build_target, run_metadata, write_json
    from peagle_train.jobs.training_job import JobInputs, run_training_job
    from peagle_train.precision import log_precision, precision_record, resolve_precision, target_weight_dtype
    from peagle_train.training.engines import gather_object, process_group_kwargs
    from peagle_train.training.tracking import start_trackers, untracked_accelerator

    out = run_dir(cfg)
    acc = untracked_accelerator(cfg.training.tracker, out, cpu=not torch.cuda.is_available(),
                                kwargs_handlers=process_group_kwargs(cfg.distributed.timeout_minutes))
    # one run per output_dir: rank 0 takes the lock (or keeps the one it took before Hydra wrote anything) and
    # tells the other processes; a second run stops here on every process, before the job writes anything
    claim_output_dir(out, "peagle train")
    start_trackers(acc, cfg.training.tracker, out, config=OmegaConf.to_container(cfg, resolve=True))  # training.tracker
    log = logger.info
    # precision: bf16 compute for the target's forward and the draft's autocast where the hardware has it; resolved
    # here, once: the trainer and the evaluation take this object (jobs/training_job.py), never the setting
    prec = resolve_precision(cfg.precision, acc.device)
    settings.precision = prec  # the target forward, the draft's autocast and the evaluation's decoding
    prec_rec = precision_record(prec, acc.device, target_weight_dtype(cfg.target.dtype), prec)
    log_precision(prec)
    logger.info("bf16 unit: %s; target forward %s (weights %s), draft autocast %s",
                prec_rec["bf16_unit"], prec.name, prec_rec["target_weights"], prec.name)
    if acc.is_main_process:
        write_json(out / "run.json", {**run_metadata(), "precision": prec_rec,
                                      "config": OmegaConf.to_container(cfg, resolve=True)})
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)  # the resolved config, re-runnable

    # 1. target (frozen) and data: template, assistant-only mask, draft vocabulary, mask token
    target, tok = build_target(cfg.target, acc.device, str(cfg.algorithm))
    # a cold preparation longer than the process-group timeout is refused here, on every process
    check_data_preparation(cfg, tok, target.config.vocab_size, acc.num_processes, gather=gather_object)
    with acc.main_process_first():
        # data.prepared_dir (`peagle prepare`; refused if made for another target), else prepared here
        data = data_from_config(cfg.data, tok, target.config.vocab_size, seed=cfg.seed)
    if cfg.data.draft_vocab_from_head:  # the head's own vocabulary: nothing to remap (draft/head_files.py)
        from peagle_train.data.prepare import with_draft_ids
        from peagle_train.draft.head_files import head_vocabulary

        data = with_draft_ids(data, head_vocabulary(cfg.draft.init_from), target.config.vocab_size,
                              f"draft.init_from={cfg.draft.init_from}")
    if acc.is_main_process:
        save_prepared(data, out / "data")
    log("data summary:\n" + format_summary(data.summary))

    # 2. the head trained (P-EAGLE: COD sampling; EAGLE-3: TTT steps; DFlash: blocks) on online or offline
    #    features, 3. acceptance with the reference decoder, 4. export: the job runner (jobs/training_job.py)
    features = open_features(cfg.features, target, tok, data.rows,  # online target or offline shards
                             template_kwargs=OmegaConf.to_container(cfg.data.template_kwargs))
    inputs = JobInputs(target, tok, data.rows, data.vocab, data.mask_token_id,
                       prompts_from_config(cfg.eval) if cfg.eval.enabled else [], features, data.summary)
    summary = run_training_job(cfg, acc, out, inputs, settings, verifier=verifier)
    if acc.is_main_process:
        summary["wall_seconds"] = time.perf_counter() - t_start
        write_json(out / "summary.json", summary)
        log(f"done in {summary['wall_seconds'] / 60:.1f} min; outputs in {out}")
    # no barrier here: the process group was released after training (jobs/training_job.py, `end_distributed`), and
    # the other processes have returned while the main process evaluated and exported
    acc.end_training()  # trackers closed (and a process group still alive destroyed) before the interpreter exits
    return summary


register()  # the typed schema conf/train.yaml starts from

def run(argv: list[str] | None = None) -> int:
    """`peagle train key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    claim_at_run_start("peagle train")  # output_dir's run lock taken before Hydra writes there (training/run_lock.py)
    status = run_hydra(main, argv, __doc__, "train")
    # a process of a multi-process run (its job loaded the engines): no interpreter teardown (runtime.exit_at_once)
    engines = sys.modules.get("peagle_train.training.engines")
    if engines is not None and engines.LEFT_A_GROUP:
        exit_at_once(status or 0)
    return status
