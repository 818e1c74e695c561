#!/usr/bin/env bash
# The prepared GPU check: about 8 minutes on one GPU, then one summary.
#   1. the CUDA-only tests (tests/test_cuda.py: FlexAttention and the sparse plan, forward and
#      backward, equal the dense path; a bf16 step close to fp32 with fp32 master weights; a short
#      1-GPU training run that learns) and the attention/step equality tests      (≤ 150 s)
#   2. scripts/bench_draft.py on CUDA: today's path (fp32, FlexAttention) and the new one (bf16
#      autocast, FlexAttention) at 2048 and 8192 tokens, 1 and 4 layers, all anchors; speculators'
#      step too where its venv exists (SPECULATORS_VENV or .venv-speculators)            (≤ 180 s)
#   3. the demo recipe (recipes/smollm2-135m-demo.yaml), cut to 2 minutes of training and
#      5 evaluation prompts                                                               (≤ 150 s)
# Usage: bash scripts/gpu_check.sh [OUT_DIR]       (default /tmp/gpu_check; PYTHON=... picks the
# interpreter, default .venv/bin/python or python3, with peagle-train installed: scripts/install.sh
# test, PEAGLE_TORCH set to a CUDA torch). Logs and the benchmark table go to OUT_DIR.
# Without a CUDA GPU, step 1 still runs (the CUDA tests skip) and steps 2-3 are skipped; exit 2.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="$OUT/inductor_cache"   # FlexAttention compiles once, later processes reuse it
T0=$(date +%s)
RESULTS=()

# run NAME LIMIT_S CMD...: runs CMD with a time limit, its output in $OUT/NAME.log
run() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  RESULTS+=("$name: exit $rc in $(( $(date +%s) - start )) s$([ $rc -eq 124 ] && echo ' (time limit)')")
  return $rc
}

if ! "$PY" -c "import torch, peagle_train" > "$OUT/python.log" 2>&1; then
  echo "gpu_check: $PY cannot import torch and peagle_train (see $OUT/python.log). Fix: bash scripts/install.sh test"
  exit 1
fi
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then HAVE_CUDA=1; else HAVE_CUDA=0; fi
"$PY" - > "$OUT/device.txt" 2>&1 <<'EOF'
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}, torch {torch.__version__}")
else:
    print(f"no CUDA device (torch {torch.__version__})")
EOF

# 1. tests
run tests 150 "$PY" -m pytest -q -rs tests/test_cuda.py tests/test_cod_attention.py tests/test_training.py

# 2. the draft step benchmark on CUDA
if [ $HAVE_CUDA -eq 1 ]; then
  paths=today,new
  if [ -x "${SPECULATORS_VENV:-.venv-speculators}/bin/python" ]; then paths=$paths,speculators; fi
  run bench_draft 180 "$PY" scripts/bench_draft.py --device cuda --sizes 2048,8192 --layers 1,4 --anchors all \
    --paths "$paths" --no-drafting --out "$OUT/BENCHMARKS.md"
else
  RESULTS+=("bench_draft: skipped (no CUDA)")
fi

# 3. the demo recipe, shortened
if [ $HAVE_CUDA -eq 1 ]; then
  rm -rf "$OUT/demo"
  run demo 150 "$PY" train.py recipe=smollm2-135m-demo output_dir="$OUT/demo" training.max_minutes=2 \
    eval.num_prompts=5 eval.max_new_tokens=64
else
  RESULTS+=("demo: skipped (no CUDA)")
fi

# one summary
echo
echo "================ gpu_check summary ($(( $(date +%s) - T0 )) s) ================"
echo "device: $(cat "$OUT/device.txt")"
for r in "${RESULTS[@]}"; do echo "  $r"; done
echo "tests: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -1)"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
log = out / "bench_draft.log"
if log.is_file():
    rows = [{"path": "speculators", **json.loads(x)} for x in log.read_text().splitlines() if x.startswith("{")]
    print("bench_draft (tokens/s, peak MB):")
    for r in rows:
        what = r.get("error") or f"{r['tokens_per_s']:.0f} tok/s, {r['peak_mb']:.0f} MB"
        print(f"  {r['path']:<12} n={r['n']:<5} layers={r['layers']} anchors={r['max_anchors'] or 'all'}: {what}")
    by = {(r["path"], r["n"], r["layers"], r["max_anchors"] or 0): r for r in rows if "error" not in r}
    for (p, n, L, a), r in sorted(by.items()):
        for peer in ("today", "speculators"):
            if p == "new" and (peer, n, L, a) in by:
                print(f"  new / {peer} at n={n}, {L} layer(s), anchors {a or 'all'}: "
                      f"{r['tokens_per_s'] / by[(peer, n, L, a)]['tokens_per_s']:.2f}x")
summary = out / "demo" / "summary.json"
if summary.is_file():
    s = json.loads(summary.read_text())
    t, e = s.get("training", {}), s.get("eval", {})
    print(f"demo: {t.get('steps')} steps, {t.get('tokens_per_second', 0):.0f} training tok/s, "
          f"tau {e.get('acceptance_length')}, lossless {e.get('lossless')}")
elif (out / "demo.log").is_file():
    print("demo: no summary.json; last lines of demo.log:")
    print("  " + "\n  ".join((out / "demo.log").read_text().splitlines()[-5:]))
EOF
echo "logs: $OUT"
[ $HAVE_CUDA -eq 1 ] || { echo "no CUDA GPU: the GPU steps did not run"; exit 2; }
