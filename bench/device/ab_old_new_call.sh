#!/usr/bin/env bash
# One device call: the decoders at 27B (bench/gpu_batch_spec.py, gdn+qmm, compiled) at two
# versions of the code in alternate processes on one machine: old8f/ (a `git archive` of
# 8f05c5e's daemon/, governor/, protocol/ and bench scripts, the code of 2026-12-04's call 6)
# and the working tree. The first process pays MLX's kernel compiles and is reported apart.
# Make old8f/ beside the tree first (untracked, so it travels with it):
#   mkdir old8f && git archive 8f05c5e daemon governor protocol bench/gpu_batch_spec.py \
#       bench/gpu_bench.py bench/step_split.py | tar -x -C old8f && rm -rf old8f/daemon/assets
bash .whl4/install.sh >/dev/null 2>&1; pip install -q --no-index --no-deps --target /tmp/site .whl5/*.whl >/dev/null 2>&1
export MLX_CUDA_USE_CUDNN_SDPA=0; mkdir -p $OUT/ab
t0=$(date +%s)
one() { # label, dir, timeout
  ( cd $2 && PYTHONPATH=/tmp/site:$PWD timeout $3 python3 bench/gpu_batch_spec.py --shape 27b --dtype 4bit --heights 1 4 --depths 2 --tokens 24 --rounds 3 --kernels gdn+qmm --compiled --out $OUT/ab/$1 > $OUT/ab/$1.log 2>&1 )
  echo "== $1 rc $? at $(( $(date +%s) - t0 )) s"; grep "^| [14] " $OUT/ab/$1.log
}
one new_first . 80; one old_0 old8f 80; one new_1 . 60; one old_1 old8f 60; one new_2 . 60
