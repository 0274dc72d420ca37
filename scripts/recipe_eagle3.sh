#!/usr/bin/env bash
# The EAGLE-3 recipe in one command, every stage resumable (a rerun picks up where a killed run stopped):
#   1. distill  the target answers N training-split conversations (first turns by default; TURNS=all answers every
#               user turn on its own earlier answers) for at most DISTILL_MIN minutes; the held-out split and eval
#               files are never distilled
#   2. train    EAGLE-3 (+experiment=eagle3_full plus EAGLE3_ARGS) on that file, measuring τ with the real greedy loop
#               every TAU_EVERY steps on held-out prompts; best/ keeps the head with the highest τ
#   3. measure  best/ on the benchmark questions (first turns): fp32 greedy τ per category with EAGLE-3's default
#               tree and the head alone, and token identity with plain decoding (eval/acceptance.py; a fixed tree, so
#               τ does not depend on the host's timings); then tokens/s in the default dtype against plain decoding
#               and prompt lookup, trees (and the head's lookup branch) chosen by tree=auto (eval/measure.py)
#   4. publish  a Hub-layout folder (bf16 safetensors, config, model card with the τ table) in $RUN/hub
#   bash scripts/recipe_eagle3.sh                                        # embedded SmolLM2 + ShareGPT (~2 h on 2 AMX cores)
#   FAMILIES="eagle3 medusa eagle" bash scripts/recipe_eagle3.sh         # the other families on the same data, beside it
#   N=8000 STEPS=3000 bash scripts/recipe_eagle3.sh target=hf target.name=/path/to/model
# Env: RUN (output folder), N (conversations to distill; null = the whole training split), TURNS (first | all),
# DISTILL_MIN (minutes of distillation; null = no limit; 0 = train on DATA as it is; a distillation that finished
# writes $RUN/distill.done and a rerun trains on its file instead of distilling more: delete it to add data; a
# time-bounded one covers more conversations on a faster host, so pin N to recipe.json's count to repeat it), DISTILL_TOKENS (answer
# length), SOURCE (a conversations file instead of ShareGPT), DATA (the distilled JSONL; extended if short), STEPS,
# TAU_EVERY (steps between τ measurements), QUESTIONS (benchmark file, never trained on), MAXQ, NEW (tokens per
# answer), DISTILL_ARGS (space-separated data_prep/distill.py overrides, e.g. decode_attention=matmul), DISTILL_PROCS
# (distillation processes, default 1: with N > 1, torchrun runs N one-thread shards, or one per GPU; on a 2-core EPYC
# 2 with DISTILL_ARGS=batch_size=256 made 518 tok/s over 30 minutes, +23% over one process there (422); their files
# are merged into DATA when they finish; a DATA made by one process is not extended), FAMILIES
# (families trained, measured and reported side by side on the same data, steps and τ selection; the first one is
# published; default eagle3), EAGLE3_ARGS / MEDUSA_ARGS / EAGLE_ARGS (space-separated overrides for one family, as in
# scripts/compare_families.sh; EAGLE3_ARGS defaults to the recipe's 8k vocabulary and 4 TTT steps, its old name E3_ARGS
# still works; the others default to train.save_every=50), MEASURE (0 skips the tokens/s stage). A measurement newer than its head is
# not repeated by a rerun (delete its JSON to measure again). Overrides given as
# arguments go to every job; distill and measure take only the target* ones. A rerun with a different STEPS resumes
# the newest checkpoint on the new schedule. To publish into the repo's zoo/, copy $RUN/hub there when its τ beats
# the head already in zoo/.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/families.sh
RUN=${RUN:-runs/recipe-eagle3}
N=${N:-null}
TURNS=${TURNS:-first}
DISTILL_MIN=${DISTILL_MIN:-30}
DISTILL_TOKENS=${DISTILL_TOKENS:-256}
SOURCE=${SOURCE:-}
DATA=${DATA:-$RUN/distilled.jsonl}
STEPS=${STEPS:-500}
TAU_EVERY=${TAU_EVERY:-100}
EAGLE3_ARGS=${EAGLE3_ARGS-${E3_ARGS-head.draft_vocab_size=8192 head.draft_vocab_reference=sharegpt head.ttt_steps=4 train.save_every=50}}
read -r -a DX <<< "${DISTILL_ARGS:-}"
MEASURE=${MEASURE:-1}
DISTILL_PROCS=${DISTILL_PROCS:-1}
[[ "$DISTILL_PROCS" =~ ^[1-9][0-9]*$ ]] || { echo "DISTILL_PROCS must be a whole number >= 1, got '$DISTILL_PROCS'" >&2; exit 2; }
read -r -a FAM <<< "${FAMILIES:-eagle3}"
check_families "${FAM[@]}"
QUESTIONS=${QUESTIONS:-../shared/data/mt_bench.jsonl}
MAXQ=${MAXQ:-80}
NEW=${NEW:-128}
export WANDB_MODE=${WANDB_MODE:-offline}
T=(); for a in "$@"; do case $a in target*) T+=("$a");; esac; done
stage() { printf '\n== %s  (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
SECONDS=0

stage "1/4 distill $N conversations, turns=$TURNS, at most $DISTILL_MIN minutes"
S=(); [ -n "$SOURCE" ] && S=(data=file data.path="$SOURCE")
if [ "$DISTILL_MIN" = 0 ]; then
  echo "DISTILL_MIN=0: training on $DATA as it is ($(wc -l < "$DATA") conversations)"
elif [ -f "$RUN/distill.done" ]; then
  echo "distillation finished earlier ($(wc -l < "$DATA") conversations in $DATA); delete $RUN/distill.done to distill more"
else
  D=(data_prep/distill.py "${T[@]}" "${S[@]}" num_conversations="$N" turns="$TURNS"
     max_new_tokens="$DISTILL_TOKENS" max_minutes="$DISTILL_MIN" out="$DATA" "${DX[@]}")
  if [ "$DISTILL_PROCS" -gt 1 ]; then
    # distill.py refuses this too, but from every rank inside torchrun's report: refuse once, before it starts
    python - "$DATA" "$DISTILL_PROCS" <<'PY' || exit 2
import sys
from pathlib import Path
from draftheads.data_prep.distill import check_shard_out
try:
    check_shard_out(Path(sys.argv[1]), int(sys.argv[2]))
except ValueError as e:
    sys.exit(f"error: DISTILL_PROCS={sys.argv[2]}: {e} (in the recipe: DISTILL_PROCS=1, or another DATA)")
PY
    torchrun --standalone --nproc_per_node "$DISTILL_PROCS" "${D[@]}"
    python -m draftheads.data_prep.distill_merge "$DATA" "$DISTILL_PROCS"
  else
    python "${D[@]}"
  fi
  mkdir -p "$RUN" && date -u +%FT%TZ > "$RUN/distill.done"  # a rerun after a later stage was killed must not distill another $DISTILL_MIN minutes
fi
t1=$SECONDS

stage "2/4 train ${FAM[*]} for $STEPS steps each, τ every $TAU_EVERY"
declare -A HEADS TRAIN_S
for F in "${FAM[@]}"; do
  t=$SECONDS
  read -r -a FX <<< "$(family_args "$F" train.save_every=50)"  # ${F^^}_ARGS, else this
  python "train/$F.py" "+experiment=${F}_full" data.path="$DATA" data.name="$(basename "$DATA" .jsonl)" \
    train.max_steps="$STEPS" train.tau_eval.every="$TAU_EVERY" train.resume=true "$@" "${FX[@]}" \
    out_dir="$RUN/$F" hydra.run.dir="$RUN/$F"
  HEADS[$F]="$RUN/$F/best"; [ -d "${HEADS[$F]}" ] || HEADS[$F]="$RUN/$F/final"
  TRAIN_S[$F]=$((SECONDS - t))
done
HEAD=${HEADS[${FAM[0]}]}
t2=$SECONDS

stage "3/4 measure ${FAM[*]} on $(basename "$QUESTIONS") ($MAXQ questions, first turns, $NEW tokens, fp32 greedy)"
fresh() { [ -f "$1" ] && [ "$1" -nt "$2/model.safetensors" ]; }  # a measurement newer than the head's weights
bench_of() { if [ "$1" = "${FAM[0]}" ]; then echo "$RUN/benchmark.json"; else echo "$RUN/benchmark-$1.json"; fi; }
for F in "${FAM[@]}"; do
  if fresh "$(bench_of "$F")" "${HEADS[$F]}"; then echo "$F measured earlier: $(bench_of "$F")"; continue; fi
  python eval/acceptance.py "${T[@]}" target.dtype=fp32 checkpoint="${HEADS[$F]}" questions="$QUESTIONS" \
    max_questions="$MAXQ" max_turns=1 max_new_tokens="$NEW" compare_plain=true tree.select=default tree.lookup_branch=0 \
    out="$(bench_of "$F")"
done
if [ "$MEASURE" = 1 ]; then
  H=(); stale=0
  for F in "${FAM[@]}"; do H+=("+heads.$F=${HEADS[$F]}"); fresh "$RUN/measure/results.json" "${HEADS[$F]}" || stale=1; done
  if [ "$stale" = 0 ]; then echo "tokens/s measured earlier: $RUN/measure/results.json"; else
    python eval/measure.py "${T[@]}" "${H[@]}" questions="$QUESTIONS" max_questions="$MAXQ" max_turns=1 \
      max_new_tokens="$NEW" "methods=[plain,prompt_lookup]" "temperatures=[]" "sweep.methods=[]" out_dir="$RUN/measure"
  fi
fi
t3=$SECONDS

stage "4/4 publish to $RUN/hub"
python scripts/publish.py checkpoint="$HEAD" run_dir="$RUN/${FAM[0]}" out="$RUN/hub" overwrite=true "eval=[$RUN/benchmark.json]" \
  dtype=bf16 "made_by='RUN=$RUN N=$N TURNS=$TURNS DISTILL_MIN=$DISTILL_MIN STEPS=$STEPS DISTILL_ARGS=\"${DISTILL_ARGS:-}\" EAGLE3_ARGS=\"$EAGLE3_ARGS\" FAMILIES=\"${FAM[*]}\" bash scripts/recipe_eagle3.sh $*'"
FS=(); for F in "${FAM[@]}"; do FS+=("$F" "${HEADS[$F]}" "${TRAIN_S[$F]}" "$(bench_of "$F")"); done  # four per family
python - "$RUN" "$DATA" "$HEAD" "$t1" "$t2" "$t3" "$SECONDS" "${FS[@]}" <<'PY'
import json, sys
from pathlib import Path
run, data, head, *rest = sys.argv[1:]
t = [int(x) for x in rest[:4]]
families = list(zip(*[iter(rest[4:])] * 4))  # (family, head, this run's train-stage seconds, benchmark JSON)
res = json.loads((Path(run) / "benchmark.json").read_text())
times = {"distill_s": t[0], "train_s": t[1] - t[0], "measure_s": t[2] - t[1], "publish_s": t[3] - t[2], "total_s": t[3]}
out = {"tau": res["summary"]["tau"], "speedup_vs_plain_fp32": res.get("speedup_vs_plain"),
       "greedy_identical": res["greedy_identical"]["identical"], "turns": res["greedy_identical"]["turns"], **times}
# what the head was made from: a time-bounded distillation covers more conversations on a faster host, so a rerun
# that should match pins N to this count
with open(data) as f:
    out["data"] = {"path": data, "conversations": sum(1 for line in f if line.strip())}
ds = Path(data + ".summary.json")
if ds.is_file():
    d = json.loads(ds.read_text())
    out["data"]["last_distill_job"] = {k: d.get(k) for k in ("written", "new_tokens", "seconds", "tokens_per_s", "dtype", "threads")}
    # the decode kernel decides which bf16 answers a rerun writes (decode_attention=matmul repeats a file made before it)
    out["data"]["last_distill_job"]["decode_attention"] = d.get("engine_stats", {}).get("decode_attention")

def summary(fam: str) -> dict:
    ts = Path(run) / fam / "summary.json"
    return json.loads(ts.read_text()) if ts.is_file() else {}


def tau_best(fam: str):
    return summary(fam).get("tau_best")


out["train"] = {"head": head, "tau_best": tau_best(families[0][0])}
out["families"] = {}  # every family on the same data and steps: fp32 greedy τ with its default tree, head alone
for fam, fhead, train_s, bench in families:
    b = json.loads(Path(bench).read_text())
    s = summary(fam)  # the trainer's own time: train_s is ~0 when this invocation found the family finished earlier
    out["families"][fam] = {"head": fhead, "train_s": int(train_s), "trained_s": s.get("seconds"),
                            "resumed_from_step": s.get("resumed_from_step"), "tau_best": tau_best(fam), "benchmark": bench,
                            "tau": b["summary"]["tau"], "per_category": {k: v["tau"] for k, v in b["summary"]["per_category"].items()},
                            "greedy_identical": b["greedy_identical"]["identical"], "turns": b["greedy_identical"]["turns"]}
m = Path(run) / "measure" / "results.json"
if m.is_file():
    r = json.loads(m.read_text())
    g = next(b for b in r["settings"].values() if b["mode"] == "greedy")
    out["measure_dtype"] = r["dtype"]
    out["speedup_vs_plain"] = {k: v["overall"] for k, v in g["speedup_vs_plain"].items()}
    out["tau_measure"] = {k: v["tau"] for k, v in g["methods"].items()}
    out["tree_choice"] = r.get("tree_choice")
(Path(run) / "recipe.json").write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps(out))
PY
echo "head: $RUN/hub  (recipe.json has τ and every stage's time)"
