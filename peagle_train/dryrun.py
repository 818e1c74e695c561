"""`dry_run=true`: check a recipe without its target. Builds the recipe's draft head and training
settings on a tiny random target of the same family (Llama, Qwen3, gpt-oss, Gemma-3), with random
token rows, and runs two training steps, a checkpoint round trip, an acceptance evaluation of a few
random prompts (the recipe's K, `precision` and target dtype: bf16 features into the fp32-trained
head) and an export, tracked by `training.tracker` as a real run is (loss per step, then τ). Used by
tests/test_recipes.py to check the GPU recipes on a CPU machine."""

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
    target.dtype), then evaluation and export as train.py runs them; the trackers of
    `training.tracker` get the training scalars and the evaluation's (`tracking.eval_scalars`).
    Returns {"family", "draft_layers", "num_depths", "steps", "loss", "precision" (the draft's autocast), "engine",
    "training", "eval" (the acceptance dict), "export" (its directory)}."""
    from .data.vocab import DraftVocab
    from .evaluation.run import evaluate_acceptance
    from .export.speculators import write_export
    from .config import train_config
    from .job import build_draft, dtype_of
    from .target.capture import FeatureTarget
    from .draft.head_checkpoint import load_checkpoint, save_checkpoint
    from .training.checks import check_training_config
    from .training.tracking import eval_scalars, tracked_accelerator
    from .training.trainer import train

    family = family_of(cfg.target.name_or_path or cfg.target.path)
    V = 256
    target = FeatureTarget(tiny_target(family, V, dtype=dtype_of(cfg.target.dtype)))
    vocab = DraftVocab.from_ids(torch.arange(0, V - 1, 2)[: cfg.data.draft_vocab_size], V)
    draft = build_draft(target, cfg.draft, vocab, V - 1, cfg.algorithm)
    g = torch.Generator().manual_seed(cfg.seed)
    ids = [torch.randint(0, V - 1, (48,), generator=g).tolist() for _ in range(8)]
    rows = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * 8 + [1] * 40 for _ in ids]})
    train_cfg = OmegaConf.merge(train_config(cfg), {"tokens_per_step": 96, "max_steps": 2, "epochs": 1,
                                                    "save_every": None, "val_conversations": 0, "resume": False,
                                                    "grad_accum": 1, "max_anchors": 32,
                                                    "attention": "dense"})
    check_training_config(train_cfg)
    acc = tracked_accelerator(train_cfg.tracker, out_dir, config=OmegaConf.to_container(cfg, resolve=True), cpu=True)
    res = train(acc, draft, target, rows, vocab.draft_ids, train_cfg, Path(out_dir))
    back, _ = load_checkpoint(save_checkpoint(res["draft"], Path(out_dir) / "checkpoint"))
    summary = {"family": family, "draft_layers": back.config.num_hidden_layers, "num_depths": back.config.num_depths,
               "steps": res["steps"], "loss": _last_loss(Path(out_dir)),
               "precision": res["precision"], "engine": res.get("engine")}
    train_summary = {k: v for k, v in res.items() if k != "draft"}
    draft = res["draft"].eval()
    prompts = [{"id": i, "category": "random", "input_ids": torch.randint(0, V - 1, (12,), generator=g).tolist()}
               for i in range(2)]
    acceptance = evaluate_acceptance(target, draft, None, prompts, num_speculative_tokens=cfg.eval.num_speculative_tokens,
                                     max_new_tokens=16, out_dir=Path(out_dir) / "eval", plot=False,
                                     benchmark="random", precision=cfg.get("precision", "auto"))
    export = write_export(draft, Path(out_dir) / "export", verifier_name_or_path=cfg.target.name_or_path,
                          verifier_architectures=list(target.config.architectures or []),
                          dtype=dtype_of(cfg.export.dtype), data_token_ids={t for r in ids for t in r}, overwrite=True)
    acc.log(eval_scalars(acceptance), step=res["steps"])
    for tracker in acc.trackers:  # end_training's first half: the process group stays for the next run in this process
        tracker.finish()
    logger.info("dry run of a %s recipe: %s", family, summary)
    return {**summary, "training": {**train_summary, "final_loss": summary["loss"]}, "eval": acceptance,
            "export": str(export)}


def _last_loss(out: Path) -> float:
    import json

    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()][-1]["loss"]
