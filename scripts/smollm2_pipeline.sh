#!/usr/bin/env bash
# The smollm2-135m recipe end to end on one CPU box (docs/RESULTS.md): regenerate the responses with
# the target, dump its features once, train the P-EAGLE head and the EAGLE-3 baseline on the same
# features side by side (one core each, same wall-clock budget), then evaluate both on MT-Bench
# questions (the 80 first turns of Spec-Bench, greedy, K=5, 256 new tokens) and check the P-EAGLE export.
#
#   bash scripts/smollm2_pipeline.sh runs/smollm2            # every step resumes after a kill
#   REGEN_MINUTES=30 TRAIN_MINUTES=34 EVAL_PROMPTS=16 EVAL_TOKENS=128 bash scripts/smollm2_pipeline.sh runs/smollm2
#
# Steps (wall time on 2 CPU cores, docs/RESULTS.md): regeneration (stops after REGEN_MINUTES;
# rerun to resume), features, training (TRAIN_MINUTES each, side by side), evaluation.
set -euo pipefail
OUT=${1:?usage: smollm2_pipeline.sh OUTPUT_DIR}
REGEN_MINUTES=${REGEN_MINUTES:-30}  # 30 + ~10 features + 34 training + ~41 evaluation ≈ 2 h
TRAIN_MINUTES=${TRAIN_MINUTES:-34}
# step caps of the cosine schedules; with the recipe's 2 layers TRAIN_MINUTES stops both runs first
# (271 P-EAGLE and 183 EAGLE-3 steps in 34 min here, docs/RESULTS.md: the heads measured there)
PEAGLE_STEPS=${PEAGLE_STEPS:-330}
EAGLE3_STEPS=${EAGLE3_STEPS:-250}
EVAL_PROMPTS=${EVAL_PROMPTS:-null}  # all 80 MT-Bench first turns (16: 2 per category, ~5× faster)
EVAL_TOKENS=${EVAL_TOKENS:-256}
PY=${PYTHON:-python}
mkdir -p "$OUT"
DATA="$OUT/regen/regenerated.jsonl"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/pipeline.log"; }

stamp "1/5 regeneration (greedy, first user turn, ≤ 256 new tokens; stops after ${REGEN_MINUTES} min)"
timeout --signal=INT "$((REGEN_MINUTES * 60))" "$PY" -m peagle_train.cli regenerate recipe=smollm2-135m \
    data.num_conversations=3000 regenerate.max_turns=1 regenerate.max_prompt_tokens=256 \
    regenerate.max_new_tokens=256 regenerate.batch_size=48 output_dir="$OUT/regen" || true
stamp "   $(wc -l < "$DATA") conversations regenerated"

stamp "2/5 target features (offline shards)"
"$PY" -m peagle_train.cli features recipe=smollm2-135m data.path="$DATA" \
    features.dir="$OUT/features" output_dir="$OUT/features-run"

stamp "3/5 training P-EAGLE and EAGLE-3 side by side (${TRAIN_MINUTES} min each, 1 thread each)"
common=(recipe=smollm2-135m data.path="$DATA" features.source=offline features.dir="$OUT/features"
        threads=1 training.max_minutes="$TRAIN_MINUTES" eval.enabled=false)
"$PY" -m peagle_train.cli train "${common[@]}" training.max_steps="$PEAGLE_STEPS" output_dir="$OUT/peagle" > "$OUT/peagle.log" 2>&1 &
"$PY" -m peagle_train.cli train "${common[@]}" algorithm=eagle3 training.max_steps="$EAGLE3_STEPS" training.val_conversations=0 \
    output_dir="$OUT/eagle3" > "$OUT/eagle3.log" 2>&1 &
wait

stamp "4/5 evaluation: ${EVAL_PROMPTS/null/all 80} MT-Bench first turns, K=5, ${EVAL_TOKENS} new tokens, target alone + both heads"
# 41 min on 2 CPU cores for the 80 first turns at 256 tokens (docs/RESULTS.md); both turns of each
# question: eval.benchmark=mt_bench
"$PY" -m peagle_train.cli evaluate head="$OUT/peagle/checkpoint" baseline_head="$OUT/eagle3/checkpoint" \
    eval.benchmark=spec_bench eval.num_prompts="$EVAL_PROMPTS" eval.max_new_tokens="$EVAL_TOKENS" \
    eval.num_speculative_tokens=5 eval.batch_size=16 output_dir="$OUT/eval-mtbench-k5"

stamp "5/5 export check (peagle train wrote $OUT/peagle/export)"
"$PY" -m peagle_train.cli export validate="$OUT/peagle/export"
stamp "done: $OUT/eval-mtbench-k5/eval/acceptance.json"
