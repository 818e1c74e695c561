#!/usr/bin/env bash
# The prepared check for a lent GPU: about 10 minutes on one GPU, one JSON line per step on stdout
# (docs/TRAINING.md "What only a GPU shows"; results go to docs/BENCHMARKS.md).
#   1. versions                  torch, CUDA, NCCL, GPU, transformers, accelerate, deepspeed        (≤ 60 s)
#   2. cuda_tests                tests/test_cuda.py (FlexAttention and the sparse plan equal dense,
#                                forward and backward; partitioned flex with few queries against a long
#                                kept context; bf16 close to fp32; a 1-GPU run learns) and the GPU
#                                semantics modelled on CPU (tests/test_gpu_semantics.py)            (≤ 200 s)
#   3. step8b                    an 8B-shaped step (Llama-3.1-8B architecture, random bf16 weights, the
#                                recipe's 4-layer head) at 2k, 8k and 16k tokens: tokens/s, peak memory
#                                against the planner's estimate, Dynamo recompiles                   (≤ 240 s)
#   4. engines                   DDP, DeepSpeed ZeRO-2 and FSDP2 for 4 steps each as an NCCL world of
#                                1: bf16 asserted inside the engine's forward, losses against DDP's  (≤ 120 s)
#   5. cpu_vs_gpu                the same fp32 step on CPU and on the GPU: equal loss and gradients  (≤ 60 s)
#   6. eval8b                    decoding ms/token on the 8B-shaped target and head, the recipe's
#                                evaluation time extrapolated against NCCL's 10-minute timeout      (≤ 120 s)
# Usage: bash scripts/gpu_check.sh [OUT_DIR]    (default /tmp/gpu_check; PYTHON=... picks the interpreter,
# default .venv/bin/python or python3, with peagle-train installed: PEAGLE_TORCH="torch>=2.6" bash
# scripts/install.sh test). Logs go to OUT_DIR; exit 0 when every step passed, 1 otherwise, 2 without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="$OUT/inductor_cache"   # FlexAttention compiles once, later processes reuse it
T0=$(date +%s)
FAILED=0

# json STEP KEY=VALUE...: one JSON line (values are strings unless numbers or true/false)
json() {
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

# pytest_step NAME LIMIT_S ARGS...: a pytest run as one JSON line (passed, failed, skipped, seconds)
pytest_step() {
  local name=$1 limit=$2 start rc line
  shift 2
  start=$(date +%s)
  timeout "$limit" "$PY" -m pytest -q -rs -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)
  count() { echo "$line" | grep -oE "[0-9]+ $1" | grep -oE '[0-9]+' || echo 0; }
  [ $rc -eq 0 ] || FAILED=1
  json "$name" ok=$([ $rc -eq 0 ] && echo true || echo false) exit=$rc seconds=$(( $(date +%s) - start )) \
    passed="$(count passed)" failed="$(count failed)" skipped="$(count skipped)" \
    timed_out=$([ $rc -eq 124 ] && echo true || echo false) log="$OUT/$name.log"
}

# py_step NAME LIMIT_S ARGS...: scripts/gpu_check.py's own JSON lines, or one line saying why none came
py_step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$PY" scripts/gpu_check.py "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.log"
  rc=$?
  grep '^{' "$OUT/$name.jsonl"
  if [ $rc -ne 0 ] || grep -q '"ok": false' "$OUT/$name.jsonl"; then FAILED=1; fi
  [ $rc -eq 0 ] || json "$name" ok=false exit=$rc seconds=$(( $(date +%s) - start )) \
    timed_out=$([ $rc -eq 124 ] && echo true || echo false) last_error="$(tail -1 "$OUT/$name.log" | tr -d '"=' | cut -c1-300)"
}

if ! "$PY" -c "import torch, peagle_train" > "$OUT/python.log" 2>&1; then
  json setup ok=false error="$PY cannot import torch and peagle_train (see $OUT/python.log). Fix: bash scripts/install.sh test"
  exit 1
fi
py_step versions 60 versions
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  json summary ok=false error="no CUDA device: the GPU steps did not run" seconds=$(( $(date +%s) - T0 ))
  exit 2
fi
pytest_step cuda_tests 200 tests/test_cuda.py tests/test_gpu_semantics.py -k "not each_engine and not cpu_and_gpu"
py_step step8b 240 step8b --tokens 2048,8192,16384
pytest_step engines 120 tests/test_cuda.py -k each_engine
pytest_step cpu_vs_gpu 60 tests/test_cuda.py -k cpu_and_gpu
py_step eval8b 120 eval8b --prompts 4 --new-tokens 64
json summary ok=$([ $FAILED -eq 0 ] && echo true || echo false) seconds=$(( $(date +%s) - T0 )) logs="$OUT"
exit $FAILED
