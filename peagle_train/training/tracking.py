"""Experiment tracking through Accelerate's own tracker API: TensorBoard, Weights & Biases (offline
when no credentials are configured) or none (`training.tracker`). Only the main process logs.

    acc = tracked_accelerator(cfg.training.tracker, output_dir, config=run_config, cpu=...)
    acc.log(step_scalars(record), step=step)       # the trainer: every step and every validation
    acc.log(eval_scalars(acceptance), step=steps)  # after evaluation: τ and per-position acceptance
    acc.end_training()                             # trackers finished (and the process group ended)

`tracked_accelerator` is `Accelerator(log_with=tracker, project_dir=output_dir)` followed by
`init_trackers(PROJECT, config)` on the main process. Files, all under output_dir:
tensorboard → peagle-train/ (event files; the run config in peagle-train/<time>/hparams.yml;
`tensorboard --logdir output_dir`);
wandb → wandb/ (a run per job; without credentials an offline run, wandb/offline-run-*, uploaded
later with `wandb sync`).
"""

from __future__ import annotations

import enum
import logging
import netrc
import os
from pathlib import Path

from ..errors import ConfigError
from ..extras import install_hint

logger = logging.getLogger(__name__)

TRACKERS = ("none", "tensorboard", "wandb")
PROJECT = "peagle-train"  # the wandb project; the TensorBoard folder under output_dir


def wandb_has_credentials() -> bool:
    """WANDB_API_KEY set, or an api.wandb.ai entry in ~/.netrc (where `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def tracker_name(tracker) -> str:
    """The tracker's name from a config value: a string, an Enum of the schema (its value) or None (none)."""
    return str(getattr(tracker, "value", tracker) or "none")


def tracked_accelerator(tracker: str, out_dir: str | Path, config: dict | None = None, **accelerator_kwargs):
    """An `accelerate.Accelerator(log_with=tracker, project_dir=out_dir, **accelerator_kwargs)` whose
    trackers are started on the main process with `init_trackers(PROJECT, config=tracker_config(config))`.

    tracker: none | tensorboard | wandb. wandb writes under out_dir/wandb; without credentials (see
    `wandb_has_credentials`) and without WANDB_MODE set, it runs offline (logged; nothing is sent).
    Non-main processes start no tracker (`acc.log` is a no-op there). The caller ends the run with
    `acc.end_training()`.

    Raises ConfigError for an unknown tracker name, or a tracker whose package is not installed.
    """
    acc = untracked_accelerator(tracker, out_dir, **accelerator_kwargs)
    start_trackers(acc, tracker, out_dir, config)
    return acc


def untracked_accelerator(tracker: str, out_dir: str | Path, **accelerator_kwargs):
    """`tracked_accelerator`'s first half: the Accelerator (its process group started), its trackers
    not yet started (nothing written under out_dir). Raises ConfigError as `tracked_accelerator`."""
    from accelerate import Accelerator

    tracker = tracker_name(tracker)
    if tracker not in TRACKERS:
        raise ConfigError(f"training.tracker={tracker!r} must be one of {', '.join(TRACKERS)}")
    acc = Accelerator(log_with=None if tracker == "none" else tracker, project_dir=str(out_dir), **accelerator_kwargs)
    if tracker != "none" and not acc.log_with:  # Accelerate drops a tracker whose package is missing
        raise ConfigError(f"training.tracker={tracker}: the {tracker} package is not installed (a plain install "
                          f"leaves it out). Fix: {install_hint(tracker)}, or training.tracker=none.")
    return acc


def start_trackers(acc, tracker: str, out_dir: str | Path, config: dict | None = None):
    """`tracked_accelerator`'s second half: the trackers of `acc` started on the main process (files
    under out_dir); returns acc."""
    tracker, out_dir = tracker_name(tracker), Path(out_dir)
    if tracker == "none" or not acc.is_main_process:
        return acc
    out_dir.mkdir(parents=True, exist_ok=True)
    init_kwargs = {}
    if tracker == "wandb":
        init_kwargs["wandb"] = {"dir": str(out_dir)}
        if not wandb_has_credentials() and "WANDB_MODE" not in os.environ:
            init_kwargs["wandb"]["mode"] = "offline"
            logger.info("wandb: no credentials, logging offline under %s (upload later: wandb sync)", out_dir / "wandb")
    acc.init_trackers(PROJECT, config=tracker_config(config) if config else None, init_kwargs=init_kwargs)
    return acc


def tracker_config(config: dict) -> dict:
    """A nested run config flattened for the trackers' hyperparameter tables: {"training.lr": 3e-4, ...}.
    Scalars (int, float, str, bool; a choice Enum as its value) are kept, lists become their string, None values are left out."""
    out = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, key + ".")
            elif isinstance(v, enum.Enum):  # a schema choice: its value
                out[key] = v.value
            elif isinstance(v, (bool, int, float, str)):
                out[key] = v
            elif v is not None:
                out[key] = str(v)

    walk(config, "")
    return out


def step_scalars(rec: dict) -> dict:
    """Flat scalars of one train_log record: loss, lr, eal, tokens_per_second, acc/d, cond_acc/d,
    val_loss, val_eal."""
    out = {}
    for k, v in rec.items():
        if k == "step":
            continue
        if isinstance(v, list):
            out.update({f"{k}/{d}": x for d, x in enumerate(v)})
        elif isinstance(v, (int, float)):
            out[k] = v
    return out


def eval_scalars(acceptance: dict, prefix: str = "eval") -> dict:
    """Flat scalars of an acceptance dict (evaluation.report.summarize, eval/acceptance.json):
    {prefix}/tau (acceptance length τ, tokens per verify step), {prefix}/acc/d (unconditional
    acceptance at draft position d+1, P(≥ d+1 drafts accepted)), {prefix}/cond_acc/d (conditional:
    P(position d+1 accepted | the positions before it were)), {prefix}/tokens_per_second,
    {prefix}/speedup (over the target alone); the same for a baseline head under {prefix}/baseline/."""
    out = {f"{prefix}/tau": acceptance["acceptance_length"]}
    out.update({f"{prefix}/acc/{d}": x for d, x in enumerate(acceptance["per_position_acceptance"])})
    out.update({f"{prefix}/cond_acc/{d}": x for d, x in enumerate(acceptance["per_position_acceptance_conditional"])})
    for k in ("tokens_per_second", "speedup"):
        if isinstance(acceptance.get(k), (int, float)):
            out[f"{prefix}/{k}"] = acceptance[k]
    if acceptance.get("baseline"):
        out.update(eval_scalars(acceptance["baseline"], f"{prefix}/baseline"))
    return out
