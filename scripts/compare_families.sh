#!/usr/bin/env bash
# Which draft family suits this target? Every registered family (Medusa, EAGLE, EAGLE-3, the block draft) on the same
# self-distilled data with the same budget, then one measurement of all of them (greedy, fp32: token identity vs plain
# is checked) whose report has a head-to-head table: target forwards per pair with a paired-bootstrap 95% interval
# and a verdict.
#   bash scripts/compare_families.sh                                      # embedded SmolLM2 + ShareGPT, D1 recipe
#   bash scripts/compare_families.sh target=hf target.name=/path/to/model # overrides go to every job
#   QUESTIONS=../shared/data/mt_bench.jsonl MAXQ=80 bash scripts/compare_families.sh
#   FAMILIES="eagle3 block" bash scripts/compare_families.sh              # a subset, in this order
# Env: RUN (output folder), N (conversations to distill), SOURCE (a conversations file whose user turns are the
# prompts; empty = the embedded ShareGPT), DISTILL_TOKENS (answer length), DATA (the distilled JSONL; made if
# missing, extended if short, so a rerun resumes, and so do the trainers), STEPS (optimizer steps per family, global batch 8),
# FAMILIES (space-separated; default every family in heads/registry.py that has train/<family>.py and
# conf/experiment/<family>_full.yaml), DV (EAGLE-3 draft vocabulary; empty = min(32000, V)), VOCAB_REF (corpus that
# votes on that vocabulary with the training split: sharegpt, a conversations file, or empty for the training split
# alone), QUESTIONS (MT-bench-format file; empty = the distilled data's held-out split), MAXQ,
# NEW (tokens per answer), PARALLEL (1: the trainers share the device at once; default on CUDA only),
# <FAMILY>_ARGS, e.g. MEDUSA_ARGS / EAGLE_ARGS / EAGLE3_ARGS / BLOCK_ARGS (space-separated overrides for one family,
# e.g. EAGLE3_ARGS="head.ttt_decay=0.35"; DV and VOCAB_REF are added to EAGLE3_ARGS).
# Cost: on an H200 the defaults take minutes; on a 2-core CPU, hours (docs/experiments/ has per-run times).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/families.sh
RUN=${RUN:-runs/compare}
N=${N:-1200}
SOURCE=${SOURCE:-}
DISTILL_TOKENS=${DISTILL_TOKENS:-320}
DATA=${DATA:-$RUN/distilled.jsonl}
STEPS=${STEPS:-450}
DV=${DV-}
VOCAB_REF=${VOCAB_REF-sharegpt}
QUESTIONS=${QUESTIONS:-}
MAXQ=${MAXQ:-80}
NEW=${NEW:-32}
PARALLEL=${PARALLEL:-$(python -c "import torch; print(int(torch.cuda.is_available()))")}
export WANDB_MODE=${WANDB_MODE:-offline}
T=(); for a in "$@"; do case $a in target*) T+=("$a");; esac; done  # distill takes only these
DX=(); for a in "$@"; do case $a in data.*) DX+=("$a");; esac; done  # measure also reads the distilled data's
# held-out split (the default questions, and tree=auto's calibration prompts): prepared as the trainers prepared it

[ -n "${FAMILIES:-}" ] || FAMILIES=$(registered_families)
read -r -a FAM <<< "$FAMILIES"
check_families "${FAM[@]}"  # before any work: an unknown family is one line and exit 2

# 1. the target's own answers (resumable: a rerun skips what DATA already holds)
S=(); [ -n "$SOURCE" ] && S=(data=file data.path="$SOURCE")
python data_prep/distill.py "${T[@]}" "${S[@]}" num_conversations="$N" max_new_tokens="$DISTILL_TOKENS" \
  max_prompt_tokens=512 batch_size=32 out="$DATA"  # Hydra logs: $DATA.hydra

# 2. the families, one data file, one budget
D=(data.path="$DATA" data.name="$(basename "$DATA" .jsonl)")
EAGLE3_ARGS="${EAGLE3_ARGS:-}"
[ -n "$DV" ] && EAGLE3_ARGS="head.draft_vocab_size=$DV $EAGLE3_ARGS"
[ -n "$VOCAB_REF" ] && EAGLE3_ARGS="head.draft_vocab_reference=$VOCAB_REF $EAGLE3_ARGS"
train() {  # train FAMILY: its +experiment recipe, the shared overrides, then ${FAMILY}_ARGS
  local fx
  read -r -a fx <<< "$(family_args "$1")"
  python "train/$1.py" "+experiment=$1_full" "${D[@]}" train.max_steps="$STEPS" train.resume=true "${ARGS[@]}" \
    "${fx[@]}" out_dir="$RUN/$1" hydra.run.dir="$RUN/$1"
}
ARGS=("$@")
if [ "$PARALLEL" = 1 ]; then
  P=(); for F in "${FAM[@]}"; do train "$F" & P+=($!); done
  for p in "${P[@]}"; do wait "$p"; done  # set -e: a failed trainer stops the script
else
  for F in "${FAM[@]}"; do train "$F"; done
fi

# 3. one measurement of all of them, same questions, same target, fp32 greedy
Q=(data=distilled "${D[@]}")
H=(); for F in "${FAM[@]}"; do H+=("+heads.$F=$RUN/$F/final"); done
[ -n "$QUESTIONS" ] && Q+=(questions="$QUESTIONS")
python eval/measure.py "${T[@]}" target.dtype=fp32 "${Q[@]}" "${DX[@]}" out_dir="$RUN/measure" max_questions="$MAXQ" max_turns=1 \
  max_new_tokens="$NEW" 'methods=[plain]' 'temperatures=[]' 'sweep.methods=[]' \
  "${H[@]}"
echo "report: $RUN/measure/report.md"
