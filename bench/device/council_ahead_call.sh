#!/usr/bin/env bash
# One device call (after staging, .whl6 installed: the seats are the official openai client):
# the bundled model's council over HTTP in fast mode with the speculating batch's drafting
# cycles built ahead (build_ahead "auto": on, on CUDA) and without (build_ahead = false),
# daemons alternated A B A B ..., each its own new cache folder. What to read: each run's
# later rounds (round 0 compiles), and its status' batch_cycles (how many were built ahead and
# undone) in the JSON, and the PTX modules each compiled (ptx-*.txt). Results under $OUT/council_ahead (one tarball).
#   bash bench/device/council_ahead_call.sh          (SEATS=4 PAIRS=2 TURNS=3)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=/tmp/council_ahead
mkdir -p "$o"
for i in $(seq 1 ${PAIRS:-2}); do
  for arm in ahead off; do
    extra=""
    [ "$arm" = off ] && extra=$'[speculation]\nbuild_ahead = false'
    n=$arm-$i
    timeout ${RUN_LIMIT:-120} python3 bench/council_http.py --seats ${SEATS:-4} --turns ${TURNS:-3} --system-tokens 1000 \
      --max-tokens 64 --rounds 2 --arms fast --cache-dir /tmp/council-ahead-$n --config-extra "$extra" \
      --json "$o/$n.json" --markdown "$o/$n.md" > "$o/$n.log" 2>&1
    echo "$n rc $?"; sed -n '3,5p' "$o/$n.md"
    find /tmp/council-ahead-$n -path '*mlx-ptx*' -type f -printf '%TT %s %f\n' | sort > "$o/ptx-$n.txt"
    python3 -c "import json,sys; print('batch_cycles', json.load(open(sys.argv[1]))['arms']['fast']['councild'][-1]['batch_cycles'])" "$o/$n.json" 2>&1 | tail -1
  done
done
tar czf "${OUT:-/tmp/out}/council_ahead.tgz" -C "$o" .
