"""Prepare training data once: conversations → token rows, draft vocabulary, mask token, manifest.

    peagle prepare recipe=smollm2-135m-demo output_dir=/tmp/prepared [data.num_conversations=null]
    peagle train recipe=smollm2-135m-demo data.prepared_dir=/tmp/prepared output_dir=runs/demo

Uses the `target` (only its tokenizer and vocabulary size are loaded: no weights for an
HF directory; a GGUF target is dequantised once and cached) and `data` groups. Writes under
output_dir: rows/ (Arrow), draft_vocab.safetensors (d2t, t2d), summary.json, manifest.json, and
packed/ with data.pack_length. Every normalised and tokenised table is cached by fingerprint under
data.cache_dir: a second run with the same inputs is a cache hit, and a record of the finished
preparation there lets `peagle train` on several processes tell the hit before it starts (it refuses
a cold preparation longer than the process-group timeout: docs/TRAINING.md, "The GPU recipes' data").
"""

from __future__ import annotations

import logging
import time

from omegaconf import DictConfig

from peagle_train.config import check_config, register
from peagle_train.runtime import RESUME_PREPARE, cli_main
from peagle_train.paths import CONF_DIR

logger = logging.getLogger(__name__)


def load_tokenizer_and_vocab_size(target_cfg):
    """(tokenizer, target vocabulary size) of the `target` config group without loading the weights
    where possible (an HF directory, or a hub id: its config and tokenizer files only, downloaded if
    missing); a GGUF file goes through `load_target`'s cache."""
    from transformers import AutoTokenizer

    from peagle_train.target.load import load_target_config, model_source

    tok = AutoTokenizer.from_pretrained(model_source(target_cfg.path, weights=False), local_files_only=True)
    return tok, load_target_config(target_cfg.path).vocab_size


@cli_main(config_path=str(CONF_DIR), config_name="train", version_base="1.3", resume=RESUME_PREPARE)
def main(cfg: DictConfig) -> dict:
    from peagle_train.data.prepare import format_summary, prepare_from_config, save_prepared  # after the checks

    check_config(cfg, "prepare")  # every setting in range (config.py), before any work
    t0 = time.perf_counter()
    tok, vocab_size = load_tokenizer_and_vocab_size(cfg.target)
    d = cfg.data
    data = prepare_from_config(d, tok, vocab_size, seed=cfg.seed)
    save_prepared(data, cfg.output_dir, pack_length=d.pack_length)
    logger.info("data summary:\n" + format_summary(data.summary))
    logger.info(f"prepared data in {cfg.output_dir} ({time.perf_counter() - t0:.1f} s); train with "
          f"data.prepared_dir={cfg.output_dir}")
    return data.summary


register()  # the typed, strict schema (peagle_train/config.py) that conf/train.yaml starts from


def run(argv: list[str] | None = None) -> int:
    """`peagle prepare key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    return run_hydra(main, argv, __doc__, "prepare")
