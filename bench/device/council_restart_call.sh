#!/usr/bin/env bash
# One device call (after staging): the council benchmark twice on one cache folder, so the
# second run's round 0 is a restart's first round (probe verdicts and the governor's learned
# profile from the first run found), against the rounds after it.
#   bash bench/device/council_restart_call.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/r"
C=/tmp/council-cache; rm -rf $C
for run in 1 2; do
  s=$(date +%s)
  timeout 200 python3 bench/council_http.py --seats 4 --turns 3 --system-tokens 1000 --max-tokens 64 --rounds 2 \
    --arms default,fast --cache-dir $C --json "$OUT/r/council_restart$run.json" --markdown "$OUT/r/council_restart$run.md" \
    > "$OUT/r/council_restart$run.log" 2>&1
  echo "run $run rc $? ($(( $(date +%s) - s )) s)"; cat "$OUT/r/council_restart$run.md" 2>/dev/null | head -30
done
ls $C
