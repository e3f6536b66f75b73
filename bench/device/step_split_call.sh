#!/usr/bin/env bash
# One device call: the quantized matmuls' GPU time from ncu (bench/qmm_ncu.py), the bundled
# model's step by height (eager, compiled), then the 27B-shaped 4-bit step split into host
# build, host encode and total (bench/step_split.py), arms alternated. After staging MLX:
#   bash .whl5/install.sh && bash bench/device/step_split_call.sh [--sweep]
# Everything lands in $OUT (step_split.tgz holds all of it; the logs also come back alone).
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/ncu" "$o/bundled" "$o/s27"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
t0=$(date +%s)
timeout ${NCU_TIMEOUT:-200} "$NCU" --profile-from-start off --metrics gpu__time_duration.sum --csv \
    --log-file "$o/ncu/ncu.csv" python3 bench/qmm_ncu.py --plan "$o/ncu/plan.json" "$@" > "$o/ncu.log" 2>&1
echo "ncu rc $? after $(( $(date +%s) - t0 )) s" >> "$o/ncu.log"
python3 bench/qmm_ncu.py --report "$o/ncu" >> "$o/ncu.log" 2>&1
timeout ${BUNDLED_TIMEOUT:-90} python3 bench/step_split.py --model daemon/assets/tiny-qwen35 --no-floors --arms mlx \
    --shapes 1x1,2x1,4x1,8x1 --rounds 2 --out "$o/bundled" > "$o/bundled.log" 2>&1
echo "bundled rc $? after $(( $(date +%s) - t0 )) s" >> "$o/bundled.log"
left=$(( ${CALL_LIMIT:-570} - ($(date +%s) - t0) ))
timeout $left python3 bench/step_split.py --out "$o/s27" --rounds 2 --steps 6 --budget $(( left - 40 )) > "$o/s27.log" 2>&1
echo "s27 rc $? after $(( $(date +%s) - t0 )) s" >> "$o/s27.log"
tar czf "$o/step_split.tgz" -C "$o" ncu bundled s27 ncu.log bundled.log s27.log
tail -25 "$o/ncu.log"; tail -8 "$o/bundled.log"; tail -14 "$o/s27.log"
