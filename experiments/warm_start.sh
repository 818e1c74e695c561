#!/usr/bin/env bash
# Warm against cold on SmolLM2-135M-Instruct (docs/RESULTS.md, "Does starting from an existing head pay, and does a fine-tune forget?"):
#   bash experiments/warm_start.sh runs/warm_start          # every stage resumes after a kill
#   python experiments/warm_start.py report runs/warm_start docs/BENCHMARKS.md
# 1. two disjoint sets of ShareGPT conversations (warm_start.py split): A for the "released" head, B for
#    the P-EAGLE runs, as a released head is trained on other conversations than the user's;
# 2. an EAGLE-3 head on A (the demo recipe's sizes, SOURCE_STEPS steps, K_train SOURCE_K);
# 3. two P-EAGLE heads on B, the demo recipe, STEPS steps each, a checkpoint every SAVE steps: cold (from the
#    target, as every run starts) and warm (draft.init_from = the EAGLE-3 head's export);
# 4. every checkpoint of both in one `peagle evaluate` (one target-alone pass): PROMPTS Spec-Bench prompts
#    (its first 80 are MT-Bench's first turns), greedy, K = 5.
set -euo pipefail
OUT=${1:?usage: warm_start.sh OUTPUT_DIR}
CONVS=${CONVS:-600}
SOURCE_STEPS=${SOURCE_STEPS:-96}
SOURCE_K=${SOURCE_K:-3}
STEPS=${STEPS:-64}
SAVE=${SAVE:-16}
PROMPTS=${PROMPTS:-40}
NEW=${NEW:-64}
THREADS=${THREADS:-2}
PY=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/warm_start.log"; }
train() {  # name, then more keys
    local name=$1; shift
    [ -d "$OUT/$name/checkpoint" ] && return 0
    "$PY" -m peagle_train.cli train recipe=smollm2-135m-demo threads="$THREADS" eval.enabled=false \
        training.max_minutes=null training.keep_last=null training.resume=true output_dir="$OUT/$name" "$@" \
        > "$OUT/$name.log" 2>&1
}

stamp "1/4 two disjoint sets of $CONVS conversations"
[ -f "$OUT/data/b.json" ] || "$PY" "$HERE/warm_start.py" split "$OUT/data" "$CONVS"
stamp "2/4 the EAGLE-3 head on set A ($SOURCE_STEPS steps, K_train $SOURCE_K)"
train eagle3_a algorithm=eagle3 draft.num_depths="$SOURCE_K" data.path="$OUT/data/a.json" \
    data.num_conversations=null training.max_steps="$SOURCE_STEPS" training.epochs=20
for arm in cold warm; do
    stamp "3/4 P-EAGLE $arm on set B ($STEPS steps)"
    extra=(); [ "$arm" = warm ] && extra=(draft.init_from="$OUT/eagle3_a/export")
    train "$arm" data.path="$OUT/data/b.json" data.num_conversations=null training.max_steps="$STEPS" \
        training.epochs=20 training.save_every="$SAVE" export.enabled=false "${extra[@]}"
done
heads=()
for s in $(seq "$SAVE" "$SAVE" "$((STEPS - SAVE))"); do
    step=$(printf %06d "$s")
    heads+=("$OUT/warm/checkpoints/step_$step" "$OUT/cold/checkpoints/step_$step")
done
more=$(IFS=,; echo "${heads[*]}")
stamp "4/4 evaluating every checkpoint on $PROMPTS prompts"
[ -f "$OUT/eval/eval/acceptance.json" ] || "$PY" -m peagle_train.cli evaluate recipe=smollm2-135m-demo \
    head="$OUT/warm/checkpoint" baseline_head="$OUT/cold/checkpoint" "more_heads=[$more]" \
    eval.benchmark=spec_bench eval.num_prompts="$PROMPTS" eval.max_new_tokens="$NEW" eval.num_speculative_tokens=5 \
    eval.batch_size=16 threads="$THREADS" output_dir="$OUT/eval" > "$OUT/eval.log" 2>&1
stamp "done: python $HERE/warm_start.py report $OUT docs/BENCHMARKS.md"
