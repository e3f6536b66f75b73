#!/usr/bin/env bash
# The GPU arm of bench/distributed_bench.py on the device machine `nvidia-h200-x2` (MLX on
# CUDA, NCCL), as it was run for the tensor-parallel results. The machine has no package index and a call takes
# at most 64 MiB (the checkout is ~22 MiB), so the mlx-cuda-13 wheel (~86 MiB) travels split
# in three untracked folders, one call each, the machine kept warm between them:
#   here: pip download mlx-cuda-13==0.32.4 mlx==0.32.4 mlx-lm==0.32.2 msgspec structlog pyzmq
#         (cp312, manylinux_2_35 x86_64), split -b 38M the cuda wheel into part_aa/ab/ac;
#         .wa/part_aa, .wb/part_ab, .wc/{part_ac, the other wheels, install.sh}
#   call 1 (only .wa present): mkdir -p /root/stage && cp .wa/* /root/stage/
#   call 2 (only .wb present): cp .wb/* /root/stage/
#   call 3 (only .wc present): bash bench/distributed_gpu_run.sh
set -euo pipefail
# NVLink multicast stays off on the shared hosts (device/KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash .wc/install.sh
export PYTHONPATH=/tmp/site
# MLX's NCCL backend loads libnccl at run time: the image's (PyTorch's) copy.
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$nccl" ] && export LD_LIBRARY_PATH="$nccl:${LD_LIBRARY_PATH:-}"
nvidia-smi -L
out=${OUT:-/tmp}
python3 bench/distributed_bench.py --ranks 2 --backend nccl --inproc --shape 27b --rounds "${ROUNDS:-2}" \
  --tokens "${TOKENS:-32}" --depths 1,2,3 --json "$out/distributed_h200x2_27b.json" \
  --md "$out/distributed_h200x2_27b.md" 2>&1 | tee "$out/distributed_h200x2_27b.log"
# The daemon's own lockstep channel over NCCL: 1-rank vs 2-rank daemon, same greedy requests.
python3 bench/distributed_daemon_check.py --ranks 2 --backend nccl --json "$out/distributed_daemon_h200x2.json" \
  2>&1 | tee "$out/distributed_daemon_h200x2.log" || true
