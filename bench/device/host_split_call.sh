#!/usr/bin/env bash
# One device call (after staging): where the daemon's default CUDA step goes at the 27B shape
# today (the folded GatedDeltaNet kernel, merged projections, the tensor-core matmul, compiled):
# host build / host encode / total by height, MLX's per-kernel floors, and a cProfile of the
# one-row step's Python build (issue 49: the step is host-bound; which part of the host?), and
# the kernel called on x [..., K] as it is against reshaped to 2-D around it (arm "rs": two
# view nodes a call, as before), alternated by round, their last logits compared bit for bit.
#   bash bench/device/host_split_call.sh        (results under $OUT/host_split)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}/host_split
mkdir -p "$o"
s=$(date +%s)
timeout ${CALL_LIMIT:-540} python3 bench/step_split.py --out "$o" --arms ${ARMS:-gdn+conv+merge+qmm+rs,gdn+conv+merge+qmm} \
    --paths ${PATHS:-compiled} --shapes ${SHAPES:-1x1,4x1} --rounds ${ROUNDS:-4} --steps 8 \
    --profile 1x1 --budget $(( ${CALL_LIMIT:-540} - 60 )) > "$o/step_split.log" 2>&1
echo "step_split rc $? ($(( $(date +%s) - s )) s)" | tee -a "$o/step_split.log"
grep -v "^ \{6,\}[0-9]" "$o/step_split.log" | tail -30
