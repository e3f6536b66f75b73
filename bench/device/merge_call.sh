#!/usr/bin/env bash
# One device call: merged projections (engine/kernels/merged_linears.py) on the H200. First the
# fused recurrence's checks again (bench/gdn_check.py; its kernel now reads its inputs through
# their strides, and the "strided" section checks views against contiguous inputs bit for bit),
# then the 27B-shaped 4-bit compiled step with and without the merged projections
# (bench/step_split.py, arms alternated per round). After staging MLX:
#   bash .whl4/install.sh && bash bench/device/merge_call.sh
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/gdn" "$o/s27"
t0=$(date +%s)
timeout ${GDN_TIMEOUT:-150} python3 bench/gdn_check.py --out "$o/gdn" \
    --sections ${GDN_SECTIONS:-numerics,invariance,strided,bundled_probes} > "$o/gdn.log" 2>&1
echo "gdn rc $? after $(( $(date +%s) - t0 )) s" >> "$o/gdn.log"
left=$(( ${CALL_LIMIT:-570} - ($(date +%s) - t0) ))
timeout $left python3 bench/step_split.py --out "$o/s27" --no-floors --arms ${ARMS:-gdn+qmm,gdn+merge+qmm} \
    --paths compiled --shapes ${SHAPES:-1x1,4x1,8x1} --rounds ${ROUNDS:-3} --steps 6 --budget $(( left - 30 )) \
    > "$o/s27.log" 2>&1
echo "s27 rc $? after $(( $(date +%s) - t0 )) s" >> "$o/s27.log"
grep -v "^\[" "$o/gdn.log" | tail -40; tail -14 "$o/s27.log"
