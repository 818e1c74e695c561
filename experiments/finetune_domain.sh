#!/usr/bin/env bash
# Domain fine-tuning and its forgetting on SmolLM2-135M-Instruct (docs/RESULTS.md, "Does starting from an
# existing head pay, and does a fine-tune forget?"):
#   bash experiments/finetune_domain.sh GENERAL_HEAD runs/finetune      # every stage resumes after a kill
#   python experiments/finetune_domain.py report runs/finetune docs/BENCHMARKS.md
# GENERAL_HEAD: a P-EAGLE checkpoint trained on general ShareGPT conversations (e.g. the cold head of
# experiments/warm_start.sh, trained on conversations 0..599).
# 1. code conversations (ShareGPT conversations whose answers hold a ``` block, from conversation 3,000 on,
#    so none was in the general head's data) and the general ones again for replay (finetune_domain.py split);
# 2. three fine-tunes from GENERAL_HEAD (draft.init_from), STEPS steps at LR: on code alone (the code data's
#    draft vocabulary, remapped), with replay (data.mix: code REPLAY_CODE, general REPLAY_GENERAL), and on code
#    alone keeping the general head's vocabulary (data.draft_vocab_from_head=true);
# 3. the four heads in one `peagle evaluate` per benchmark: PROMPTS HumanEval prompts (no prompt in any
#    training set) and PROMPTS MT-Bench first turns (Spec-Bench), greedy, K = 5.
set -euo pipefail
GENERAL=${1:?usage: finetune_domain.sh GENERAL_HEAD OUTPUT_DIR}
OUT=${2:?usage: finetune_domain.sh GENERAL_HEAD OUTPUT_DIR}
CODE=${CODE:-600}
STEPS=${STEPS:-96}
LR=${LR:-5e-4}
REPLAY_CODE=${REPLAY_CODE:-0.75}
REPLAY_GENERAL=${REPLAY_GENERAL:-0.25}
PROMPTS=${PROMPTS:-40}
NEW=${NEW:-64}
THREADS=${THREADS:-2}
PY=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/finetune.log"; }
finetune() {  # name, then the data keys
    local name=$1; shift
    [ -d "$OUT/$name/checkpoint" ] && return 0
    "$PY" -m peagle_train.cli train recipe=smollm2-135m-demo threads="$THREADS" eval.enabled=false export.enabled=false \
        draft.init_from="$GENERAL" training.max_steps="$STEPS" training.epochs=20 training.lr="$LR" \
        training.max_minutes=null training.resume=true data.num_conversations=null output_dir="$OUT/$name" "$@" \
        > "$OUT/$name.log" 2>&1
}

stamp "1/3 $CODE code conversations and the general ones"
[ -f "$OUT/data/code.json" ] || "$PY" "$HERE/finetune_domain.py" split "$OUT/data" "$CODE"
stamp "2/3 fine-tuning on code ($STEPS steps, lr $LR), alone and with replay"
finetune code data.path="$OUT/data/code.json"
finetune replay "data.mix=[{path: $OUT/data/code.json, weight: $REPLAY_CODE}, {path: $OUT/data/general.json, weight: $REPLAY_GENERAL}]"
finetune own_vocab data.path="$OUT/data/code.json" data.draft_vocab_from_head=true
for bench in humaneval spec_bench; do
    stamp "3/3 evaluating the four heads on $bench"
    [ -f "$OUT/eval-$bench/eval/acceptance.json" ] || "$PY" -m peagle_train.cli evaluate recipe=smollm2-135m-demo \
        head="$OUT/code/checkpoint" baseline_head="$GENERAL" "more_heads=[$OUT/replay/checkpoint,$OUT/own_vocab/checkpoint]" \
        eval.benchmark="$bench" eval.num_prompts="$PROMPTS" eval.max_new_tokens="$NEW" eval.num_speculative_tokens=5 \
        eval.batch_size=16 threads="$THREADS" output_dir="$OUT/eval-$bench" > "$OUT/eval-$bench.log" 2>&1
done
stamp "done: python $HERE/finetune_domain.py report $OUT docs/BENCHMARKS.md"
