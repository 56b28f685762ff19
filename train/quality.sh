#!/usr/bin/env bash
# The dense / NSA / NSA+backbone comparison on one GPU machine, resumable: each call does what is
# left within its time budget, then packs the results into one archive.
#
#   bash train/quality.sh            (from the repository root, on the GPU machine)
#
# 1. builds the Python extension with the CUDA backend into build-py/stage (scripts/py_stage.sh;
#    sm_90a only) unless it imports already;
# 2. trains each arm not yet complete (train/train.py --resume --time-limit: stops cleanly and
#    checkpoints before the budget ends; the next call continues it);
# 3. evaluates each complete arm that has no eval.json yet (train/evaluate.py);
# 4. once every arm is evaluated, draws the plots (train/plot.py) into $QUALITY_DIR/images;
# 5. after every stage, packs logs, meta, eval results and plots (not checkpoints) into $RESULTS.
#
# Environment:
#   QUALITY_DIR     run folders, one per arm (default out/quality; out/ is ignored by git)
#   QUALITY_BUDGET  seconds this call may take (default 540: a 600 s command with room to pack)
#   EVAL_RESERVE    seconds kept for evaluating one arm (default 150)
#   ARMS            default "dense nsa nsa_backbone"
#   TRAIN_ARGS      extra train/train.py flags for every arm, fixed at a run's start (e.g. "--steps 300")
#   EVAL_ARGS       extra train/evaluate.py flags (e.g. "--samples 20")
#   RESULTS         the archive (default ${OUT:-out}/quality.tgz)
#   PYTHON          default python3
#   QUALITY_BUILD   0: use the nsa that PYTHON imports as it is (no build; e.g. a CPU dry run)
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
QUALITY_DIR=${QUALITY_DIR:-out/quality}
BUDGET=${QUALITY_BUDGET:-540}
EVAL_RESERVE=${EVAL_RESERVE:-150}
ARMS=${ARMS:-dense nsa nsa_backbone}
TRAIN_ARGS=${TRAIN_ARGS:-}
EVAL_ARGS=${EVAL_ARGS:-}
RESULTS=${RESULTS:-${OUT:-out}/quality.tgz}
BUILD=${QUALITY_BUILD:-1}
export PYTHONUNBUFFERED=1
mkdir -p "$QUALITY_DIR" "$(dirname "$RESULTS")"

left() { echo $(( BUDGET - SECONDS )); }
pack() {  # logs, settings, evaluations and plots; checkpoints stay (hundreds of MB)
  local files
  files=$(cd "$QUALITY_DIR" && find . -type f \( -name log.jsonl -o -name meta.json -o -name eval.json \
          -o -name '*.log' -o -path './images/*' \) | sort)
  [[ -n $files ]] || return 0
  # shellcheck disable=SC2086
  (cd "$QUALITY_DIR" && tar -czf - $files) > "$RESULTS.tmp" && mv "$RESULTS.tmp" "$RESULTS"
}
complete() {  # the run in folder $1 has done all its steps
  "$PYTHON" -c "import json, sys; sys.exit(0 if json.load(open('$1/meta.json')).get('complete') else 1)" 2>/dev/null
}

echo "quality: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), budget ${BUDGET} s"
if [[ $BUILD != 0 ]]; then
  stage=$(PYTHON="$PYTHON" bash scripts/py_stage.sh | tail -1) || exit 1
  export PYTHONPATH="$stage${PYTHONPATH:+:$PYTHONPATH}"
fi

for arm in $ARMS; do
  dir="$QUALITY_DIR/$arm"
  complete "$dir" && continue
  limit=$(( $(left) - 15 ))
  if (( limit < 60 )); then echo "quality: no time left to train $arm"; break; fi
  # shellcheck disable=SC2086
  if ! "$PYTHON" train/train.py --arm "$arm" --out-dir "$dir" --resume --time-limit "$limit" --progress plain \
      --print-every 25 $TRAIN_ARGS 2>&1 | tee -a "$QUALITY_DIR/$arm-train.log"; then
    echo "quality: training $arm failed"; pack; exit 1
  fi
  pack
  complete "$dir" || break  # stopped by the budget (or failed): the next call continues this arm first
done

all_evaluated=1
for arm in $ARMS; do
  dir="$QUALITY_DIR/$arm"
  [[ -f "$dir/eval.json" ]] && continue
  all_evaluated=0
  complete "$dir" || continue
  if (( $(left) < EVAL_RESERVE )); then echo "quality: no time left to evaluate $arm"; continue; fi
  # shellcheck disable=SC2086
  timeout "$(( $(left) - 10 ))" "$PYTHON" train/evaluate.py "$dir" $EVAL_ARGS 2>&1 | tee "$QUALITY_DIR/$arm-eval.log"
  status=$?
  pack
  if (( status == 124 )); then echo "quality: evaluating $arm ran out of time"; break; fi
  if (( status != 0 )); then echo "quality: evaluating $arm failed"; exit 1; fi
done
if [[ $all_evaluated == 0 ]]; then  # some were evaluated just now
  all_evaluated=1
  for arm in $ARMS; do [[ -f "$QUALITY_DIR/$arm/eval.json" ]] || all_evaluated=0; done
fi

if [[ $all_evaluated == 1 ]]; then
  dirs=(); for arm in $ARMS; do dirs+=("$QUALITY_DIR/$arm"); done
  "$PYTHON" train/plot.py "${dirs[@]}" --out "$QUALITY_DIR/images" && cat "$QUALITY_DIR/images/summary.md"
  echo "quality: all arms trained and evaluated"
else
  echo "quality: not finished; run again to continue"
fi
pack
echo "quality: results in $RESULTS ($(( SECONDS )) s)"
