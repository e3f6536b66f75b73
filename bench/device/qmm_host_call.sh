#!/usr/bin/env bash
# One device call (after staging, bench/results/README.md's GPU section): the quantized matmul's
# host cost per call, its device time per call from a profiler's trace, and a 27B-shaped
# forward's graph building and evaluation with MLX's CUDA graphs on and off. Results under $OUT/r.
#   bash bench/device/qmm_host_call.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/r"
q="python3 bench/qmm_graph.py"
(timeout 60 $q --mode host --rounds 2 --json "$OUT/r/host.json" > "$OUT/r/host.log" 2>&1; echo "host rc $?")
NS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "profilers: nsys=${NS:-none} ncu=${NC:-none}"
if [ -n "$NS" ]; then
  MLX_USE_CUDA_GRAPHS=0 timeout 150 "$NS" profile -t cuda --stats=false -o "$OUT/r/probe" \
    $q --mode probe --shapes gate/up,down,lm_head --json "$OUT/r/probe_plan.json" > "$OUT/r/probe.log" 2>&1
  echo "probe rc $?"
  timeout 60 "$NS" stats -r cuda_gpu_trace -f csv -o "$OUT/r/probe" "$OUT/r/probe.nsys-rep" >> "$OUT/r/probe.log" 2>&1
  rm -f "$OUT/r/probe.sqlite" "$OUT/r/probe.nsys-rep"
elif [ -n "$NC" ]; then
  MLX_USE_CUDA_GRAPHS=0 timeout 200 "$NC" --csv --metrics gpu__time_duration.sum --log-file "$OUT/r/probe_ncu.csv" \
    $q --mode probe --shapes gate/up,down,lm_head --json "$OUT/r/probe_plan.json" > "$OUT/r/probe.log" 2>&1
  echo "probe (ncu) rc $?"
fi
(timeout 170 $q --mode forward --layers 16 --rounds 2 --json "$OUT/r/forward_graphs.json" > "$OUT/r/forward_graphs.log" 2>&1; echo "forward rc $?")
(MLX_USE_CUDA_GRAPHS=0 timeout 110 $q --mode forward --layers 16 --rounds 2 --json "$OUT/r/forward_nographs.json" > "$OUT/r/forward_nographs.log" 2>&1; echo "forward (no graphs) rc $?")
tail -3 "$OUT/r/host.log"; tail -5 "$OUT/r/probe.log"; ls "$OUT/r"; tail -8 "$OUT/r/forward_graphs.log" "$OUT/r/forward_nographs.log"
