#!/usr/bin/env bash
# Quality ablations at equal token budget on SmolLM2-135M-Instruct (docs/RESULTS.md, "Quality ablations").
#   bash scripts/ablations.sh runs/ablations          # every stage resumes after a kill
#   python scripts/ablation_report.py run_dir=runs/ablations
# 1. the target regenerates the first turn of CONVS ShareGPT conversations (BACKEND: vLLM, or hf, the
#    in-process engine; REGENERATE=0 skips this stage and trains on the rows written so far);
# 2. target features of ORIG_CONVS ShareGPT conversations with their own answers, once;
# 3. one training per arm, one factor changed from the base (ShareGPT's answers, offline features,
#    2 layers, KL, mask_hidden N(0, 0.02²), COD r 0.7 / r_min 0.2, constant lr after 30 warm-up
#    steps), checkpoints at the budgets (a constant lr makes step N the run stopped at N); the
#    schedule arms train one run per budget; the regenerated arm reads its features online;
# 4. the heads of two arms per `peagle evaluate` run: 80 MT-Bench first turns, K = 5, 128 tokens.
# TV=0 leaves out the total-variation loss arm; REGEN_EPOCHS=2 lets the regenerated arm repeat its rows
# when fewer were regenerated than the largest budget needs.
set -euo pipefail
OUT=${1:?usage: ablations.sh OUTPUT_DIR}
CONVS=${CONVS:-2400}
ORIG_CONVS=${ORIG_CONVS:-1200}       # ShareGPT's own answers: ≈ 0.68M tokens at max_length 640
BUDGETS=${BUDGETS:-"96 192"}         # optimizer steps of ≤ 2,048 tokens
LAST=${BUDGETS##* }
FIRST=${BUDGETS%% *}
PY=${PYTHON:-python}
BACKEND=${BACKEND:-vllm}             # regeneration: vllm | hf
mkdir -p "$OUT/eval"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/ablations.log"; }
regen=(recipe=smollm2-135m data.path="$OUT/regen/regenerated.jsonl" data.num_conversations=null)
orig=(recipe=smollm2-135m data.num_conversations="$ORIG_CONVS")

stamp "1/4 regenerating $CONVS first turns ($BACKEND)"
[ "${REGENERATE:-1}" = 0 ] || "$PY" -m peagle_train.cli regenerate recipe=smollm2-135m regenerate.backend="$BACKEND" \
    regenerate.max_turns=1 regenerate.batch_size=128 regenerate.max_new_tokens=384 data.num_conversations="$CONVS" \
    output_dir="$OUT/regen" > "$OUT/regen.log" 2>&1
stamp "2/4 target features of $ORIG_CONVS ShareGPT conversations"
"$PY" -m peagle_train.cli features "${orig[@]}" features.dir="$OUT/features" output_dir="$OUT/features-run" \
    > "$OUT/features.log" 2>&1

arm() {  # arm NAME STEPS [overrides...]
    local name=$1 steps=$2; shift 2
    [ -d "$OUT/$name/checkpoints/step_$(printf %06d "$steps")" ] && return 0
    "$PY" -m peagle_train.cli train threads=1 eval.enabled=false export.enabled=false training.schedule=constant \
        training.warmup_steps=30 training.max_steps="$steps" training.max_minutes=null training.epochs=1 \
        training.save_every="$FIRST" training.keep_last=null training.val_conversations=0 training.resume=true \
        output_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
}
offline=("${orig[@]}" features.source=offline features.dir="$OUT/features")
stamp "3/4 training the arms in two lanes, one thread each"
lane1() {
    arm base "$LAST" "${offline[@]}"
    arm regen "$LAST" "${regen[@]}" training.epochs="${REGEN_EPOCHS:-1}"
    arm mask_std1 "$LAST" "${offline[@]}" draft.mask_hidden_std=1.0
    for S in $BUDGETS; do arm "wsd@$S" "$S" "${offline[@]}" training.schedule=wsd; done
    [ "${TV:-1}" = 0 ] || arm tv "$LAST" "${offline[@]}" training.loss=tv
}
lane2() {
    arm layers4 "$LAST" "${offline[@]}" draft.num_layers=4
    arm cod_r0.85 "$LAST" "${offline[@]}" training.down_sample_ratio=0.85 training.down_sample_ratio_min=0.4
    arm oov_mask "$LAST" "${offline[@]}" training.mask_oov_targets=true
    for S in $BUDGETS; do arm "cosine@$S" "$S" "${offline[@]}" training.schedule=cosine; done
}
lane1 & lane2; wait

stamp "4/4 evaluating two heads per run"
pair() {  # pair ARM_A DIR_A ARM_B DIR_B STEP
    local out="$OUT/eval/$1__${3:-none}/step_$(printf %06d "$5")"
    [ -f "$out/eval/acceptance.json" ] && return 0
    mkdir -p "$(dirname "$out")"
    "$PY" -m peagle_train.cli evaluate head="$2" ${4:+baseline_head="$4"} eval.benchmark=spec_bench eval.num_prompts=null \
        eval.max_new_tokens=128 eval.num_speculative_tokens=5 eval.batch_size=16 threads=2 output_dir="$out" \
        > "$out.log" 2>&1
}
ck() { echo "$OUT/$1/checkpoints/step_$(printf %06d "$2")"; }
for S in $BUDGETS; do
    pair regen "$(ck regen "$S")" base "$(ck base "$S")" "$S"
    pair layers4 "$(ck layers4 "$S")" mask_std1 "$(ck mask_std1 "$S")" "$S"
    pair cod_r0.85 "$(ck cod_r0.85 "$S")" oov_mask "$(ck oov_mask "$S")" "$S"
    pair "wsd@$S" "$(ck "wsd@$S" "$S")" "cosine@$S" "$(ck "cosine@$S" "$S")" "$S"
    [ "${TV:-1}" = 0 ] || pair tv "$(ck tv "$S")" "" "" "$S"
done
stamp "done: python scripts/ablation_report.py run_dir=$OUT"
