#!/usr/bin/env bash
# The main job on the embedded defaults (SmolLM2-135M-Instruct + a ShareGPT slice): 19.7 min measured on one
# core (OMP_NUM_THREADS=1, default MAXQ=10, the other core busy):
#   1. prepare a small ShareGPT slice (tokenized with the target's chat template, assistant-only masks)
#   2. train 4 Medusa heads on the frozen target
#   3. evaluate untrained (identity-initialized) and trained heads on the held-out split: τ tables
# Override anything Hydra-style through env vars, e.g. STEPS=50 bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/quickstart}
STEPS=${STEPS:-100}
QUESTIONS=${QUESTIONS:-}          # an MT-bench-format file; empty = the held-out ShareGPT split
MAXQ=${MAXQ:-10}
NEW=${NEW:-128}
export WANDB_MODE=${WANDB_MODE:-offline}
QARG=(); [ -n "$QUESTIONS" ] && QARG=(questions="$QUESTIONS")

python data_prep/prepare.py data=sharegpt_small
python train/medusa.py data=sharegpt_small run_name=quickstart out_dir="$RUN" \
  train.max_steps="$STEPS" train.batch_size=4 head.share_lm_head=true optim.lr=2e-3 train.save_every=50
for d in medusa-init medusa; do
  python eval/acceptance.py data=sharegpt_small drafter=$d checkpoint="$RUN/final" "${QARG[@]}" \
    max_questions="$MAXQ" max_turns=1 max_new_tokens="$NEW" tree.size=64 out="$RUN/eval-$d.json"
done
python scripts/compare.py "$RUN/eval-medusa-init.json" "$RUN/eval-medusa.json"
