#!/usr/bin/env bash
# One device call (after staging MLX, bench/results/README.md's GPU section): the tensor-core
# quantized kernel with its prefetch (PF: a warp loads its next step's weights before this
# step's products) against without, and wider splits of K, at the 27B shapes:
#   1. the launches' bits against each other (PF, NA, U change nothing) and against MLX's;
#   2. device time per call from ncu (gpu__time_duration, caches flushed), every arm at M = 1, 4, 16, 32;
#   3. ncu's full sections (memory, warp stalls, occupancy) of three M = 1 launches of gate/up.
#   bash bench/device/qmm_pf_call.sh            (results under $OUT)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}
mkdir -p "$o"
t0=$(date +%s)
q="python3 bench/qmm_graph.py"
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NC:-none}"
timeout ${CHECK_LIMIT:-90} $q --mode check --json "$o/check.json" > "$o/check.log" 2>&1
echo "check rc $? after $(( $(date +%s) - t0 )) s"; tail -4 "$o/check.log"
SHAPES=${SHAPES:-gate/up,down,q_proj,out_proj,lm_head}
MS=${MS:-1,4,16,32}
LAUNCHES=${LAUNCHES:-0:0:0:1,4:0:0:0,4:0:0:1,8:0:0:0,8:0:0:1,4:2:0:1}
MLX_USE_CUDA_GRAPHS=0 timeout ${SWEEP_LIMIT:-260} "$NC" --clock-control none --csv --metrics gpu__time_duration.sum \
    --kernel-name regex:'councild|qmv|qmm' --log-file "$o/sweep_ncu.csv" \
    $q --mode probe --reps 2 --shapes "$SHAPES" --ms "$MS" --launches "$LAUNCHES" --json "$o/sweep_plan.json" > "$o/sweep.log" 2>&1
echo "sweep rc $? after $(( $(date +%s) - t0 )) s"
python3 bench/qmm_probe_read.py "$o/sweep_ncu.csv" --reps 2 --shapes "$SHAPES" --ms "$MS" --launches "$LAUNCHES" \
    --json "$o/sweep_device_us.json" > "$o/sweep.md" 2>&1
cat "$o/sweep.md"
MLX_USE_CUDA_GRAPHS=0 timeout ${DETAIL_LIMIT:-120} "$NC" --clock-control none --kernel-name regex:councild_qmm \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    $q --mode probe --reps 1 --shapes gate/up --ms 1 --launches 0:0:0:1,8:0:0:1 > "$o/detail.txt" 2>&1
echo "detail rc $? after $(( $(date +%s) - t0 )) s"
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Issued Warp|Eligible|No Eligible|Block Size|Grid Size|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth" "$o/detail.txt" | head -80
