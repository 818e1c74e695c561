#!/usr/bin/env bash
# The smollm2-135m recipe end to end on one CPU box (docs/RESULTS.md): dump the target features of
# 4,000 ShareGPT conversations once, train the P-EAGLE head and the EAGLE-3 baseline on the same
# features side by side (one core each, the same wall-clock budget), then evaluate both on the 80
# MT-Bench first turns of Spec-Bench (greedy, K=5, 256 new tokens) and check the P-EAGLE export.
#
#   bash experiments/smollm2_pipeline.sh runs/smollm2            # every step resumes after a kill
#   TRAIN_MINUTES=72 EVAL_PROMPTS=16 FEATURES=runs/scaling/features bash experiments/smollm2_pipeline.sh runs/smollm2
#
# Steps (wall time on 2 CPU cores, docs/RESULTS.md): features (~28 min), training (TRAIN_MINUTES
# each, side by side), evaluation (~6 min), export check. FEATURES reuses a features directory of
# the same data (e.g. experiments/scaling_curve.sh's): the features step then only checks it.
set -euo pipefail
OUT=${1:?usage: smollm2_pipeline.sh OUTPUT_DIR}
TRAIN_MINUTES=${TRAIN_MINUTES:-72}  # ~28 features + 72 training + ~6 evaluation ≈ 1 h 46 min
# step caps of the cosine schedules, sized so that both runs cool down near TRAIN_MINUTES
# (1.7 and 3.8 s/step with one thread each on the 2-core AMD EPYC of docs/RESULTS.md; on a 2-core
# Xeon with AMX 1.75 and 4.4 s/step with the fused optimizer: EAGLE3_STEPS=950 there)
PEAGLE_STEPS=${PEAGLE_STEPS:-2400}
EAGLE3_STEPS=${EAGLE3_STEPS:-1100}
EVAL_PROMPTS=${EVAL_PROMPTS:-null}  # all 80 MT-Bench first turns (16: 2 per category)
EVAL_TOKENS=${EVAL_TOKENS:-256}
FEATURES=${FEATURES:-$OUT/features}
PY=${PYTHON:-python}
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/pipeline.log"; }

stamp "1/4 target features of the recipe's 4,000 ShareGPT conversations (offline shards in $FEATURES)"
"$PY" -m peagle_train.cli features recipe=smollm2-135m features.dir="$FEATURES" output_dir="$OUT/features-run" \
    > "$OUT/features.log" 2>&1

stamp "2/4 training P-EAGLE and EAGLE-3 side by side (${TRAIN_MINUTES} min each, 1 thread each)"
common=(recipe=smollm2-135m features.source=offline features.dir="$FEATURES" threads=1
        training.max_minutes="$TRAIN_MINUTES" training.resume=true eval.enabled=false)
"$PY" -m peagle_train.cli train "${common[@]}" training.max_steps="$PEAGLE_STEPS" output_dir="$OUT/peagle" > "$OUT/peagle.log" 2>&1 &
"$PY" -m peagle_train.cli train "${common[@]}" algorithm=eagle3 training.max_steps="$EAGLE3_STEPS" \
    output_dir="$OUT/eagle3" > "$OUT/eagle3.log" 2>&1 &
wait

stamp "3/4 evaluation: ${EVAL_PROMPTS/null/all 80} MT-Bench first turns, K=5, ${EVAL_TOKENS} new tokens, target alone + both heads"
# both turns of each question: eval.benchmark=mt_bench; other K: eval.num_speculative_tokens
"$PY" -m peagle_train.cli evaluate head="$OUT/peagle/checkpoint" baseline_head="$OUT/eagle3/checkpoint" \
    eval.benchmark=spec_bench eval.num_prompts="$EVAL_PROMPTS" eval.max_new_tokens="$EVAL_TOKENS" \
    eval.num_speculative_tokens=5 eval.batch_size=16 output_dir="$OUT/eval-mtbench-k5" > "$OUT/eval.log" 2>&1

stamp "4/4 export check (peagle train wrote $OUT/peagle/export)"
"$PY" -m peagle_train.cli export validate="$OUT/peagle/export"
stamp "done: $OUT/eval-mtbench-k5/eval/acceptance.json"
