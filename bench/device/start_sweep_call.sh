#!/usr/bin/env bash
# One device call (after staging): where a start's first ~19 s go before the daemon's first log
# line (Python's import times, twice: cold and warm), and the kernel's device time at M = 1 and
# 32 across launches (S warps per block, U chunks in flight, NA column tiles) from ncu.
#   bash bench/device/start_sweep_call.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/r"
for i in 1 2; do
  s=$(date +%s%N)
  timeout 60 python3 -X importtime -c "import daemon.socket_side.server, daemon.engine_thread.worker" 2> "$OUT/r/importtime_$i.txt"
  echo "serving imports, run $i: $(( ($(date +%s%N) - s) / 1000000 )) ms"
done
s=$(date +%s%N); timeout 60 python3 -c "import mlx.core as mx; mx.eval(mx.zeros(4) + 1)"; echo "mlx import + first op: $(( ($(date +%s%N) - s) / 1000000 )) ms"
s=$(date +%s%N); timeout 60 python3 -c "import transformers"; echo "transformers import: $(( ($(date +%s%N) - s) / 1000000 )) ms"
NC=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
L="1:1:1,1:2:1,2:1:1,2:4:1,4:1:1,4:2:1,4:4:1,8:1:1,8:2:1"
MLX_USE_CUDA_GRAPHS=0 timeout 170 "$NC" --csv --metrics gpu__time_duration.sum --log-file "$OUT/r/sweep_ncu.csv" \
  python3 bench/qmm_graph.py --mode probe --shapes gate/up --ms 1 --launches "$L" > "$OUT/r/sweep.log" 2>&1
echo "sweep rc $?"
tail -3 "$OUT/r/sweep.log"; sort -t'|' -k2 -n -r "$OUT/r/importtime_2.txt" | head -12
