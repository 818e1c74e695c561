#!/usr/bin/env bash
# The fair regeneration test on SmolLM2-135M-Instruct (docs/RESULTS.md, "Should I regenerate the answers with the target?"):
#   bash experiments/regen_fair.sh runs/regen_fair          # every stage resumes after a kill
#   python experiments/regen_fair.py command=report run_dir=runs/regen_fair
# 1. the target answers CONVS ShareGPT conversations again through vLLM (every user turn up to TURNS,
#    on its own history; sampled at the temperature and top_p of SmolLM2's model card; answers cut at NEW
#    tokens dropped and counted, or kept with DROP_CUT=false);
# 2. the two arms at equal distinct tokens, the same prompts (regen_fair.py command=arms): `base` with
#    ShareGPT's answers, `regen` with the target's;
# 3. one P-EAGLE head per arm, the recipe's settings, the same STEPS optimizer steps of 2,048-token packed
#    rows (the arm repeats its rows as needed), features online, THREADS threads, one arm after the other;
# 4. both heads in one `peagle evaluate` per benchmark (one target-alone pass each): the 80 MT-Bench first
#    turns, and HE_PROMPTS HumanEval prompts, which share no prompt with training.
set -euo pipefail
OUT=${1:?usage: regen_fair.sh OUTPUT_DIR}
CONVS=${CONVS:-1200}
TURNS=${TURNS:-2}                    # user turns answered; rows are cut at 640 tokens, so later turns rarely train
NEW=${NEW:-512}                      # max_new_tokens per answer
DROP_CUT=${DROP_CUT:-true}           # false keeps an answer cut at NEW (rows are cut at 640 tokens anyway)
BATCH=${BATCH:-256}                  # conversations per vLLM call (a kill loses at most the batch in flight)
TEMPERATURE=${TEMPERATURE:-0.2}      # SmolLM2-135M-Instruct's model card: temperature 0.2, top_p 0.9
TOP_P=${TOP_P:-0.9}
STEPS=${STEPS:-240}
WARMUP=${WARMUP:-30}                 # warm-up steps (at most half of STEPS)
THREADS=${THREADS:-2}
HE_PROMPTS=${HE_PROMPTS:-80}
PY=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/regen_fair.log"; }

stamp "1/4 regenerating $CONVS conversations, up to $TURNS turns (vLLM, temperature $TEMPERATURE, top_p $TOP_P)"
"$PY" -m peagle_train.cli regenerate recipe=smollm2-135m regenerate.backend=vllm regenerate.max_turns="$TURNS" \
    regenerate.max_new_tokens="$NEW" regenerate.temperature="$TEMPERATURE" regenerate.top_p="$TOP_P" \
    regenerate.drop_cut="$DROP_CUT" regenerate.batch_size="$BATCH" \
    data.num_conversations="$CONVS" threads="$THREADS" output_dir="$OUT/regenerate" > "$OUT/regenerate.log" 2>&1
stamp "2/4 the two arms at equal distinct tokens"
[ -f "$OUT/arms/arms.json" ] || "$PY" "$HERE/regen_fair.py" command=arms regenerated="$OUT/regenerate/regenerated.jsonl" \
    out="$OUT/arms" > "$OUT/arms.log" 2>&1
step=$(printf %06d "$STEPS")
for arm in base regen; do
    file=orig; [ "$arm" = regen ] && file=regen
    stamp "3/4 training $arm ($STEPS steps)"
    [ -d "$OUT/$arm/checkpoints/step_$step" ] && continue
    "$PY" -m peagle_train.cli train recipe=smollm2-135m data.path="$OUT/arms/$file.jsonl" data.num_conversations=null \
        threads="$THREADS" eval.enabled=false export.enabled=false training.max_steps="$STEPS" training.epochs=20 \
        training.warmup_steps="$WARMUP" \
        training.max_minutes=null training.save_every="$STEPS" training.keep_last=null training.val_conversations=0 \
        training.resume=true output_dir="$OUT/$arm" > "$OUT/$arm.log" 2>&1
done
for bench in mt_bench humaneval; do
    out="$OUT/eval-$bench/base__regen/step_$step"
    stamp "4/4 evaluating both heads on $bench"
    [ -f "$out/eval/acceptance.json" ] && continue
    mkdir -p "$(dirname "$out")"
    if [ "$bench" = mt_bench ]; then prompts=(eval.benchmark=spec_bench eval.num_prompts=null)
    else prompts=(eval.benchmark=humaneval eval.num_prompts="$HE_PROMPTS"); fi
    "$PY" -m peagle_train.cli evaluate head="$OUT/base/checkpoints/step_$step" \
        baseline_head="$OUT/regen/checkpoints/step_$step" "${prompts[@]}" eval.max_new_tokens=128 \
        eval.num_speculative_tokens=5 eval.batch_size=16 threads="$THREADS" output_dir="$out" > "$out.log" 2>&1
done
stamp "done: python $HERE/regen_fair.py command=report run_dir=$OUT"
