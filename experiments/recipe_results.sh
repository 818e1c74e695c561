#!/usr/bin/env bash
# The per-benchmark evaluations of a recipe run's two heads (docs/RESULTS.md, "Which K should I
# serve with"; every row: experiments/ARCHIVE.md, "Recipe heads per benchmark"): target alone,
# P-EAGLE (RUN/peagle/checkpoint) and EAGLE-3 (RUN/eagle3/checkpoint) in one `peagle evaluate` per
# benchmark and K, greedy; then the tables (experiments/results_tables.py).
#
#   bash experiments/recipe_results.sh runs/smollm2          # every evaluation resumes after a kill
#   KS="3 5 7" BENCHES="mtbench humaneval specbench" bash experiments/recipe_results.sh runs/smollm2
#
# mtbench: the 80 MT-Bench first turns, 256 new tokens, batch 16 (K = 5 is the pipeline's own
# evaluation, RUN/eval-mtbench-k5); mtbench2: both turns of the 80 MT-Bench questions, 256 tokens,
# batch 16, K = 5 only; humaneval: the first 16 problems, 128 tokens, batch 16;
# specbench: 15 questions of Spec-Bench's other five categories, 128 tokens, batch 15;
# batch1: 16 MT-Bench first turns, 128 tokens, batch 1, one thread (latency and the batch-1 speedup).
set -euo pipefail
RUN=${1:?usage: recipe_results.sh RUN_DIR}
KS=${KS:-"3 5 7"}
BENCHES=${BENCHES:-"mtbench humaneval specbench batch1 mtbench2"}
PY=${PYTHON:-python}
heads=(head="$RUN/peagle/checkpoint" baseline_head="$RUN/eagle3/checkpoint" eval.plot=false)
for B in $BENCHES; do
    for K in $KS; do
        case $B in
            mtbench) args=(eval.benchmark=spec_bench eval.num_prompts=null eval.max_new_tokens=256 eval.batch_size=16) ;;
            mtbench2) [ "$K" = 5 ] || continue
                      args=(eval.benchmark=mt_bench eval.num_prompts=null eval.max_new_tokens=256 eval.batch_size=16) ;;
            humaneval) args=(eval.benchmark=humaneval eval.num_prompts=16 eval.max_new_tokens=128 eval.batch_size=16) ;;
            specbench) args=(eval.benchmark=spec_bench "eval.categories=[translation,summarization,qa,math_reasoning,rag]"
                             eval.num_prompts=15 eval.max_new_tokens=128 eval.batch_size=15) ;;
            batch1) [ "$K" = 5 ] || continue
                    args=(eval.benchmark=spec_bench eval.num_prompts=16 eval.max_new_tokens=128 eval.batch_size=1 threads=1) ;;
            *) echo "unknown benchmark $B (mtbench, mtbench2, humaneval, specbench, batch1)" >&2; exit 2 ;;
        esac
        echo "[$(date +%H:%M:%S)] $B K=$K" | tee -a "$RUN/results.log"
        "$PY" -m peagle_train.cli evaluate "${heads[@]}" "${args[@]}" eval.num_speculative_tokens="$K" \
            output_dir="$RUN/eval-$B-k$K" >> "$RUN/results.log" 2>&1
    done
done
"$PY" experiments/results_tables.py run_dir="$RUN"
