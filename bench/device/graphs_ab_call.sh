#!/usr/bin/env bash
# One device call (after staging, .whl6 installed: the seats are the official openai client):
# MLX's CUDA graphs on and off for the whole daemon (MLX_USE_CUDA_GRAPHS, read once per
# process; an operator's environment wins over the daemon's own switches). Why: on an H100 a
# bundled-model prefill forward of a repeated length cost 11.85 ms with graphs and 7.14 without
# (bench/probes/prefill_length_first_use.py, results/h100_2026-12-07e), while the decode steps
# measured earlier moved within their spread. Runs alternate on / off, PAIRS times: a 4-seat
# council over HTTP (default and fast arms, 2 rounds after round 0; one cache folder for all, so
# only the first run compiles MLX's modules), then bench/new_length_ttft.py with graphs off
# (NL_GRAPHS="1 0": on, then off; PAIRS=0: no council). Results under $OUT/graphs_ab.
#   PAIRS=2 NL_GRAPHS= bash bench/device/graphs_ab_call.sh; PAIRS=0 NL_GRAPHS="1 0" bash bench/device/graphs_ab_call.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}/graphs_ab
mkdir -p "$o"
cache=/tmp/graphs-ab-cache
for p in $(seq 1 "${PAIRS:-2}"); do
  for g in 1 0; do
    s=$(date +%s)
    MLX_USE_CUDA_GRAPHS=$g timeout 200 python3 bench/council_http.py --seats 4 --turns 3 --system-tokens 1000 \
      --max-tokens 64 --rounds 2 --arms default,fast --cache-dir "$cache" \
      --json "$o/council-graphs$g-pair$p.json" --markdown "$o/council-graphs$g-pair$p.md" > "$o/council-graphs$g-pair$p.log" 2>&1
    echo "graphs=$g pair $p rc $? ($(( $(date +%s) - s )) s)"
  done
done
python3 - "$o" <<'PY'
import glob, json, statistics, sys
rows = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/council-graphs*-pair*.json")):
    g = f.rsplit("council-graphs", 1)[1][0]
    d = json.load(open(f))
    for arm, r in d.get("arms", {}).items():
        for key in ("tok_s", "ttft_p50", "ttft_p95"):
            rows.setdefault((arm, key, g), []).append(r[key]["median"])
print("| arm | what | graphs on (runs) | graphs off (runs) | off / on |")
print("|---|---|---|---|---|")
for arm, key in sorted({(a, k) for a, k, _ in rows}):
    on, off = rows.get((arm, key, "1"), []), rows.get((arm, key, "0"), [])
    if on and off:
        print(f"| {arm} | {key} | {[round(x, 3) for x in on]} | {[round(x, 3) for x in off]} | "
              f"{statistics.median(off) / statistics.median(on):.2f}x |")
PY
for g in ${NL_GRAPHS-0}; do
  MLX_USE_CUDA_GRAPHS=$g timeout 240 python3 bench/new_length_ttft.py --requests 24 --json "$o/new_length_ttft_graphs$g.json" \
    --markdown "$o/new_length_ttft_graphs$g.md" > "$o/new_length_ttft_graphs$g.log" 2>&1
  echo "new_length_ttft graphs=$g rc $?"; tail -5 "$o/new_length_ttft_graphs$g.md"
done
