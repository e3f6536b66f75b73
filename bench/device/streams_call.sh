#!/usr/bin/env bash
# One device call (after staging): the bundled model over HTTP at 1, 4 and 8 concurrent
# streams, councild (its HTTP front and the ZeroMQ client) against mlx_lm.server, arms rotated
# every round (issue 49's goal: 4 streams >= 2.5x one stream). The daemon's log comes back
# too, with its governor decisions (depth and height by load) pulled out beside it.
#   bash bench/device/streams_call.sh            (ROUNDS, TOKENS, STREAMS, CALL_LIMIT: env)
# Everything comes back as one archive, $OUT/streams.tar.gz (a call returns at most 8 files; a
# second run in the same call with its own OUT=$OUT/NAME makes its own).
# VARIANT='NAME=TOML' adds a second daemon with that config as an arm "http NAME" (e.g.
# VARIANT='lookup=[speculation]\nbatch_lookup = true'); MLX=" " leaves mlx_lm.server out.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}/streams
mkdir -p "$o"
s=$(date +%s)
before=$(ls -d /tmp/http-bench-* 2>/dev/null)
timeout ${CALL_LIMIT:-400} python3 bench/http_bench.py --streams ${STREAMS:-1,4,8} --tokens ${TOKENS:-64} \
    --rounds ${ROUNDS:-6} ${VARIANT:+--variant "$VARIANT"} ${MLX:---mlx-server} --json "$o/http_streams.json" --markdown "$o/http_streams.md" > "$o/http.log" 2>&1
echo "http_bench rc $? ($(( $(date +%s) - s )) s)"
cat "$o/http_streams.md" 2>/dev/null
for d in $(ls -d /tmp/http-bench-* 2>/dev/null); do
  case " $before " in *" $d "*) continue;; esac
  cp "$d/daemon.log" "$o/daemon.log" 2>/dev/null
  grep '"governor.decision"' "$d/daemon.log" | tail -40 > "$o/governor_decisions.jsonl"
  for v in "$d"/variant-*; do [ -f "$v/daemon.log" ] && gzip -c "$v/daemon.log" > "$o/daemon-$(basename "$v").log.gz"; done
done
wc -l "$o"/governor_decisions.jsonl 2>/dev/null
gzip -f "$o/daemon.log" 2>/dev/null
tar czf "$o.tar.gz" -C "$(dirname "$o")" "$(basename "$o")" && rm -rf "$o"
