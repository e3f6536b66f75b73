#!/usr/bin/env bash
# One device call (after staging MLX): the tensor-core quantized kernel's launches against each
# other and MLX's at the 27B shapes (LAUNCHES: bench/qmm_graph.py's S:U:NA list, 0 for the table's):
#   1. every launch's bits against each other and against MLX's (qmm_graph.py --mode check);
#   2. device time per call from ncu (gpu__time_duration, caches flushed) at M = 1, 4, 8, 16, 32;
#   3. ncu's sections (memory, scheduler, warp state, occupancy) of the M = 1 gate/up launches
#      (the default and DETAIL_LAUNCHES).
#   bash bench/device/qmm_sweep_call.sh            (results under $OUT)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}
mkdir -p "$o"
t0=$(date +%s)
q="python3 bench/qmm_graph.py"
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout ${CHECK_LIMIT:-200} $q --mode check --json "$o/check.json" > "$o/check.log" 2>&1
echo "check rc $? after $(( $(date +%s) - t0 )) s"; grep -E "check|ok" "$o/check.log" | tail -4
SHAPES=${SHAPES:-gate/up,down,q_proj,out_proj,lm_head}
MS=${MS:-1,4,8,16,32}
LAUNCHES=${LAUNCHES:-4:0:0,8:0:0}
MLX_USE_CUDA_GRAPHS=0 timeout ${SWEEP_LIMIT:-220} "$NC" --clock-control none --csv --metrics gpu__time_duration.sum \
    --kernel-name regex:'councild|qmv|qmm' --log-file "$o/sweep_ncu.csv" \
    $q --mode probe --reps 2 --shapes "$SHAPES" --ms "$MS" --launches "$LAUNCHES" --json "$o/sweep_plan.json" > "$o/sweep.log" 2>&1
echo "sweep rc $? after $(( $(date +%s) - t0 )) s"
python3 bench/qmm_probe_read.py "$o/sweep_ncu.csv" --reps 2 --shapes "$SHAPES" --ms "$MS" --launches "$LAUNCHES" \
    --json "$o/sweep_device_us.json" > "$o/sweep.md" 2>&1
cat "$o/sweep.md"
MLX_USE_CUDA_GRAPHS=0 timeout ${DETAIL_LIMIT:-90} "$NC" --clock-control none --kernel-name regex:councild_qmm \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    $q --mode probe --reps 1 --shapes gate/up --ms 1 --launches ${DETAIL_LAUNCHES:-4:0:0} > "$o/detail.txt" 2>&1
echo "detail rc $? after $(( $(date +%s) - t0 )) s"
grep -E "^  custom|Duration|DRAM Throughput|Issued Warp|Eligible Warps|Registers Per|Achieved Occupancy" "$o/detail.txt" | cut -c1-120
