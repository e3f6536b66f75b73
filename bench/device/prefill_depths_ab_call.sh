#!/usr/bin/env bash
# One device call (after staging, .whl6 installed: the seats are the official openai client):
# what the prefill_depths start-up part (warm_prefill_depths, a37119f) gains a fresh daemon's
# first council round (issue 46). PAIRS pairs of fresh daemons (each its own new cache folder),
# the part on (the default) and off alternated, every part before ready
# (`warm_in_background = false`: round 0 then meets nothing left to warm, so the pair's
# difference is the part's); then, unless BG=0, one pair with the default background warm-up.
# Each run is bench/device/first_round_trace_call.sh's (round 0 apart, slow iterations >= 15 ms
# logged); each comes back as $OUT/<name>.tar.gz (at most 8 files a call: PAIRS <= 3 with BG).
#   PAIRS=2 bash bench/device/prefill_depths_ab_call.sh
here=$(dirname "$0")
run() {  # name, extra TOML
  NAME=$1 ARMS=default EXTRA=$2 bash "$here/first_round_trace_call.sh" | tail -2 | sed "s/^/$1 /"
}
for i in $(seq 1 "${PAIRS:-2}"); do
  run "depths_on_$i" 'warm_in_background = false'
  run "depths_off_$i" $'warm_in_background = false\nwarm_prefill_depths = "off"'
done
if [ "${BG:-1}" != 0 ]; then
  run depths_on_bg ''
  run depths_off_bg 'warm_prefill_depths = "off"'
fi
