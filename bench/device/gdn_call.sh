#!/usr/bin/env bash
# One device call: the fused GatedDeltaNet recurrence checked (bench/gdn_check.py: numerics,
# invariance, one layer's cost, the bundled model's exactness probes on it), then the 27B-shaped
# 4-bit step with and without it (bench/step_split.py, arms alternated). After staging MLX:
#   bash .whl2/install.sh && bash bench/device/gdn_call.sh
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/gdn" "$o/s27"
t0=$(date +%s)
timeout ${GDN_TIMEOUT:-220} python3 bench/gdn_check.py --out "$o/gdn" ${GDN_SECTIONS:+--sections $GDN_SECTIONS} > "$o/gdn.log" 2>&1
echo "gdn rc $? after $(( $(date +%s) - t0 )) s" >> "$o/gdn.log"
left=$(( ${CALL_LIMIT:-575} - ($(date +%s) - t0) ))
timeout $left python3 bench/step_split.py --out "$o/s27" --no-floors --arms ${ARMS:-mlx,gdn} --paths ${PATHS:-eager,compiled} \
    --shapes ${SHAPES:-1x1,4x1,8x1} --rounds 2 --steps 6 --budget $(( left - 45 )) > "$o/s27.log" 2>&1
echo "s27 rc $? after $(( $(date +%s) - t0 )) s" >> "$o/s27.log"
cat "$o/gdn.log" | grep -v "^\[" | tail -60; tail -30 "$o/s27.log"
