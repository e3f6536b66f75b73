#!/usr/bin/env bash
# One device call: the operations a decode step asks of MLX on CUDA by primitive (bench/step_ops.py,
# the 27B layer pattern at a small width, kernels mlx and qmm, eager and compiled), then the
# tensor-core kernel's launch sweep under ncu (bench/qmm_ncu.py --only-sweep) in what time is left.
# After staging MLX:  bash .whl5/install.sh && bash bench/device/step_ops_call.sh
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/sw"
t0=$(date +%s)
timeout ${OPS_TIMEOUT:-200} python3 bench/step_ops.py --arms ${OPS_ARMS:-mlx,qmm} --json "$o/step_ops.json" > "$o/step_ops.log" 2>&1
echo "step_ops rc $? after $(( $(date +%s) - t0 )) s" >> "$o/step_ops.log"
left=$(( ${CALL_LIMIT:-380} - ($(date +%s) - t0) ))
if [ $left -gt 90 ]; then
  timeout $left /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv --log-file "$o/sw/ncu.csv" \
      python3 bench/qmm_ncu.py --plan "$o/sw/plan.json" --only-sweep --budget $(( left - 60 )) > "$o/sw.log" 2>&1
  echo "sweep rc $? after $(( $(date +%s) - t0 )) s" >> "$o/sw.log"
  python3 bench/qmm_ncu.py --report "$o/sw" >> "$o/sw.log" 2>&1
fi
tail -12 "$o/step_ops.log"; tail -40 "$o/sw.log" 2>/dev/null
