#!/usr/bin/env bash
# One device call (after staging), best on a fresh machine: two start timelines, each into an
# empty PTX folder (MLX compiles every kernel it uses) and then again finding it.
#  - the default config: the kernel choice and the compiled step's self-check before ready;
#  - kernels = "mlx": no kernel probe, so the compiled step's check runs after ready (what
#    "serve first" gives on a GPU today).
# Each run lists the modules MLX compiled with their times (bench/start_timeline.py).
#   bash bench/device/start_fresh_call.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/r"
s=$(date +%s)
timeout 290 python3 bench/start_timeline.py --ptx /tmp/ptx-default --json "$OUT/r/start_timeline_default.json" \
  > "$OUT/r/start_timeline_default.log" 2>&1
echo "default rc $? ($(( $(date +%s) - s )) s)"
s=$(date +%s)
timeout 290 python3 bench/start_timeline.py --ptx /tmp/ptx-mlx --config 'kernels = "mlx"' \
  --json "$OUT/r/start_timeline_mlx.json" > "$OUT/r/start_timeline_mlx.log" 2>&1
echo "mlx rc $? ($(( $(date +%s) - s )) s)"
grep -h -E "ready in" "$OUT"/r/start_timeline_*.log
