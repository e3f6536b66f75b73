#!/usr/bin/env bash
# One device call (after staging): two start timelines, each into an empty PTX folder (MLX
# compiles every kernel it uses, as on a fresh machine) and then again finding it: the default
# config (the fused GatedDeltaNet recurrence on CUDA) and gdn_kernel = "off" (mlx-lm's ops and
# their compiled gate kernels). Each run lists the modules MLX compiled, with their times.
#   bash bench/device/start_gdn_call.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/r"
s=$(date +%s)
timeout ${EACH:-270} python3 bench/start_timeline.py --ptx /tmp/ptx-gdn --json "$OUT/r/start_timeline_default.json" \
  > "$OUT/r/start_timeline_default.log" 2>&1
echo "default rc $? ($(( $(date +%s) - s )) s)"
s=$(date +%s)
timeout ${EACH:-270} python3 bench/start_timeline.py --ptx /tmp/ptx-nogdn --config 'gdn_kernel = "off"' \
  --json "$OUT/r/start_timeline_gdn_off.json" > "$OUT/r/start_timeline_gdn_off.log" 2>&1
echo "gdn off rc $? ($(( $(date +%s) - s )) s)"
grep -h -E "ready in|compiled" "$OUT"/r/start_timeline_*.log | head -40
