#!/usr/bin/env bash
# Quality ablations at equal token budget on SmolLM2-135M-Instruct (docs/RESULTS.md, "Which training settings matter";
# the table: docs/BENCHMARKS.md, "Quality ablations at equal token budget").
#   bash experiments/ablations.sh runs/ablations          # every stage resumes after a kill
#   python experiments/ablation_report.py run_dir=runs/ablations
# 1. the target regenerates the first turn of CONVS ShareGPT conversations (BACKEND: vLLM, or hf, the
#    in-process engine; REGENERATE=0 skips this stage and trains on the rows written so far);
# 2. target features of ORIG_CONVS ShareGPT conversations with their own answers, once;
# 3. one training per arm, one factor changed from the base (ShareGPT's answers, offline features,
#    2 layers, KL, mask_hidden N(0, 0.02²), COD r 0.7 / r_min 0.2, 8,192-token draft vocabulary, constant lr after 30 warm-up
#    steps), checkpoints at the budgets (a constant lr makes step N the run stopped at N); the
#    schedule arms train one run per budget; the regenerated arm reads its features online;
# 4. every arm's head at a budget in one `peagle evaluate` run (head, baseline_head, more_heads): 80
#    MT-Bench first turns, K = 5, 128 tokens, one target-alone pass;
# 5. the training speed of the arms whose step costs differ (SPEED_ARMS), each alone on the machine
#    (EVAL_THREADS threads, SPEED_STEPS steps), for the comparison at equal wall-clock.
# LANES=1 trains the arms one after the other (one core left free); EVAL_THREADS sets the evaluations'
# threads (default 2). TV=0 leaves out the total-variation loss arm; REGEN_EPOCHS=2 lets the regenerated arm repeat its rows
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
declare -A OVR=(  # arm -> its overrides of the base (one factor each)
    [base]="" [layers4]="draft.num_layers=4" [mask_std1]="draft.mask_hidden_std=1.0"
    [cod_r0.85]="training.down_sample_ratio=0.85 training.down_sample_ratio_min=0.4"
    [oov_mask]="training.mask_oov_targets=true" [tv]="training.loss=tv"
    [vocab16k]="data.draft_vocab_size=16384" [vocab32k]="data.draft_vocab_size=32768")
stamp "3/4 training the arms in ${LANES:-2} lane(s), one thread each"
lane1() {
    arm base "$LAST" "${offline[@]}"
    arm regen "$LAST" "${regen[@]}" training.epochs="${REGEN_EPOCHS:-1}"
    arm mask_std1 "$LAST" "${offline[@]}" ${OVR[mask_std1]}
    for S in $BUDGETS; do arm "wsd@$S" "$S" "${offline[@]}" training.schedule=wsd; done
    [ "${TV:-1}" = 0 ] || arm tv "$LAST" "${offline[@]}" ${OVR[tv]}
}
lane2() {
    local a
    for a in layers4 cod_r0.85 oov_mask; do arm "$a" "$LAST" "${offline[@]}" ${OVR[$a]}; done
    for S in $BUDGETS; do arm "cosine@$S" "$S" "${offline[@]}" training.schedule=cosine; done
    for a in vocab16k vocab32k; do arm "$a" "$LAST" "${offline[@]}" ${OVR[$a]}; done
}
if [ "${LANES:-2}" = 1 ]; then lane1; lane2; else lane1 & lane2; wait; fi

stamp "4/4 evaluating every arm of a budget in one run (one target-alone pass)"
group() {  # group STEP ARM...: the first arm is head=, the second baseline_head=, the others more_heads
    local S=$1; shift
    local name; name=$(printf '%s__' "$@"); name=${name%__}
    local out="$OUT/eval/$name/step_$(printf %06d "$S")"
    [ -f "$out/eval/acceptance.json" ] && return 0
    mkdir -p "$(dirname "$out")"
    local more=() a
    for a in "${@:3}"; do more+=("'$(ck "$a" "$S")'"); done
    local list; list=$(IFS=,; echo "${more[*]}")
    "$PY" -m peagle_train.cli evaluate head="$(ck "$1" "$S")" baseline_head="$(ck "$2" "$S")" "more_heads=[$list]" \
        eval.benchmark=spec_bench eval.num_prompts=null eval.max_new_tokens=128 eval.num_speculative_tokens=5 \
        eval.batch_size=16 threads="${EVAL_THREADS:-2}" output_dir="$out" > "$out.log" 2>&1
}
ck() { echo "$OUT/$1/checkpoints/step_$(printf %06d "$2")"; }
for S in $BUDGETS; do
    arms=(base regen layers4 mask_std1 cod_r0.85 oov_mask "wsd@$S" "cosine@$S")
    [ "${TV:-1}" = 0 ] || arms+=(tv)
    group "$S" "${arms[@]}"
    group "$S" vocab16k vocab32k base   # the base again: Δτ against the base of the same run
done
stamp "5/5 training speed of ${SPEED_ARMS:=base layers4 cod_r0.85 tv vocab16k vocab32k}, each alone"
for a in $SPEED_ARMS; do
    [ -v "OVR[$a]" ] || { stamp "SPEED_ARMS: $a is not an arm of one factor (one of: ${!OVR[*]})"; exit 2; }
    log="$OUT/speed/$a/train_log.jsonl"
    [ -f "$log" ] && [ "$(grep -c '"tokens_per_second"' "$log")" -ge "${SPEED_STEPS:-40}" ] && continue
    rm -rf "$OUT/speed/$a"
    "$PY" -m peagle_train.cli train "${offline[@]}" ${OVR[$a]} threads="${EVAL_THREADS:-2}" eval.enabled=false \
        export.enabled=false training.schedule=constant training.warmup_steps=30 training.max_steps="${SPEED_STEPS:-40}" \
        training.max_minutes=null training.save_every=null training.val_conversations=0 output_dir="$OUT/speed/$a" \
        > "$OUT/speed-$a.log" 2>&1
    rm -rf "$OUT/speed/$a/checkpoint" "$OUT/speed/$a/checkpoints"  # only the log is read
done
stamp "done: python experiments/ablation_report.py run_dir=$OUT"
