#!/usr/bin/env bash
# One device call (after staging MLX): batched speculation with drafting cycles built ahead
# (batch_ahead.py) against cycles built one at a time, arms alternated
# round by round: the 27B shape at 4 bits (the compiled step and the daemon's kernels), then
# the small random shape in bf16, whose cycles are short and bound by the host.
# Results under $OUT/spec_ahead (one tarball).
#   bash bench/device/spec_ahead_call.sh          (HEIGHTS="2 4" DEPTHS="1 2" ROUNDS=4 TOKENS=64)
# SOLO=1 adds, where HEIGHTS has 1, the daemon's lone-request paths (gpu_batch_spec --solo);
# TINY=0 skips the small shape; the 27B stops starting rounds 60 s before its limit (heights in the
# order given: the first gets its rounds first). Next planned: HEIGHTS="4 8 1" DEPTHS="1 2 3" SOLO=1 TINY=0 LIMIT_27B=560
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=/tmp/spec_ahead
mkdir -p "$o"
s=$(date +%s)
timeout ${LIMIT_27B:-400} python3 bench/gpu_batch_spec.py --shape 27b --dtype 4bit --heights ${HEIGHTS:-2 4} \
    --depths ${DEPTHS:-1 2} --tokens ${TOKENS:-64} --rounds ${ROUNDS:-4} --kernels gdn+conv+merge+qmm --compiled \
    --ahead ab ${SOLO:+--solo} --budget $(( ${LIMIT_27B:-400} - 60 )) --out "$o/27b" > "$o/27b.log" 2>&1
echo "27b rc $? ($(( $(date +%s) - s )) s)"
tail -12 "$o/27b.log"
[ "${TINY:-1}" = 0 ] || timeout ${LIMIT_TINY:-120} python3 bench/gpu_batch_spec.py --shape tiny --dtype bf16 --heights 4 8 --depths 2 \
    --tokens ${TOKENS:-64} --rounds ${ROUNDS:-4} --compiled --ahead ab --out "$o/tiny" > "$o/tiny.log" 2>&1
echo "tiny rc $? ($(( $(date +%s) - s )) s)"
tail -8 "$o/tiny.log"
tar czf "${OUT:-/tmp/out}/spec_ahead.tgz" -C "$o" .
