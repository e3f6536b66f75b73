#!/usr/bin/env bash
# One device call (after staging), issue 49: the tensor-core matmul's residual variant checked bit
# for bit against the add apart (bench/qmm_graph.py --mode check: 4- and 8-bit, 1 and 17 rows, beside
# every launch's bits against each other), then a 27B-pattern step's graph counted
# (bench/step_ops.py) with every residual added apart and the attention eager ("r0+a0", as before
# 2026-12-06 evening) and as the daemon runs it now.
#   bash bench/device/residual_check_call.sh        (results under $OUT/residual_check)
#   CHECK_LIMIT=150 OPS_LIMIT=120: each part's time limit, seconds
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}/residual_check
mkdir -p "$o"
for b in 4 8; do
  timeout ${CHECK_LIMIT:-150} python3 bench/qmm_graph.py --mode check --bits $b --ms 1,17 --json "$o/check$b.json" \
      > "$o/check$b.log" 2>&1
  echo "check b$b rc $?"
  grep "check b" "$o/check$b.log"
done
base=gdn+conv+merge+qmm
timeout ${OPS_LIMIT:-120} python3 bench/step_ops.py --arms $base+r0+a0,$base --shapes 1x1,4x1 --json "$o/step_ops.json" \
    > "$o/step_ops.log" 2>&1
echo "step_ops rc $?"
tail -8 "$o/step_ops.log"
