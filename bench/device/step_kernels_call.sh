#!/usr/bin/env bash
# One device call (after staging): the 27B-shaped 4-bit decoders with the kernel called on x as
# it is against reshaped to 2-D around it ("rs", as before 2026-12-06), alternated by round, then
# one decode step's GPU time per kernel from ncu (bench/step_kernels.py: 8 layers, scaled to 64).
#   bash bench/device/step_kernels_call.sh        (results under $OUT/spec_rs and $OUT/step_kernels)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/spec_rs" "$o/step_kernels"
s=$(date +%s)
timeout ${SPEC_LIMIT:-240} python3 bench/gpu_batch_spec.py --shape 27b --dtype 4bit --heights 1 4 --depths 2 --tokens 24 \
    --rounds ${ROUNDS:-4} --kernels gdn+conv+merge+qmm+rs,gdn+conv+merge+qmm --compiled --budget $(( ${SPEC_LIMIT:-240} - 20 )) \
    --out "$o/spec_rs" > "$o/spec_rs/spec_rs.log" 2>&1
echo "spec_rs rc $? ($(( $(date +%s) - s )) s)" | tee -a "$o/spec_rs/spec_rs.log"
tail -8 "$o/spec_rs/spec_rs.log"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
timeout ${NCU_LIMIT:-200} "$NCU" --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
    --log-file "$o/step_kernels/ncu.csv" python3 bench/step_kernels.py --plan "$o/step_kernels/plan.json" \
    --layers 8 --shapes 1x1,4x1 > "$o/step_kernels/run.log" 2>&1
echo "ncu rc $? ($(( $(date +%s) - s )) s)" | tee -a "$o/step_kernels/run.log"
python3 bench/step_kernels.py --report "$o/step_kernels" > "$o/step_kernels/report.md" 2>&1
cat "$o/step_kernels/report.md" | head -80
gzip -f "$o/step_kernels/ncu.csv"
