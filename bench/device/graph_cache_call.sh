#!/usr/bin/env bash
# One device call (after staging): does a kernel declared with a cluster of blocks make later
# launches of the plain tensor-core matmul give other bits, with MLX's CUDA graphs on and off?
# (bench/results/h100_2026-12-06j, call 23.) KB_SOURCE is the cluster version of the kernel,
# in the tree and untracked so it travels with it:
#   git show ad9ea4d:daemon/engine/kernels/quant_mma.py \
#     | sed 's/^from \. import custom_kernel_cache/from daemon.engine.kernels import custom_kernel_cache/' > kb_quant_mma.py
#   bash bench/device/graph_cache_call.sh          (logs under $OUT)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}
mkdir -p "$o"
python3 -c "import mlx.core as mx; print(mx.__version__)" 2>/dev/null || bash .whl5/install.sh >/dev/null 2>&1
p="timeout 110 python3 bench/probes/qmm_launch_diff.py --ms 1,17 --kb-source ${KB_SOURCE:-kb_quant_mma.py} --kb-between 2"
$p > "$o/kb_graphs.log" 2>&1; echo "kb between, graphs rc $?"; cut -c1-150 "$o/kb_graphs.log"
MLX_USE_CUDA_GRAPHS=0 $p > "$o/kb_nographs.log" 2>&1; echo "kb between, no graphs rc $?"; cut -c1-150 "$o/kb_nographs.log"
