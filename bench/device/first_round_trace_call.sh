#!/usr/bin/env bash
# One device call (after staging, .whl6 installed: the seats are the official openai client):
# a fresh daemon's first council round traced (issue 46). Three council runs, each its own new
# cache folder (no verdicts, no learned profile), default / fast / default, with
# `log_slow_iteration_s = 0.015`: every engine iteration of 15 ms or more logs
# `engine.slow_iteration` with its phases and shape, so round 0's iterations can be set beside
# the later rounds'; each run's PTX files are listed with their times (a module compiled
# during round 0 shows there). Results under $OUT/first_round_trace.
#   bash bench/device/first_round_trace_call.sh          (ARMS="default fast": other runs)
# Everything comes back as one archive, $OUT/$NAME.tar.gz (NAME: first_round_trace unless set;
# a call returns at most 8 files, and the runs' logs and PTX lists were more).
# EXTRA: more TOML for the daemons' config (top-level keys), e.g. EXTRA='warm_in_background = false'
# (every start-up part before ready: what round 0 gains when nothing is left to warm).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}/${NAME:-first_round_trace}
mkdir -p "$o"
for arm in ${ARMS:-default fast default}; do
  d=/tmp/first-round-$arm-$RANDOM; rm -rf "$d"; n=$(basename "$d")
  timeout 150 python3 bench/council_http.py --seats 4 --turns 3 --system-tokens 1000 --max-tokens 64 --rounds 2 --arms $arm \
    --cache-dir "$d" --config-extra "log_slow_iteration_s = 0.015${EXTRA:+
$EXTRA}" --json "$o/$n.json" --markdown "$o/$n.md" \
    --logs "$o/logs-$n" > "$o/$n.log" 2>&1
  echo "$n rc $?"; tail -3 "$o/$n.md"
  find "$d" -path '*mlx-ptx*' -type f -printf '%TT %s %f\n' | sort > "$o/ptx-$n.txt"
  python3 bench/daemon_timeline.py "$o/logs-$n/daemon.log" --until 30 > "$o/timeline-$n.txt" 2>&1
  python3 bench/daemon_timeline.py "$o/logs-$n/daemon.log" --per-round 12 | tee "$o/rounds-$n.txt"  # 4 seats x 3 turns
done
find "$o" -name daemon.log -exec gzip -f {} \;
tar czf "$o.tar.gz" -C "$(dirname "$o")" "$(basename "$o")" && rm -rf "$o"
