"""Write a matrix of small exports (P-EAGLE / EAGLE-3, Llama / Qwen3 layers, fc options) with tiny
random targets saved beside them, for `scripts/check_speculators.sh matrix=true` to load with the
speculators library.

    python scripts/compat_exports.py output_dir=OUT_DIR

Writes OUT_DIR/exports.txt, one line per export: EXPORT_DIR VERIFIER_DIR."""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from peagle_train.cli import parse_pairs
from peagle_train.draft import DraftConfig, make_draft_head
from peagle_train.runtime import cli_main
from peagle_train.export.speculators import write_export
from peagle_train.target.aux_layers import AuxLayers


@dataclass
class Args:
    output_dir: str = MISSING  # where the exports, their verifiers and exports.txt go


def main(out: Path):
    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
    targets = {"llama": (LlamaForCausalLM(LlamaConfig(**kw)), "LlamaForCausalLM"),
               "qwen3": (Qwen3ForCausalLM(Qwen3Config(**kw)), "Qwen3ForCausalLM")}
    for fam, (model, arch) in targets.items():
        vdir = out / f"verifier-{fam}"
        model.save_pretrained(str(vdir))
        for algorithm in ("peagle", "eagle3"):
            for opts in ({}, {"norm_before_fc": True}, {"fc_norm": True, "norm_before_residual": True}):
                cfg = DraftConfig.from_target(model.config, num_layers=2, draft_vocab_size=64, mask_token_id=255,
                                              num_depths=4, aux_layer_ids=AuxLayers.default(8), algorithm=algorithm, **opts)
                head = make_draft_head(cfg)
                ids = torch.arange(0, 256, 4)
                head.init_from_target(model, ids, ids - torch.arange(64), torch.zeros(256, dtype=torch.bool).index_fill_(0, ids, True))
                name = f"{algorithm}-{fam}-" + ("-".join(opts) or "plain")
                write_export(head, out / name, verifier_name_or_path=str(vdir), verifier_architectures=[arch], overwrite=True)
                with open(out / "exports.txt", "a") as f:
                    f.write(f"{out / name} {vdir}\n")


if __name__ == "__main__":
    cli_main(lambda argv: main(Path(parse_pairs(argv, Args, __doc__).output_dir)))(sys.argv[1:])
