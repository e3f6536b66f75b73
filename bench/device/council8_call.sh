#!/usr/bin/env bash
# One device call (after staging): the bundled model's council of 8 seats over HTTP with the
# daemon's default config (scheduler.max_active = "auto" since ec11456), default and fast
# modes against mlx_lm.server, rounds reported apart (issue 49's council goal, issue 46's
# first round). Results under $OUT/council8.
#   bash bench/device/council8_call.sh
# EXTRA: more TOML for the daemon's config, e.g. EXTRA='log_slow_iteration_s = 0.015' (each
# iteration of 15 ms or more logged with its prefilled tokens: how fast mode's prompts were paced).
# Its seats are the official openai client: install tools/stage_device.sh's .whl6 first (a call
# with carry [".whl6"]: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl6/*.whl).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}/council8
mkdir -p "$o"
s=$(date +%s)
timeout ${CALL_LIMIT:-560} python3 bench/council_http.py --seats 8 --turns ${TURNS:-4} --system-tokens 2000 \
    --message-tokens 100 --max-tokens 64 --rounds ${ROUNDS:-2} --arms ${ARMS:-default,fast,mlx_lm.server} --config-extra "${EXTRA:-}" \
    --json "$o/council_http_8seats.json" --markdown "$o/council_http_8seats.md" --logs "$o/logs" > "$o/council.log" 2>&1
echo "council rc $? ($(( $(date +%s) - s )) s)"
cat "$o/council_http_8seats.md" 2>/dev/null | head -40
python3 bench/daemon_timeline.py "$o/logs/daemon.log" --per-round $(( 8 * ${TURNS:-4} ))  # blocks of an arm's round
(cd "$o" && tar czf logs.tgz logs && rm -rf logs)
