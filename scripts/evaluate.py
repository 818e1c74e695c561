"""Measure acceptance length τ of a trained head with the reference decoder.

    python scripts/evaluate.py head=runs/demo/checkpoint output_dir=runs/demo-eval [eval.num_prompts=80]

`head` is a training checkpoint (draft_config.json) or an export directory (config.json).
Writes output_dir/eval/acceptance.json and per_prompt.csv.
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, open_dict

from peagle_train.decoding.evaluate import evaluate_acceptance, load_spec_bench
from peagle_train.export.speculators import load_export
from peagle_train.job import build_target
from peagle_train.training.loop import load_checkpoint


def load_head(path: str):
    """A PEagleDraft from a training checkpoint or an export directory; FileNotFoundError otherwise."""
    p = Path(path)
    if (p / "draft_config.json").is_file():
        return load_checkpoint(p)[0]
    if (p / "config.json").is_file():
        return load_export(p)
    raise FileNotFoundError(f"head={path}: neither a checkpoint (draft_config.json) nor an export (config.json). "
                            "Fix: point head= at runs/<run>/checkpoint or runs/<run>/export.")


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    head = cfg.get("head")
    if not head:
        raise SystemExit("Give the head to evaluate: head=runs/<run>/checkpoint (or an export directory).")
    draft = load_head(head).eval()
    with open_dict(cfg.target):
        cfg.target.aux_layer_ids = list(draft.config.aux_layer_ids)
    target, tok = build_target(cfg.target, "cpu" if not torch.cuda.is_available() else "cuda")
    draft.to(target.model.device)
    prompts = load_spec_bench(cfg.eval.prompts, tuple(cfg.eval.categories) if cfg.eval.categories else None,
                              cfg.eval.num_prompts)
    return evaluate_acceptance(target, draft, tok, prompts, num_speculative_tokens=cfg.eval.num_speculative_tokens,
                               max_new_tokens=cfg.eval.max_new_tokens, out_dir=Path(cfg.output_dir) / "eval")


if __name__ == "__main__":
    main()
