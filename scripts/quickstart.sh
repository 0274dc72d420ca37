#!/usr/bin/env bash
# The main job on the embedded defaults (SmolLM2-135M-Instruct + a ShareGPT slice):
#   1. prepare a small ShareGPT slice (tokenized with the target's chat template, assistant-only masks)
#   2. train 4 Medusa heads on the frozen target
#   3. evaluate the trained heads (and the zoo head, if present) on the held-out split, trees (with a prompt-lookup
#      branch) sized by tree=auto: τ, tokens/s and × plain decoding per column
# (python eval/acceptance.py drafter=medusa-init ... evaluates the untrained, identity-initialized heads for reference)
# Override anything Hydra-style through env vars, e.g. STEPS=50 bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/quickstart}
STEPS=${STEPS:-100}
MAXLEN=${MAXLEN:-256}             # tokens per training example (see below)
QUESTIONS=${QUESTIONS:-}          # an MT-bench-format file; empty = the held-out ShareGPT split
MAXQ=${MAXQ:-10}
NEW=${NEW:-128}
export WANDB_MODE=${WANDB_MODE:-offline}
QARG=(); [ -n "$QUESTIONS" ] && QARG=(questions="$QUESTIONS")

# Each example keeps its first $MAXLEN tokens (the slice's own limit is 512): the target forward, ~45% of a Medusa
# step, halves, and these are the tokens the evaluation decodes (the first 128 of an answer). On a 2-core EPYC
# (2026-12-07) 100 steps took 3.7 min against 7.3 at 512, for τ 1.91 against 2.00 on the same 10 questions.
DATA=(data=sharegpt_small data.max_length="$MAXLEN")
python data_prep/prepare.py "${DATA[@]}"
python train/medusa.py "${DATA[@]}" run_name=quickstart out_dir="$RUN" \
  train.max_steps="$STEPS" train.batch_size=4 head.share_lm_head=true optim.lr=2e-3 train.save_every=50 train.overwrite=true
# tree=auto sizes each tree (and its prompt-lookup branch) on 4 held-out calibration prompts of 32 tokens instead of
# the default 8 of 64: a quarter of the calibration time, so the quickstart stays short
EVAL=("${DATA[@]}" "${QARG[@]}" max_questions="$MAXQ" max_turns=1 max_new_tokens="$NEW"
      tree.calibration.questions=4 tree.calibration.max_new_tokens=32)
# the trained head also decodes plainly on the same questions: the table's plain column and × plain row
python eval/acceptance.py "${EVAL[@]}" drafter=medusa checkpoint="$RUN/final" compare_plain=true out="$RUN/eval-medusa.json"
RESULTS=("$RUN/eval-medusa.json")
ZOO=${ZOO:-zoo/smollm2-135m-instruct-eagle3}   # the published head, when the repo carries one: what a good head buys
if [ -d "$ZOO" ]; then
  python eval/acceptance.py "${EVAL[@]}" checkpoint="$ZOO" out="$RUN/eval-zoo.json"
  RESULTS+=("$RUN/eval-zoo.json")
fi
python scripts/compare.py "${RESULTS[@]}"
