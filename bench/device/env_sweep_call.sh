#!/usr/bin/env bash
# One device call: MLX's CUDA-graph switches against a decode step's host cost. bench/step_split.py
# (floors + 27B-shaped 4-bit eager steps B1T1 and B4T1, kernels mlx and qmm) once per setting, each
# in its own process (MLX reads them once), the default first and last; then the quantized matmuls'
# GPU time from ncu (bench/qmm_ncu.py). After staging MLX:
#   bash .whl5/install.sh && bash bench/device/env_sweep_call.sh
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0 MLX_ENABLE_CACHE_THRASHING_CHECK=0
o=${OUT:-/tmp/out}
mkdir -p "$o/env" "$o/ncu"
t0=$(date +%s)
run() {  # name, then env assignments
    local name=$1; shift
    env "$@" timeout ${STEP_TIMEOUT:-75} python3 bench/step_split.py --paths eager --arms mlx,qmm --shapes 1x1,4x1 \
        --rounds 1 --steps 8 --out "$o/env/$name" > "$o/env/$name.log" 2>&1
    echo "== $name ($*) rc $? at $(( $(date +%s) - t0 )) s" | tee -a "$o/env_sweep.log"
    grep -E "floors|round 0" "$o/env/$name.log" | tee -a "$o/env_sweep.log"
}
run default
run cache4000 MLX_CUDA_GRAPH_CACHE_SIZE=4000
run ops100_cache4000 MLX_MAX_OPS_PER_BUFFER=100 MLX_CUDA_GRAPH_CACHE_SIZE=4000
run ops200_cache4000 MLX_MAX_OPS_PER_BUFFER=200 MLX_CUDA_GRAPH_CACHE_SIZE=4000
run no_graphs MLX_USE_CUDA_GRAPHS=0
run ops5_cache4000 MLX_MAX_OPS_PER_BUFFER=5 MLX_CUDA_GRAPH_CACHE_SIZE=4000
run default_again
NCU=${NCU:-/usr/local/cuda/bin/ncu}
timeout ${NCU_TIMEOUT:-150} "$NCU" --metrics gpu__time_duration.sum --csv --log-file "$o/ncu/ncu.csv" \
    python3 bench/qmm_ncu.py --plan "$o/ncu/plan.json" > "$o/ncu.log" 2>&1
echo "ncu rc $? at $(( $(date +%s) - t0 )) s" >> "$o/ncu.log"
python3 bench/qmm_ncu.py --report "$o/ncu" >> "$o/ncu.log" 2>&1
tar czf "$o/env_sweep.tgz" -C "$o" env ncu env_sweep.log ncu.log
tail -30 "$o/ncu.log"
