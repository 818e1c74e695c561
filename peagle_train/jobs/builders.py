"""Stage helpers shared by train.py and scripts/: config → objects, and run metadata."""

from __future__ import annotations

import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..draft import DraftConfig, DraftHead, make_draft_head
from ..io import atomic_write_json
from ..paths import PACKAGE_DIR
from ..precision import dtype_of
from ..target.capture import FeatureTarget
from ..target.load import load_target


def build_target(target_cfg, device, algorithm: str = "peagle", aux_layer_ids: list[int] | None = None):
    """(FeatureTarget, tokenizer) from the `target` config group; weights in `target.dtype`
    (null = float32; the forward's compute precision is `precision`'s, applied by the trainer).
    The aux layers are `aux_layer_ids` (a trained head's), else `target.aux_layer_ids`, else the
    default; `algorithm` sets how many are admitted (target/aux_layers.py `AuxLayers`). Raises
    ConfigError (a ValueError) for ids the target cannot give."""
    model, tok = load_target(target_cfg.path, dtype_of(target_cfg.get("dtype"), "target.dtype"), device)
    ids = aux_layer_ids if aux_layer_ids is not None else target_cfg.aux_layer_ids
    return FeatureTarget(model, ids, aux_count=DraftConfig.class_of(algorithm).aux_count), tok


def build_draft(target: FeatureTarget, dcfg, vocab, mask_token_id: int, algorithm: str = "peagle") -> DraftHead:
    """A P-EAGLE (EAGLE-3, DFlash) head sized from the target, its choices from the recipe's `draft`
    group `dcfg` (`DraftConfig.from_target`), initialised from the target's embeddings and lm_head
    rows, or from the head `dcfg.init_from` names. Raises ValueError naming the setting when sizes
    disagree with the target."""
    cfg = DraftConfig.from_target(target.config, draft=dcfg, algorithm=algorithm,
                                  draft_vocab_size=len(vocab.draft_ids), mask_token_id=mask_token_id,
                                  aux_layer_ids=target.aux_layer_ids)
    cfg.check_target(target.config)
    draft = make_draft_head(cfg)
    draft.init_from_target(target.model, vocab.draft_ids, vocab.d2t, vocab.t2d)
    if cfg.linear_init_std is not None:
        draft.init_linears(cfg.linear_init_std)
    if hasattr(draft, "mask_hidden"):
        draft.init_mask_hidden(cfg.mask_hidden_std)
    init_from = dcfg.get("init_from") if hasattr(dcfg, "get") else getattr(dcfg, "init_from", None)
    if init_from:  # continue from an existing head (checkpoint or export)
        from ..draft.head_files import init_from_head

        init_from_head(draft, init_from)
    return draft.to(target.model.device)


def run_metadata() -> dict:
    """Git commit, package versions and platform of this run (written next to its outputs).
    `git_commit` is that of the checkout the package runs from, null for an installed package."""
    pkgs = {}
    for p in ("peagle-train", "torch", "transformers", "accelerate", "datasets", "hydra-core", "safetensors", "gguf",
              "deepspeed", "wandb", "tensorboard"):
        try:
            pkgs[p] = version(p)
        except PackageNotFoundError:
            pkgs[p] = None
    return {"git_commit": git_commit(), "packages": pkgs, "python": platform.python_version(), "machine": platform.machine()}


def git_commit() -> str | None:
    """HEAD of the git checkout this package's files are tracked in; None outside one (an installed
    package, also one whose venv lies inside some other repository) or without git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=PACKAGE_DIR, capture_output=True, text=True, timeout=10)

    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return None
        return git("rev-parse", "HEAD").stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(path: Path, obj) -> None:
    """`obj` as indented JSON at `path`, written atomically (peagle_train/io.py)."""
    atomic_write_json(path, obj)
