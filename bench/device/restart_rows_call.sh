#!/usr/bin/env bash
# One device call (after staging, and the openai client's .whl6): a restart's first council round
# with the row limit its learned profile kept against the same restart without it (issue 46).
#  1. one council run on a new cache folder: it learns (costs, depths, and the row limit it
#     settled at, `rows` of learned-*.json);
#  2. PAIRS pairs of restarts, each on a fresh copy of that folder, alternated: "rows" as
#     written, "norows" with `rows` taken out of the learned file (the climb from 4, as before).
# Every run's round 0 is its first workload after start-up; first_round_ratio.py sets it
# against the run's later rounds. council_http.py salts each run's prompts anew.
#   PAIRS=2 bash bench/device/restart_rows_call.sh          (results in $OUT/rr.tgz; each run's daemon and front
#   logs under logs_<run>/)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}/rr
C=/tmp/rr-cache
rm -rf "$C"; mkdir -p "$o" "$C"
council() {  # name cache-folder
  local s=$(date +%s)
  timeout ${RUN_LIMIT:-150} python3 bench/council_http.py --seats ${SEATS:-8} --turns ${TURNS:-4} --system-tokens ${SYSTEM_TOKENS:-2000} --message-tokens 100 \
    --max-tokens ${MAX_TOKENS:-64} --rounds 2 --arms default --cache-dir "$2" --json "$o/$1.json" --logs "$o/logs_$1" > "$o/$1.log" 2>&1
  echo "$1 rc $? ($(( $(date +%s) - s )) s)"; grep -E "^round" "$o/$1.log"
}
council learn "$C/learn"
learned=$(ls "$C"/learn/councild/learned-*.json)
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("learned rows", d.get("rows"), "depths", d.get("depths"))' "$learned"
cp "$learned" "$o/learned.json"
for pair in $(seq 1 ${PAIRS:-2}); do
  order="rows norows"; [ $((pair % 2)) = 0 ] && order="norows rows"
  for arm in $order; do
    rm -rf "$C/$arm"; cp -r "$C/learn" "$C/$arm"
    [ $arm = norows ] && python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d.pop("rows",None); json.dump(d,open(p,"w"))' \
      $(ls "$C/$arm"/councild/learned-*.json)
    council "${arm}_$pair" "$C/$arm"
  done
done
python3 bench/first_round_ratio.py "$o"/*_*.json "$o/learn.json" --json "$o/first_round.json" | tee "$o/first_round.md"
# The device returns a few files a call: everything in one archive.
tar czf "$o.tgz" -C "$(dirname "$o")" "$(basename "$o")" && rm -rf "$o"
