"""`dry_run=true`: check a recipe without its target. Builds the recipe's draft head and training
settings on a tiny random target of the same family (Llama, Qwen3, gpt-oss, Gemma-3), with random
token rows, and runs two training steps, a checkpoint round trip, an acceptance evaluation of a few
random prompts (the recipe's K, `precision` and target dtype: bf16 features into the fp32-trained
head) and an export, tracked by `training.tracker` as a real run is (loss per step, then τ). Used by
tests/integration/test_recipes.py to check the GPU recipes on a CPU machine."""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import torch
from omegaconf import OmegaConf

logger = logging.getLogger(__name__)

FAMILIES = {"gpt-oss": "gpt_oss", "gpt_oss": "gpt_oss", "qwen3": "qwen3", "gemma-3": "gemma3_text",
            "gemma3": "gemma3_text", "llama": "llama", "smollm": "llama"}


def family_of(name_or_path: str) -> str:
    """HF model_type of a target from its name (target.name_or_path). Raises ValueError listing the
    known families."""
    low = name_or_path.lower()
    for key, family in FAMILIES.items():
        if key in low:
            return family
    raise ValueError(f"dry_run: no tiny stand-in for target '{name_or_path}'. Known families: "
                     f"{', '.join(sorted(set(FAMILIES.values())))}")


def tiny_target(family: str, vocab_size: int = 256, layers: int = 8, seed: int = 0, dtype=torch.float32):
    """A random HF causal LM of `family` with hidden size 64 (frozen, eval), in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64,
             "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)} if family == "gpt_oss" else {}
    if family == "gemma3_text":
        extra = {"sliding_window": 64, "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"]}
    cfg = AutoConfig.for_model(family, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=4096, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval().requires_grad_(False)


def dry_run(cfg, out_dir: Path) -> dict:
    """Two training steps of `cfg` (the resolved train.py config) on a tiny target of its family (in
    target.dtype), then the checkpoint, evaluation and export of `peagle train`, through the same job
    runner (jobs/training_job.py; evaluation and export run whatever the recipe's eval.enabled and
    export.enabled say); the trackers of `training.tracker` get the training scalars and the
    evaluation's (`tracking.eval_scalars`). Returns {"family", "draft_layers", "num_depths", "steps",
    "loss", "precision" (the draft's autocast), "engine", "training", "eval" (the acceptance dict),
    "export" (its directory)}."""
    from ..data.vocab import DraftVocab
    from ..draft.head_files import load_checkpoint
    from .training_job import JobInputs, run_training_job
    from ..precision import dtype_of, resolve_precision
    from ..target.capture import FeatureTarget
    from ..training.checks import TrainSettings, check_training_config
    from ..training.tracking import tracked_accelerator

    out_dir = Path(out_dir)
    family = family_of(cfg.target.name_or_path or cfg.target.path)
    V = 256
    prec = resolve_precision(cfg.precision, "cpu")  # once, for the training and the evaluation (which logs it)
    target = FeatureTarget(tiny_target(family, V, dtype=dtype_of(cfg.target.dtype, "target.dtype")))
    vocab = DraftVocab.from_ids(torch.arange(0, V - 1, 2)[: cfg.data.draft_vocab_size], V)
    g = torch.Generator().manual_seed(cfg.seed)
    ids = [torch.randint(0, V - 1, (48,), generator=g).tolist() for _ in range(8)]
    rows = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * 8 + [1] * 40 for _ in ids]})
    prompts = [{"id": i, "category": "random", "input_ids": torch.randint(0, V - 1, (12,), generator=g).tolist()}
               for i in range(2)]
    settings = TrainSettings.from_config(cfg, precision=prec, training=OmegaConf.merge(cfg.training, {
        "tokens_per_step": 96, "max_steps": 2, "epochs": 1, "save_every": None, "val_conversations": 0, "resume": False,
        "grad_accum": 1, "max_anchors": 32, "attention": "dense",
        # 2 steps: the recipe's warm-up is sized for its data (peagle plan)
        "warmup_steps": min(int(cfg.training.warmup_steps), 1), "warmup_fraction": None}))
    check_training_config(settings)
    job_cfg = OmegaConf.merge(cfg, {"eval": {"enabled": True}, "export": {"enabled": True}})
    acc = tracked_accelerator(settings.training.tracker, out_dir, config=OmegaConf.to_container(cfg, resolve=True),
                              cpu=True)
    res = run_training_job(job_cfg, acc, out_dir, JobInputs(target, None, rows, vocab, V - 1, prompts), settings,
                              verifier=cfg.target.name_or_path, eval_settings={
                                  "max_new_tokens": 16, "plot": False, "benchmark": "random"})
    back, _ = load_checkpoint(out_dir / "checkpoint")  # the round trip
    train_summary = res["training"]
    summary = {"family": family, "draft_layers": back.config.num_hidden_layers, "num_depths": back.config.num_depths,
               "steps": train_summary["steps"], "loss": _last_loss(out_dir),
               "precision": train_summary["precision"], "engine": train_summary.get("engine")}
    for tracker in acc.trackers:  # end_training's first half: the process group stays for the next run in this process
        tracker.finish()
    logger.info("dry run of a %s recipe: %s", family, summary)
    return {**summary, "training": {**train_summary, "final_loss": summary["loss"]}, "eval": res["eval"],
            "export": res["export"]}


def _last_loss(out: Path) -> float:
    import json

    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()][-1]["loss"]
