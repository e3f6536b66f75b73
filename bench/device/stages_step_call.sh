#!/usr/bin/env bash
# One device call (after staging): the tensor-core matmul's shared-memory feed (P chunks of weights
# in flight per warp, arm token "pN") against the register feed ("p0") in whole 27B-shaped 4-bit
# steps, the daemon's default CUDA kernels otherwise (issue 49). The same bits by construction:
# step_split compares every arm's last logits with the round's first arm's, bit for bit.
#   1. bench/step_split.py: host build / encode / total of a compiled step, 1x1 and 4x1;
#   2. bench/gpu_batch_spec.py: the decoders (batch depth 0, speculation depth 2), heights 1 and 4.
#   P=4 bash bench/device/stages_step_call.sh        (results under $OUT/stages_split, $OUT/stages_spec)
#   SHAPES=1x1,4x1,4x2 (step 1's shapes, BxT); SPLIT_LIMIT=0 skips step 1; an arm with "tbl" reads COUNCILD_QMM_SPLITS (bench/qmm_split_pick.py's JSON).
#   ARMS=gdn+conv+merge+qmm+w1,gdn+conv+merge+qmm bash bench/device/stages_step_call.sh   (any two kernel sets;
#   arms of a different summation order, such as the wide split "wN", differ in their last logits)
#   SPEC_ARMS=...: step 2's kernel sets, where they are not ARMS (three arms of step 1, two of step 2)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
base=gdn+conv+merge+qmm
arms=${ARMS:-$base+p0,$base+p${P:-4}}
mkdir -p "$o/stages_split" "$o/stages_spec"
s=$(date +%s)
[ "${SPLIT_LIMIT:-200}" != 0 ] && timeout ${SPLIT_LIMIT:-200} python3 bench/step_split.py --out "$o/stages_split" --arms "$arms" --paths compiled \
    --shapes ${SHAPES:-1x1,4x1} --rounds ${ROUNDS:-4} --steps 8 --budget $(( ${SPLIT_LIMIT:-200} - 30 )) \
    > "$o/stages_split/step_split.log" 2>&1
echo "step_split rc $? ($(( $(date +%s) - s )) s)" | tee -a "$o/stages_split/step_split.log"
grep -v "^ \{6,\}[0-9]" "$o/stages_split/step_split.log" | tail -24
timeout ${SPEC_LIMIT:-300} python3 bench/gpu_batch_spec.py --shape 27b --dtype 4bit --heights 1 4 --depths 2 --tokens 24 \
    --rounds ${ROUNDS:-4} --kernels "${SPEC_ARMS:-$arms}" --compiled --budget $(( ${SPEC_LIMIT:-300} - 20 )) \
    --out "$o/stages_spec" > "$o/stages_spec/spec.log" 2>&1
echo "spec rc $? ($(( $(date +%s) - s )) s)" | tee -a "$o/stages_spec/spec.log"
tail -12 "$o/stages_spec/spec.log"
