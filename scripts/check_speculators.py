"""The real client test: load an export with the `speculators` library's own loader.

    python scripts/check_speculators.py head=EXPORT_DIR [target.path=LOCAL_TARGET_HF_DIR]

speculators loads the verifier's lm_head when it loads a head; with no hub access, give a local HF
directory of the target as target.path (for the GGUF default: the dequantised copy under
~/.cache/peagle_train/).

Runs in its own environment (speculators 0.9.0 and its own requirements, on the project's CPU
torch); `bash scripts/check_speculators.sh head=EXPORT_DIR` builds it and runs this.
Checks that the model class is the one the config names, that no exported tensor is missing from
or unknown to the loaded model, that every tensor loads bit-identical, and that mask_token_id and
the aux layer ids survive. Exit status 1 on any problem.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel


def main(export_dir: str, verifier: str | None = None) -> int:
    d = Path(export_dir)
    cfg = json.loads((d / "config.json").read_text())
    if verifier:  # speculators reads the verifier's lm_head at load time: point it at a local copy
        tmp = Path(tempfile.mkdtemp()) / d.name
        shutil.copytree(d, tmp)
        local = json.loads((tmp / "config.json").read_text())
        local["speculators_config"]["verifier"]["name_or_path"] = verifier
        (tmp / "config.json").write_text(json.dumps(local, indent=2))
        d = tmp
    model = SpeculatorModel.from_pretrained(str(d))
    sd = load_file(str(d / "model.safetensors"))
    msd = model.state_dict()
    problems = [f"tensor {k} unknown to {type(model).__name__}" for k in sd if k not in msd]
    problems += [f"tensor {k} changed on load" for k in sd if k in msd and not torch.equal(msd[k].to(sd[k].dtype).cpu(), sd[k])]
    ignored = {"verifier_lm_head.weight", "verifier_norm.weight"}
    problems += [f"model tensor {k} not in the export (random after load)" for k in msd
                 if k not in sd and k not in ignored and not k.startswith("rotary_emb")]
    mc = model.config
    if cfg.get("mask_token_id") is not None and getattr(mc, "mask_token_id", None) != cfg["mask_token_id"]:
        problems.append(f"mask_token_id {getattr(mc, 'mask_token_id', None)} != {cfg['mask_token_id']}")
    if list(getattr(mc, "eagle_aux_hidden_state_layer_ids", []) or []) != cfg["eagle_aux_hidden_state_layer_ids"]:
        problems.append("eagle_aux_hidden_state_layer_ids changed on load")
    print(f"speculators loaded {type(model).__name__} ({cfg['speculators_model_type']}) from {d}: "
          f"{len(sd)} tensors, {len(msd)} model tensors")
    for p in problems:
        print("PROBLEM:", p)
    print("OK" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


def parse_pairs(argv: list[str]) -> dict[str, str]:
    """`key=value` arguments as {key: value}; this venv has no peagle_train (nor, maybe, omegaconf),
    so the pairs are split here. SystemExit naming a bad argument or key."""
    keys = ("head", "target.path")
    out = {}
    for a in argv:
        key, eq, value = a.partition("=")
        if not eq or key not in keys:
            raise SystemExit(f"check_speculators.py: error: argument '{a}': use {' '.join(k + '=...' for k in keys)}")
        out[key] = value
    if "head" not in out:
        raise SystemExit("check_speculators.py: error: give head=EXPORT_DIR [target.path=LOCAL_TARGET_HF_DIR]")
    return out


if __name__ == "__main__":
    args = parse_pairs(sys.argv[1:])
    sys.exit(main(args["head"], args.get("target.path")))
