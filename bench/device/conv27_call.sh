#!/usr/bin/env bash
# One device call: the 27B-shaped 4-bit decoders with the conv in MLX's ops against the conv
# folded into the GatedDeltaNet kernel (both with merged projections and the tensor-core
# quantized kernel, i.e. the daemon's invariant set on CUDA), one model per kernel set, arms
# alternated per round (bench/gpu_batch_spec.py), after counting each set's kernels a step
# (bench/step_ops.py). Run after bench/device/conv_call.sh has shown
# the folded kernel right on this machine. After staging MLX:
#   bash .whl4/install.sh && bash bench/device/conv27_call.sh
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/spec27"
t0=$(date +%s)
# First the kernels a step asks of MLX, folded and not (bench/step_ops.py: the 27B layer pattern
# at a small width; op counts do not depend on width).
timeout ${OPS_TIMEOUT:-120} python3 bench/step_ops.py --arms gdn+merge+qmm,gdn+conv+merge+qmm --shapes 1x1,4x1 \
    --json "$o/step_ops.json" > "$o/step_ops.log" 2>&1
echo "step_ops rc $? after $(( $(date +%s) - t0 )) s" >> "$o/step_ops.log"
left=$(( ${CALL_LIMIT:-570} - ($(date +%s) - t0) ))
timeout $left python3 bench/gpu_batch_spec.py --shape 27b --dtype 4bit --heights ${HEIGHTS:-1 4} \
    --depths ${DEPTHS:-2} --tokens 24 --rounds ${ROUNDS:-4} --kernels ${KERNELS:-gdn+merge+qmm,gdn+conv+merge+qmm} \
    --compiled --budget $(( left - 150 )) --out "$o/spec27" > "$o/spec27.log" 2>&1
echo "spec27 rc $? after $(( $(date +%s) - t0 )) s" >> "$o/spec27.log"
tail -8 "$o/step_ops.log"; tail -30 "$o/spec27.log"
