#!/usr/bin/env bash
# P-EAGLE per depth against speculators' trainer, seeds pooled, and our trainer with speculators' rule for which
# parameters train (docs/RESULTS.md, "Is our head as good as the reference trainer's at every depth?"):
#   bash experiments/parity_seeds.sh runs/parity-seeds        # every stage resumes after a kill
# Per seed S (training.seed: the head's init, the packing of rows and the COD draws; the conversations and their
# features are the same for every seed, made once in OUT/features):
#   OUT/sS      ours (the default: the mask token's embedding row and lm_head train) and speculators on the same rows;
#   OUT/VARIANT-sS  ours with each VARIANTS entry's keys, on the same rows as OUT/sS;
# then the table: each arm's seeds pooled on the same PROMPTS prompts, paired against speculators per depth.
set -euo pipefail
OUT=${1:?usage: parity_seeds.sh OUTPUT_DIR}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-165}
CONVS=${CONVS:-600}
PROMPTS=${PROMPTS:-80}
THREADS=${THREADS:-2}
PY=${PYTHON:-python}
# name:keys (comma-separated) of each variant of our trainer; "spec_params" trains what speculators trains
VARIANTS=${VARIANTS:-"spec_params:draft.train_embeddings=all,draft.train_lm_head=false"}
HERE=$(cd "$(dirname "$0")" && pwd)
BENCH=("$PY" "$HERE/../benchmarks/bench_parity.py" --shared-dir "$OUT" --algorithms peagle --steps "$STEPS"
       --num-prompts "$PROMPTS" --threads "$THREADS" --no-docs --set data.num_conversations="$CONVS")
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/parity_seeds.log"; }
arms=("speculators=speculators@" "ours=ours@")
for v in $VARIANTS; do arms+=("${v%%:*}=ours@"); done
for seed in $SEEDS; do
    stamp "seed $seed: ours and speculators"
    "${BENCH[@]}" --out-dir "$OUT/s$seed" --set training.seed="$seed" > "$OUT/s$seed.log" 2>&1
    arms[0]+="$OUT/s$seed,"; arms[1]+="$OUT/s$seed,"
    i=2
    for v in $VARIANTS; do
        name=${v%%:*}; keys=()
        IFS=, read -ra kv <<< "${v#*:}"
        for k in "${kv[@]}"; do keys+=(--set "$k"); done
        stamp "seed $seed: ours, $name"
        "${BENCH[@]}" --out-dir "$OUT/$name-s$seed" --trainers ours --set training.seed="$seed" "${keys[@]}" \
            > "$OUT/$name-s$seed.log" 2>&1
        arms[i]+="$OUT/$name-s$seed,"; i=$((i + 1))
    done
done
stamp "table"
args=(); for a in "${arms[@]}"; do args+=(--arm "${a%,}"); done
"$PY" "$HERE/../benchmarks/bench_parity.py" --out-dir "$OUT" --algorithms peagle --steps "$STEPS" "${args[@]}" "${@:2}"
