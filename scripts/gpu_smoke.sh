#!/usr/bin/env bash
# End-to-end check of the CUDA path in ~2 minutes on one GPU: every trainer (Medusa, EAGLE, EAGLE-3) for a few
# steps with held-out evals and checkpoints, an EAGLE-3 resume, then the measurement job in fp32 with all three
# heads (greedy identity vs plain decoding is checked and reported) and one sampled run with the exact rule.
#   bash scripts/gpu_smoke.sh                                  # the embedded SmolLM2 target + a ShareGPT slice
#   bash scripts/gpu_smoke.sh target=hf target.name=/path/to/your/model   # any overrides go to every job
# Env: RUN (output folder), STEPS (optimizer steps per trainer), QUESTIONS (MT-bench-format file; empty = held-out
# split), DEVICE (cuda; cpu only to dry-run this script). The same jobs, run by hand with a random-weight
# SmolLM2-shaped target on D1, passed on an H200 (greedy identical 2/2); then the real recipe trained there.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/gpu-smoke}
STEPS=${STEPS:-20}
QUESTIONS=${QUESTIONS:-}
DEVICE=${DEVICE:-cuda}
[ "$DEVICE" = cpu ] || python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_smoke.sh: torch sees no CUDA device')"
QARG=(); [ -n "$QUESTIONS" ] && QARG=(questions="$QUESTIONS")
C=(data=sharegpt_small logging.wandb=disabled train.device=$DEVICE train.save_every=$((STEPS / 2))
   train.eval_every=$((STEPS / 2)) train.eval_tokens=2000 train.sim_tau_examples=2 "$@")
python train/eagle3.py "${C[@]}" head.draft_vocab_size=8192 train.max_steps=$((STEPS / 2)) out_dir="$RUN/eagle3" & p1=$!
python train/eagle.py "${C[@]}" train.max_steps="$STEPS" out_dir="$RUN/eagle" & p2=$!
python train/medusa.py "${C[@]}" train.max_steps="$STEPS" out_dir="$RUN/medusa" & p3=$!
wait $p1; wait $p2; wait $p3  # set -e: any failed trainer stops the script
python train/eagle3.py "${C[@]}" head.draft_vocab_size=8192 train.max_steps="$STEPS" train.resume=true out_dir="$RUN/eagle3"
T=(); for a in "$@"; do case $a in target*) T+=("$a");; esac; done  # measure takes only the target overrides
python eval/measure.py "${T[@]}" target.dtype=fp32 data=sharegpt_small out_dir="$RUN/measure" "${QARG[@]}" \
  max_questions=2 max_turns=1 max_new_tokens=24 'methods=[plain,prompt_lookup]' \
  +heads.eagle3="$RUN/eagle3/final" +heads.eagle="$RUN/eagle/final" +heads.medusa="$RUN/medusa/final" \
  'temperatures=[0.7]' 'sweep.methods=[]' 'profile.widths=[1,8]' profile.repeats=1 warmup_tokens=2
grep -m1 "Fastest trained head" "$RUN/measure/report.md"
