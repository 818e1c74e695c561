#!/usr/bin/env bash
# DFlash's recipe options one at a time against the port it replaces, at equal steps, on SmolLM2-135M
# (docs/BENCHMARKS.md, "DFlash options one at a time"; the reading: docs/RESULTS.md):
#   bash experiments/dflash_options.sh runs/dflash-options        # trained arms are kept and skipped
# Every arm: the demo recipe's 300 ShareGPT conversations, STEPS steps of 1,024 tokens (online
# features), 64 anchors per row, lr 2e-3. The port: 3 target layers [2, 15, 27], block 6 (K 5),
# KL with equal slot weights, an 8,192-token draft vocabulary, embeddings trained. One option changed
# per arm; "paper" changes them all (5 layers, block 16, the target's frozen embedding and LM head
# over the full vocabulary, CE with exp-decayed slot weights). Then every head in one `peagle
# evaluate` run: PROMPTS MT-Bench first turns, K 5, TOKENS new tokens, the reference decoder.
set -euo pipefail
OUT=${1:?usage: dflash_options.sh OUTPUT_DIR}
STEPS=${STEPS:-64}
PROMPTS=${PROMPTS:-20}
TOKENS=${TOKENS:-64}
PY=${PYTHON:-python}
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/options.log"; }
base=(recipe=smollm2-135m-demo algorithm=dflash eval.enabled=false training.max_steps="$STEPS" training.max_minutes=null
      training.max_anchors=64)
port=(target.aux_layer_ids=[2,15,27] draft.num_depths=5 training.loss=kl training.slot_weights=uniform
      data.draft_vocab_size=8192 draft.train_embeddings=all draft.train_lm_head=true)
declare -A arm=(
  [port]=""
  [layers5]="target.aux_layer_ids=null"
  [ce-exp]="training.loss=ce training.slot_weights=exp_decay"
  [ce-dpace]="training.loss=ce training.slot_weights=dpace"
  [block16]="draft.num_depths=15"
  [frozen-full]="draft.train_embeddings=none draft.train_lm_head=false data.draft_vocab_size=49152"
  [paper]="target.aux_layer_ids=null draft.num_depths=15 draft.train_embeddings=none draft.train_lm_head=false data.draft_vocab_size=49152 training.loss=ce training.slot_weights=exp_decay"
)
order=(port layers5 ce-exp ce-dpace block16 frozen-full paper)
for a in "${order[@]}"; do
  [ -f "$OUT/$a/export/config.json" ] && continue
  stamp "train $a: ${arm[$a]}"
  # shellcheck disable=SC2086
  "$PY" -m peagle_train.cli train "${base[@]}" "${port[@]}" ${arm[$a]} output_dir="$OUT/$a" > "$OUT/$a.log" 2>&1
  grep -h "trained .* steps" "$OUT/$a/train.log" | tail -1 | tee -a "$OUT/options.log"
done
more=$(printf '%s,' "${order[@]:2}" | sed "s|\([^,]*\),|$OUT/\1/export,|g; s|,$||")
stamp "evaluate ${#order[@]} heads"
"$PY" -m peagle_train.cli evaluate head="$OUT/port/export" baseline_head="$OUT/layers5/export" \
    "more_heads=[$more]" eval.num_prompts="$PROMPTS" eval.max_new_tokens="$TOKENS" eval.num_speculative_tokens=5 \
    output_dir="$OUT/eval" > "$OUT/eval.log" 2>&1
stamp "done: $OUT/eval"
