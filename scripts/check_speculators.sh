#!/usr/bin/env bash
# Load exports with the speculators library (its own test job: it needs its own torch).
#   bash scripts/check_speculators.sh head=runs/demo/export [target.path=LOCAL_TARGET_HF_DIR]
#   bash scripts/check_speculators.sh matrix=true  # 12 small exports: P-EAGLE/EAGLE-3 × Llama/Qwen3 × fc options
# Builds .venv-speculators once (set SPECULATORS_VENV to reuse one), then runs
# scripts/check_speculators.py in it: speculators 0.9.0 on this project's CPU torch (2.13.0, the
# same torch as our trainer in the parity benchmark), its other requirements as it declares them,
# less torchvision and torchaudio (their wheels pin another torch; nothing here imports them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECULATORS_VENV:-.venv-speculators}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q --no-deps speculators==0.9.0
  "$VENV/bin/python" - > "$VENV/speculators-requirements.txt" <<'PY'
import importlib.metadata as m, re
for r in m.requires("speculators") or []:
    name = re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0].lower()
    if "extra ==" not in r and name not in ("torch", "torchvision", "torchaudio", "transformers"):
        print(r.split(";")[0].strip())
PY
  "$VENV/bin/pip" install -q -r "$VENV/speculators-requirements.txt" 'transformers==5.19.0'
fi
export HF_HUB_OFFLINE=1
if [ "${1:-}" = "matrix=true" ]; then
  out=$(mktemp -d)
  python scripts/compat_exports.py output_dir="$out" > /dev/null
  fail=0
  while read -r exp verifier; do
    if log=$("$VENV/bin/python" scripts/check_speculators.py head="$exp" target.path="$verifier" 2>&1); then rc=0; else rc=$?; fail=1; fi
    echo "$log" | grep -E "^(speculators loaded|PROBLEM|OK|[0-9]+ problems)" || echo "$log" | tail -3
    [ $rc -eq 0 ] || echo "FAILED: $exp"
  done < "$out/exports.txt"
  rm -rf "$out"
  exit $fail
fi
"$VENV/bin/python" scripts/check_speculators.py "$@"
