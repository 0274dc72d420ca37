#!/usr/bin/env bash
# End-to-end check of the CUDA path in ~2 minutes on one GPU: every trainer (Medusa, EAGLE, EAGLE-3, block) for a few
# steps with held-out evals and checkpoints, an EAGLE-3 resume, then the measurement job in fp32 with all three
# heads (greedy identity vs plain decoding is checked and reported) and one sampled run with the exact rule; last, the
# distillation engine on the GPU: its fp32 greedy records against generate one prompt at a time (must be identical),
# then its bf16 throughput with refills merged and apart (scripts/bench_distill.py; embedded target only).
#   bash scripts/gpu_smoke.sh                                  # the embedded SmolLM2 target + a ShareGPT slice
#   bash scripts/gpu_smoke.sh target=hf target.name=/path/to/your/model   # any overrides go to every job
# Env: RUN (output folder), STEPS (optimizer steps per trainer), QUESTIONS (MT-bench-format file; empty = held-out
# split), DEVICE (cuda; cpu only to dry-run this script), DISTILL_N (conversations of the identity check, 12),
# BENCH_PROMPTS / BENCH_BATCH (the distillation benchmark's prompts and cache rows, 1024 / 256; 0 prompts skips it). The same jobs, run by hand with a random-weight
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
python train/block.py "${C[@]}" train.max_steps="$STEPS" out_dir="$RUN/block"
T=(); for a in "$@"; do case $a in target*) T+=("$a");; esac; done  # measure takes only the target overrides
python eval/measure.py "${T[@]}" target.dtype=fp32 data=sharegpt_small out_dir="$RUN/measure" "${QARG[@]}" \
  max_questions=2 max_turns=1 max_new_tokens=24 'methods=[plain,prompt_lookup]' \
  +heads.eagle3="$RUN/eagle3/final" +heads.eagle="$RUN/eagle/final" +heads.medusa="$RUN/medusa/final" \
  +heads.block="$RUN/block/final" \
  'temperatures=[0.7]' 'sweep.methods=[]' 'profile.widths=[1,8]' profile.repeats=1 warmup_tokens=2
grep -m1 "Fastest trained head" "$RUN/measure/report.md"
D=("${T[@]}" data=sharegpt_small target.dtype=fp32 device="$DEVICE" num_conversations="${DISTILL_N:-12}" max_new_tokens=24)
rm -rf "$RUN/distill"
python data_prep/distill.py "${D[@]}" engine=slots batch_size=8 out="$RUN/distill/slots.jsonl" > /dev/null
python data_prep/distill.py "${D[@]}" engine=hf batch_size=1 out="$RUN/distill/hf.jsonl" > /dev/null
python - "$RUN/distill" <<'PY'
import json, sys
read = lambda name: {r["id"]: r["messages"] for r in map(json.loads, open(f"{sys.argv[1]}/{name}.jsonl"))}
slots, hf = read("slots"), read("hf")
same = sum(slots.get(k) == v for k, v in hf.items())
print(f"distill: slot engine == generate one prompt at a time (fp32 greedy) on {same}/{len(hf)} conversations")
sys.exit(0 if same == len(hf) == len(slots) > 0 else 1)
PY
if [ "${BENCH_PROMPTS:-1024}" -gt 0 ] && [ ${#T[@]} -eq 0 ]; then
  python scripts/bench_distill.py --engines slots,slots-separate --device "$DEVICE" --prompts "${BENCH_PROMPTS:-1024}" \
    --new 256 --batch "${BENCH_BATCH:-256}" --no-ceiling --out "$RUN/distill/bench.json" | tail -1
fi
