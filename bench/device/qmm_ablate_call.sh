#!/usr/bin/env bash
# One device call (after staging MLX), issue 49: where a one-row launch of the tensor-core matmul
# spends its time. bench/probes/qmm_ablations.py writes copies of the kernel whose chunk does
# less work (nofma, nodeq, feed: wrong outputs by design, never installed); ncu times each against
# the real kernel and MLX's at the 27B shapes (bench/qmm_graph.py --mode probe --old-source, read by
# bench/qmm_probe_read.py --old: the arm "old" is the ablation).
#   bash bench/device/qmm_ablate_call.sh        (results under $OUT/ablate)
#   NAMES=nofma,nodeq,feed SHAPES=down,out_proj,gate+up,in_proj,qkv MS=1,16 LIMIT=100 (seconds an ablation)
#   NAMES=feed,feed_noscale,feed_nox: which part of the feed a one-row launch waits on
#   TILED=1: arms "tiled" and "old tiled" too, the scales and biases tiled (quant_mma.tile_pairs)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}/ablate
names=${NAMES:-nofma,nodeq,feed}
mkdir -p "$o/src"
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
python3 bench/probes/qmm_ablations.py --out "$o/src" --names "$names" > /dev/null || exit 2
SHAPES=${SHAPES:-down,out_proj,gate+up,in_proj,qkv}
MS=${MS:-1,16}
for n in $(echo "$names" | tr , ' '); do
  t0=$(date +%s)
  MLX_USE_CUDA_GRAPHS=0 timeout "${LIMIT:-100}" "$NC" --clock-control none --csv --metrics gpu__time_duration.sum \
      --kernel-name regex:'councild|qmv|qmm' --log-file "$o/$n.csv" \
      python3 bench/qmm_graph.py --mode probe --reps 3 --shapes "$SHAPES" --ms "$MS" --old-source "$o/src/qmm_$n.py" ${TILED:+--tiled} \
      --json "$o/${n}_plan.json" > "$o/$n.log" 2>&1
  echo "ablation $n rc $? ($(( $(date +%s) - t0 )) s); arm old = $n"
  python3 bench/qmm_probe_read.py "$o/$n.csv" --reps 3 --shapes "$SHAPES" --ms "$MS" --old ${TILED:+--tiled} --json "$o/$n.json" \
      > "$o/$n.md" 2>&1
  tail -n +3 "$o/$n.md"
done
# DETAIL=NAME: then ncu's warp-state, scheduler, memory, occupancy and source-counter sections
# (stall reasons and excess sectors / wavefronts; per-line stalls are not printed) for the real
# kernel and ablation NAME at one row of DETAIL_SHAPE (down)
[ -z "${DETAIL:-}" ] && exit 0
MLX_USE_CUDA_GRAPHS=0 timeout "${DETAIL_LIMIT:-150}" "$NC" --clock-control none --kernel-name regex:councild_qmm \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section SourceCounters --section SpeedOfLight \
    python3 bench/qmm_graph.py --mode probe --reps 1 --shapes "${DETAIL_SHAPE:-down}" --ms 1 --old-source "$o/src/qmm_$DETAIL.py" \
    > "$o/detail_$DETAIL.txt" 2>&1
echo "detail rc $?"
grep -E "^  councild|Duration|DRAM Throughput|Issued Warp|Eligible Warps|Achieved Occupancy|Registers Per|Stall|stall" \
    "$o/detail_$DETAIL.txt" | cut -c1-150 | head -60
