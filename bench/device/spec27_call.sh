#!/usr/bin/env bash
# One device call: the 27B-shaped 4-bit decoders (one row and four, depth 0 and oracle
# speculation at depth 2) on the daemon's CUDA kernel set with the tensor-core kernel's launch
# varied (bench/step_split.py's apply_launches: "sN"), one model per set, arms alternated per
# round; then, unless SKIP_GATE=1, the bundled model's batched exact fidelity gate. On a fresh
# machine the first pass compiles MLX's kernels for ~170 s: CALL_LIMIT must leave room for it.
#   KERNELS=gdn+conv+merge+qmm,gdn+conv+merge+qmm+s4 bash bench/device/spec27_call.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/spec27"
t0=$(date +%s)
left=$(( ${CALL_LIMIT:-570} - ${GATE_S:-130} ))
timeout $left python3 bench/gpu_batch_spec.py --shape 27b --dtype 4bit --heights ${HEIGHTS:-1 4} \
    --depths ${DEPTHS:-2} --tokens 24 --rounds ${ROUNDS:-3} --kernels ${KERNELS:-gdn+conv+merge+qmm,gdn+conv+merge+qmm+s4} \
    --compiled --budget $(( left - 120 )) --out "$o/spec27" > "$o/spec27.log" 2>&1
echo "spec27 rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$o/spec27.log"
tail -24 "$o/spec27.log"
if [ "${SKIP_GATE:-0}" != 1 ]; then
  left=$(( ${CALL_LIMIT:-570} - ($(date +%s) - t0) ))
  timeout $left python3 -m daemon.cli gate fidelity --model daemon/assets/tiny-qwen35 --batched 2,4,8 \
      --batched-only --modes exact > "$o/gate.log" 2>&1
  echo "gate rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$o/gate.log"
  tail -14 "$o/gate.log"
fi
