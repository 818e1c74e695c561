#!/usr/bin/env bash
# The check for a lent GPU (docs/TRAINING.md "The GPU check"): two commands of at most 7 minutes each
# on one GPU with no network, each printing one JSON line per step (scripts/gpu_check.py).
#
#   bash scripts/gpu_check.sh --wheels [PYVER]   here, with the network: gpu_wheels/ (git-ignored) holds
#                                                every package the check needs that the GPU image lacks
#                                                (scripts/gpu_wheels.txt), for Python PYVER (default 3.12)
#   bash scripts/gpu_check.sh 1 [OUT]            on the GPU: the wheels installed, versions, cuda_tests, step8b
#   bash scripts/gpu_check.sh 2 [OUT]            on the GPU: the wheels installed, engines (DDP, ZeRO-2, ZeRO-3,
#                                                FSDP2), cpu_vs_gpu, eval8b
#   bash scripts/gpu_check.sh --rehearse [DIR]   here, on CPU (CI runs it): a fresh venv holding only the GPU
#                                                image's packages at its versions (scripts/gpu_image.txt) and
#                                                the wheelhouse installed with --no-index, then parts 1 and 2
#                                                on CPU with a tiny target
#
# OUT (default $OUT where the device tool sets it, else /tmp/gpu_check) gets part<N>.jsonl and one log per
# step; the inductor cache stays in /tmp. PYTHON picks the interpreter (default: the image's python3, or
# .venv/bin/python in a checkout that has one). Exit 0 when every step passed, 1 otherwise, 2 without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHEELS=${PEAGLE_WHEELS:-$REPO/gpu_wheels}
SITE=${PEAGLE_SITE:-/tmp/peagle_site}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/peagle_inductor}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi

json() {  # json STEP KEY=VALUE...: one JSON line (numbers and true/false as such)
  "$PY" - "$@" <<'EOF'
import json, sys
step, kv = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
def val(v):
    if v in ("true", "false"): return v == "true"
    try: return int(v)
    except ValueError:
        try: return float(v)
        except ValueError: return v
print(json.dumps({"step": step, **{k: val(v) for k, v in kv.items()}}), flush=True)
EOF
}

# build_wheels PYVER DEST: the wheels of scripts/gpu_wheels.txt for CPython PYVER on x86-64 Linux; the
# source-only ones built with $PY (DeepSpeed's setup imports torch), no ops prebuilt
build_wheels() {
  local pyver=$1 dest=$2 reqs binary source log=/tmp/peagle_build_wheels.log
  mkdir -p "$dest"
  reqs=$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' scripts/gpu_wheels.txt | tr -d ' ')
  source=$(grep 'source only' scripts/gpu_wheels.txt | sed -e 's/#.*//' | tr -d ' ')
  binary=$(comm -23 <(echo "$reqs" | sort) <(echo "$source" | sort))
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" $binary > "$log" 2>&1 || { tail -3 "$log" >&2; return 1; }
  # shellcheck disable=SC2086
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" $source >> "$log" 2>&1 \
    || { tail -3 "$log" >&2; return 1; }
  local n size
  n=$(ls "$dest"/*.whl | wc -l)
  size=$(du -sm "$dest" | cut -f1)
  json wheels ok=true python="cp${pyver/./}" wheels="$n" mib="$size" dir="$dest"
}

# install_wheels: the wheelhouse into $SITE (--no-index, --no-deps: the image's torch and the rest stay),
# put first on PYTHONPATH with the repository; one JSON line
install_wheels() {
  local start=$(date +%s)
  if [ ! -d "$WHEELS" ] || ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    json wheels ok=false error="no wheelhouse at $WHEELS. Fix: bash scripts/gpu_check.sh --wheels here, then carry gpu_wheels"
    return 1
  fi
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl > /tmp/peagle_wheels.log 2>&1; then
    json wheels ok=false error="pip install --no-index from $WHEELS failed: $(tail -1 /tmp/peagle_wheels.log | tr -d '"=')"
    return 1
  fi
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  json wheels ok=true installed="$(ls "$WHEELS"/*.whl | wc -l)" into="$SITE" seconds=$(( $(date +%s) - start ))
}

rehearse() {
  local dir=${1:-/tmp/gpu_rehearsal} start=$(date +%s) ok=true pyver
  rm -rf "$dir" && mkdir -p "$dir"
  # the bare machine: a fresh venv with the image's packages alone (pip may reach the registries here)
  python3 -m venv "$dir/venv" || return 1
  PY=$dir/venv/bin/python
  if ! "$PY" -m pip install -q --upgrade pip > "$dir/venv.log" 2>&1 \
      || ! "$PY" -m pip install -q "${PEAGLE_TORCH:-torch==2.13.0}" -r scripts/gpu_image.txt >> "$dir/venv.log" 2>&1; then
    json rehearse_venv ok=false error="the image's packages did not install (see $dir/venv.log)"
    return 1
  fi
  # what the image lacks must be missing here too, or the rehearsal proves nothing
  if "$PY" -c "import hydra" 2>/dev/null || "$PY" -c "import datasets" 2>/dev/null || "$PY" -c "import deepspeed" 2>/dev/null; then
    json rehearse_venv ok=false error="the venv already holds hydra, datasets or deepspeed: scripts/gpu_image.txt pulls them in"
    return 1
  fi
  json rehearse_venv ok=true python="$("$PY" -c 'import sys; print(sys.version.split()[0])')" \
    torch="$("$PY" -c 'import torch; print(torch.__version__)')" \
    transformers="$("$PY" -c 'import transformers; print(transformers.__version__)')" \
    accelerate="$("$PY" -c 'import accelerate; print(accelerate.__version__)')"
  pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  "$PY" -m pip install -q setuptools wheel >> "$dir/venv.log" 2>&1   # to build the source-only wheels
  build_wheels "$pyver" "$dir/wheels" || { json wheels ok=false error="building the wheelhouse failed"; return 1; }
  WHEELS=$dir/wheels SITE=$dir/site
  install_wheels || return 1
  # a tiny Llama in place of the recipe's 8B target
  "$PY" -c "
from transformers import LlamaConfig
LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096).save_pretrained('$dir/tiny')" || return 1
  for part in 1 2; do
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PY" scripts/gpu_check.py part $part --out "$dir/out" --device cpu \
      --config "$dir/tiny/config.json" || ok=false
  done
  json summary ok=$ok rehearsal=true seconds=$(( $(date +%s) - start )) wheelhouse_mib="$(du -sm "$dir/wheels" | cut -f1)" \
    results="$dir/out"
  [ $ok = true ]
}

case "${1:-}" in
  --wheels)
    build_wheels "${2:-3.12}" "$WHEELS" || { json wheels ok=false error="building the wheelhouse failed"; exit 1; }
    echo "carry it: the device tool's run(carry=[\"gpu_wheels\"]); repository + wheels: $(( $(git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1) + $(du -sm "$WHEELS" | cut -f1) )) MiB of 64" >&2 ;;
  --rehearse)
    rehearse "${2:-}" ;;
  1|2)
    OUT_DIR=${2:-${OUT:-/tmp/gpu_check}}
    mkdir -p "$OUT_DIR"
    install_wheels || exit 1
    exec "$PY" scripts/gpu_check.py part "$1" --out "$OUT_DIR" ;;
  *)
    echo "usage: bash scripts/gpu_check.sh --wheels [PYVER] | 1 [OUT] | 2 [OUT] | --rehearse [DIR]" >&2
    exit 2 ;;
esac
