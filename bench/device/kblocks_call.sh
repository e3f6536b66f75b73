#!/usr/bin/env bash
# The down and out projections' K shared over a cluster of KB blocks (issue 49): their 320
# column tiles put 2.42 blocks on each of 132 SMs, so the SMs with 3 set the time. Two device
# calls after staging (OLD: the kernel before KB, e.g. `git show HEAD~1:daemon/engine/kernels/quant_mma.py
# > old_quant_mma.py` in the tree, untracked, so it travels with it):
#   PHASE=sweep OLD=old_quant_mma.py bash bench/device/kblocks_call.sh
#     1. bits: KB = 1 the old kernel's at every launch; KB = 2 and 4 each row as alone (M = 1, 17);
#     2. ncu device time at M = 1, 4, 16: down, out_proj and the down projection's K at 264 and
#        396 column tiles ("balance": does the time follow the bytes or the fullest SM?), the
#        default launch against S:KB = 4:1, 4:2, 2:4, 8:2, 1:8 (LAUNCHES to change them).
#   PHASE=steps bash bench/device/kblocks_call.sh
#     3. whole 27B-shaped 4-bit steps (bench/gpu_batch_spec.py, heights 1 and 4), the default
#        kernels against "+k2" and "+k4" (bench/step_split.py's token; ARMS to change them).
# Everything under $OUT, archived into one file too (the device returns a few files a call).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$o/gpu.txt" 2>&1; cat "$o/gpu.txt"
if [ "${PHASE:-sweep}" = sweep ]; then
    q="python3 bench/qmm_graph.py"
    oldq=${OLD:+--old-source $OLD}
    timeout ${CHECK_LIMIT:-150} $q --mode check --bits 4 --ms ${CHECK_MS:-1,17} --kblocks ${KBLOCKS:-2,4} $oldq \
        --json "$o/check.json" > "$o/check.log" 2>&1
    echo "check rc $? after $(( $(date +%s) - t0 )) s"; grep -E "check b" "$o/check.log" | cut -c1-220
    NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    SHAPES=${SHAPES:-down,out_proj,balance}
    MS=${MS:-1,4,16}
    LAUNCHES=${LAUNCHES:-4:0:0:2:1,4:0:0:2:2,2:0:0:2:4,8:0:0:2:2,1:0:0:2:8}
    MLX_USE_CUDA_GRAPHS=0 timeout ${SWEEP_LIMIT:-240} "$NC" --clock-control none --csv --metrics gpu__time_duration.sum \
        --kernel-name regex:'councild|qmv|qmm' --log-file "$o/sweep_ncu.csv" \
        $q --mode probe --reps 2 --shapes "$SHAPES" --ms "$MS" --launches "$LAUNCHES" $oldq --json "$o/sweep_plan.json" \
        > "$o/sweep.log" 2>&1
    echo "sweep rc $? after $(( $(date +%s) - t0 )) s"
    python3 bench/qmm_probe_read.py "$o/sweep_ncu.csv" --reps 2 --shapes "$SHAPES" --ms "$MS" --launches "$LAUNCHES" \
        ${OLD:+--old} --json "$o/sweep_device_us.json" > "$o/sweep.md" 2>&1
    cat "$o/sweep.md"
else
    arms=${ARMS:-gdn+conv+merge+qmm,gdn+conv+merge+qmm+k2,gdn+conv+merge+qmm+k4}
    mkdir -p "$o/steps"
    timeout ${SPEC_LIMIT:-420} python3 bench/gpu_batch_spec.py --shape 27b --dtype 4bit --heights 1 4 --depths 2 \
        --tokens 24 --rounds ${ROUNDS:-4} --kernels "$arms" --compiled --budget $(( ${SPEC_LIMIT:-420} - 20 )) \
        --out "$o/steps" > "$o/steps/spec.log" 2>&1
    echo "steps rc $? after $(( $(date +%s) - t0 )) s"
    tail -14 "$o/steps/spec.log"
fi
tar czf "$o/all_${PHASE:-sweep}.tgz" -C "$o" --exclude='*.tgz' . 2>/dev/null
