#!/usr/bin/env bash
# One device call (after staging MLX): the tensor-core quantized kernel's launches against each
# other and MLX's at the 27B shapes (LAUNCHES: bench/qmm_graph.py's S:U:NA list, 0 for the table's):
#   1. every launch's bits against each other and against MLX's (qmm_graph.py --mode check);
#   2. device time per call from ncu (gpu__time_duration, caches flushed) at M = 1, 4, 8, 16, 32;
#   3. ncu's sections (memory, scheduler, warp state, occupancy) of the M = 1 gate/up launches
#      (the default and DETAIL_LAUNCHES).
#   4. (PICK=1) bench/qmm_split_pick.py: the split per shape from the sweep's split arms, to
#      $OUT/splits.json and /root/qmm_splits.json (bench/step_split.py's "tbl" token reads it
#      through COUNCILD_QMM_SPLITS in a later call on the same machine).
#   bash bench/device/qmm_sweep_call.sh            (results under $OUT)
#   CHECK_BITS=8 DETAIL_LIMIT=0 PICK=1 SHAPES=gate+up,down,in_proj,out_proj,qkv,lm_head MS=1,4,16 \
#     LAUNCHES=2:0:0:2,3:0:0:2,4:0:0:2,6:0:0:2,8:0:0:2,12:0:0:2 bash bench/device/qmm_sweep_call.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}
mkdir -p "$o"
t0=$(date +%s)
q="python3 bench/qmm_graph.py"
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
# OLD=FILE (another quant_mma.py, e.g. `git show REV:daemon/engine/kernels/quant_mma.py > old_quant_mma.py`
# in the tree, untracked): the check compares its bits too, and the sweep adds its arm "old".
oldq=${OLD:+--old-source $OLD}
timeout ${CHECK_LIMIT:-200} $q --mode check --bits ${CHECK_BITS:-4} ${CHECK_MS:+--ms $CHECK_MS} $oldq --json "$o/check.json" > "$o/check.log" 2>&1
echo "check rc $? after $(( $(date +%s) - t0 )) s"; grep -E "check|ok" "$o/check.log" | tail -4
SHAPES=${SHAPES:-gate/up,down,q_proj,out_proj,lm_head}
MS=${MS:-1,4,8,16,32}
LAUNCHES=${LAUNCHES:-4:0:0,8:0:0}
MLX_USE_CUDA_GRAPHS=0 timeout ${SWEEP_LIMIT:-220} "$NC" --clock-control none --csv --metrics gpu__time_duration.sum \
    --kernel-name regex:'councild|qmv|qmm' --log-file "$o/sweep_ncu.csv" \
    $q --mode probe --reps 2 --shapes "$SHAPES" --ms "$MS" --launches "$LAUNCHES" $oldq --json "$o/sweep_plan.json" > "$o/sweep.log" 2>&1
echo "sweep rc $? after $(( $(date +%s) - t0 )) s"
python3 bench/qmm_probe_read.py "$o/sweep_ncu.csv" --reps 2 --shapes "$SHAPES" --ms "$MS" --launches "$LAUNCHES" ${OLD:+--old} \
    --json "$o/sweep_device_us.json" > "$o/sweep.md" 2>&1
cat "$o/sweep.md"
if [ "${PICK:-0}" = 1 ]; then
    python3 bench/qmm_split_pick.py "$o/sweep_device_us.json" --json "$o/splits.json" > "$o/splits.md" 2>&1
    echo "pick rc $?"; cat "$o/splits.md"; cp "$o/splits.json" /root/qmm_splits.json 2>/dev/null
fi
[ "${DETAIL_LIMIT:-90}" = 0 ] && exit 0
MLX_USE_CUDA_GRAPHS=0 timeout ${DETAIL_LIMIT:-90} "$NC" --clock-control none --kernel-name regex:councild_qmm \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    $q --mode probe --reps 1 --shapes gate/up --ms 1 --launches ${DETAIL_LAUNCHES:-4:0:0} > "$o/detail.txt" 2>&1
echo "detail rc $? after $(( $(date +%s) - t0 )) s"
grep -E "^  custom|Duration|DRAM Throughput|Issued Warp|Eligible Warps|Registers Per|Achieved Occupancy" "$o/detail.txt" | cut -c1-120
