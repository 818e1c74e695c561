#!/usr/bin/env bash
# τ against training tokens for P-EAGLE and EAGLE-3 on SmolLM2-135M-Instruct (docs/SCALING.md).
#
#   bash experiments/scaling_curve.sh runs/scaling         # every step resumes after a kill
#   CONVS=4000 BUDGETS="64 128 256 512 1024" bash experiments/scaling_curve.sh runs/scaling
#   FEATURES=runs/ablations/features CONVS=1200 ALGORITHMS=peagle BUDGETS="48 96 192 384 768" SAVE_EVERY=48 \
#       bash experiments/scaling_curve.sh runs/curve      # P-EAGLE alone, on features written before
#
# 1. target features, once, of CONVS ShareGPT conversations (shuffled from all recovered records,
#    their own answers: no regeneration), so that no budget repeats a document (FEATURES: a
#    features directory of the same data settings, checked and reused);
# 2. one P-EAGLE and one EAGLE-3 run (ALGORITHMS) of the smollm2-135m recipe side by side (one thread each) on
#    those features, with a constant learning rate after warm-up, a checkpoint and a held-out
#    validation (EAL) every SAVE_EVERY steps, all checkpoints kept; the budgets are checkpoints of
#    these runs (a constant schedule makes each one a run stopped there);
# 3. each budget's pair of heads evaluated together as soon as both checkpoints exist: the 80
#    MT-Bench first turns of Spec-Bench, greedy, K=5, 256 new tokens, target alone + both heads
#    (one thread while a training runs, EVAL_THREADS after);
# 4. the table, plot and fit: experiments/scaling_report.py run_dir=OUT (writes docs/SCALING.md).
set -euo pipefail
OUT=${1:?usage: scaling_curve.sh OUTPUT_DIR}
CONVS=${CONVS:-4000}            # ≈ 2.2M tokens at max_length 640: one epoch covers the largest budget
BUDGETS=${BUDGETS:-"64 128 256 512 1024"}  # optimizer steps of ≈ 1,750 tokens each (16×)
SAVE_EVERY=${SAVE_EVERY:-64}
VAL=${VAL:-40}                  # held-out conversations (the same for both heads)
EPOCHS=${EPOCHS:-1}             # passes over the documents: budgets past one epoch repeat them
EVAL_THREADS=${EVAL_THREADS:-2}
PY=${PYTHON:-python}
FEATURES=${FEATURES:-$OUT/features}
read -r -a ALGOS <<< "${ALGORITHMS:-peagle eagle3}"  # peagle, and eagle3 beside it unless left out
LAST=${BUDGETS##* }
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/scaling.log"; }
data=(recipe=smollm2-135m data.path=pkg:sharegpt data.num_conversations="$CONVS")

stamp "1/4 target features of $CONVS ShareGPT conversations"
"$PY" -m peagle_train.cli features "${data[@]}" features.dir="$FEATURES" output_dir="$OUT/features-run" \
    > "$OUT/features.log" 2>&1

stamp "2/4 training ${ALGOS[*]} side by side to step $LAST (constant lr, checkpoint every $SAVE_EVERY)"
common=("${data[@]}" features.source=offline features.dir="$FEATURES" threads=1 eval.enabled=false
        training.schedule=constant training.warmup_steps=30 training.max_steps="$LAST" training.max_minutes=null
        training.epochs="$EPOCHS" training.save_every="$SAVE_EVERY" training.keep_last=null training.val_conversations="$VAL"
        training.resume=true)
pids=()
for A in "${ALGOS[@]}"; do
    "$PY" -m peagle_train.cli train "${common[@]}" algorithm="$A" output_dir="$OUT/$A" > "$OUT/$A.log" 2>&1 &
    pids+=($!)
done

alive() { local p n=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && n=$((n + 1)); done; echo $n; }
for S in $BUDGETS; do
    step=$(printf "step_%06d" "$S")
    have() { local A; for A in "${ALGOS[@]}"; do [ -d "$OUT/$A/checkpoints/$step" ] || return 1; done; }
    until have; do
        [ "$(alive)" -gt 0 ] || { stamp "a training ended before $step (past its $EPOCHS epoch(s)? EPOCHS=2 repeats the documents): see $OUT/<algorithm>.log"; exit 1; }
        sleep 20
    done
    # a third process beside two trainings would share their two cores: wait for one to end
    while [ "$(alive)" -gt 1 ]; do sleep 20; done
    threads=$([ "$(alive)" -gt 0 ] && echo 1 || echo "$EVAL_THREADS")
    stamp "3/4 evaluating $step (80 MT-Bench first turns, K=5, 256 tokens, $threads thread(s))"
    baseline=(); [ -d "$OUT/eagle3" ] && baseline=(baseline_head="$OUT/eagle3/checkpoints/$step")
    [ -f "$OUT/eval/$step/eval/acceptance.json" ] || \
    "$PY" -m peagle_train.cli evaluate head="$OUT/peagle/checkpoints/$step" "${baseline[@]}" \
        eval.benchmark=spec_bench eval.num_prompts=null eval.max_new_tokens=256 eval.num_speculative_tokens=5 \
        eval.batch_size=16 threads="$threads" output_dir="$OUT/eval/$step" > "$OUT/eval-$step.log" 2>&1
done
wait
stamp "4/4 report"
"$PY" experiments/scaling_report.py run_dir="$OUT" budgets="[${BUDGETS// /,}]" ${REPORT_ARGS:-}  # e.g. title="A second curve"
stamp "done: docs/SCALING.md"
