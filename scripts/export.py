"""Export a training checkpoint in the speculators P-EAGLE format, or validate an export.

    python scripts/export.py checkpoint=runs/demo/checkpoint output=runs/demo/export2 [export.dtype=bfloat16]
    python scripts/export.py validate=runs/demo/export
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from peagle_train.export.speculators import ExportError, validate_export, write_export
from peagle_train.job import dtype_of
from peagle_train.training.loop import load_checkpoint


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.get("validate"):
        try:
            validate_export(cfg.validate)
        except ExportError as e:
            print(f"INVALID: {e}", file=sys.stderr)
            raise SystemExit(1)
        print(f"valid P-EAGLE export: {cfg.validate}")
        return
    if not cfg.get("checkpoint"):
        raise SystemExit("Give checkpoint=runs/<run>/checkpoint (and output=DIR), or validate=DIR.")
    draft, meta = load_checkpoint(Path(cfg.checkpoint))
    out = cfg.get("output") or str(Path(cfg.output_dir) / "export")
    arch = json.loads((Path(cfg.checkpoint) / "draft_config.json").read_text()).get("verifier_architectures", ["LlamaForCausalLM"])
    write_export(draft, out, verifier_name_or_path=cfg.target.name_or_path, verifier_architectures=arch,
                 dtype=dtype_of(cfg.export.dtype))
    print(f"export written and validated: {out}")


if __name__ == "__main__":
    main()
