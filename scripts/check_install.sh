#!/usr/bin/env bash
# A non-editable install, used from an empty directory: the packaged configs, recipes and Spec-Bench
# questions are found, the demo recipe composes with the strict schema, and a recipe dry run (2
# training steps on a tiny random target of its family) runs from the installed package.
#   bash scripts/check_install.sh [VENV_DIR]     # default /tmp/peagle-install-check; slow: installs every dependency
set -euo pipefail
SRC="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${1:-/tmp/peagle-install-check}
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "${PEAGLE_TORCH:-torch==2.13.0}"
COPY=$(mktemp -d)                                      # build from a copy: nothing is written into the checkout
(cd "$SRC" && tar --exclude=__pycache__ --exclude='*.egg-info' -cf - pyproject.toml README.md peagle_train conf recipes data/spec_bench) \
  | tar -C "$COPY" -xf -
"$VENV/bin/pip" install -q "$COPY"                     # not -e: the package is copied into site-packages
RUN=$(mktemp -d)
cd "$RUN"
OMP_NUM_THREADS=1 "$VENV/bin/python" - "$RUN" <<'PY'
import sys
from pathlib import Path

import peagle_train
from peagle_train import paths
from peagle_train.config import recipe_names, register

pkg = Path(peagle_train.__file__).resolve().parent
assert "site-packages" in str(pkg), f"not a non-editable install: {pkg}"
for p in (paths.CONF_DIR / "train.yaml", paths.CONF_DIR / "config.yaml", paths.RECIPES_DIR / "smollm2-135m-demo.yaml",
          paths.SPEC_BENCH, paths.SPEC_BENCH.with_name("LICENSE")):
    assert p.is_file() and str(p).startswith(str(pkg)), p
assert "smollm2-135m-demo" in recipe_names() and "llama-3.1-8b-instruct" in recipe_names()
from peagle_train.decoding.evaluate import load_spec_bench
assert len(load_spec_bench("pkg:spec_bench", ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                              "humanities"), None)) == 80

from hydra import compose, initialize_config_dir
register()
with initialize_config_dir(str(paths.CONF_DIR), version_base="1.3"):
    cfg = compose("train", overrides=["recipe=smollm2-135m-demo", f"output_dir={sys.argv[1]}/dry", "dry_run=true"])
assert cfg.training.max_steps == 64 and cfg.target.path == "pkg:smollm2"
from peagle_train.dryrun import dry_run
res = dry_run(cfg, Path(sys.argv[1]) / "dry")
print("installed package:", pkg)
print("dry run of smollm2-135m-demo from the packaged config:", {k: v for k, v in res.items() if k != "training"})
assert res["steps"] == 2
PY
echo "install check passed (venv $VENV, ran in $RUN)"
