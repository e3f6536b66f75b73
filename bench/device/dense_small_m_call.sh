#!/usr/bin/env bash
# One device call: does a custom-kernel matmul take away what a bf16 step pays from two rows on?
# (1) bench/probes/small_m_matmul_host.py: host encode per projection, MLX's matmul (gemv at one
# row, cuBLASLt from two) against the fixed-order custom matmul, M = 1..8; (2) the bundled
# model's step by height (bench/step_split.py, compiled), the daemon's CUDA kernel set with
# MLX's matmuls ("gdn+conv+merge") against the same with the bf16 linears and the tied head on
# the custom matmul ("+lin") and with the whole invariant set ("+inv"), arms alternated per
# round, three rounds (the first is first uses). After staging MLX:
#   bash .whl5/install.sh && bash bench/device/dense_small_m_call.sh
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/bundled"
t0=$(date +%s)
timeout 90 python3 bench/probes/small_m_matmul_host.py --json "$o/small_m.json" > "$o/small_m.log" 2>&1
echo "small_m rc $? after $(( $(date +%s) - t0 )) s" >> "$o/small_m.log"
left=$(( ${CALL_LIMIT:-570} - ($(date +%s) - t0) ))
timeout $left python3 bench/step_split.py --model daemon/assets/tiny-qwen35 --no-floors \
    --arms ${ARMS:-gdn+conv+merge,gdn+conv+merge+lin,gdn+conv+merge+inv} --paths compiled \
    --shapes ${SHAPES:-1x1,2x1,4x1,8x1,1x2,4x2} --rounds ${ROUNDS:-3} --budget $(( left - 20 )) \
    --out "$o/bundled" > "$o/bundled.log" 2>&1
echo "bundled rc $? after $(( $(date +%s) - t0 )) s" >> "$o/bundled.log"
tar czf "$o/dense_small_m.tgz" -C "$o" bundled small_m.log bundled.log
cat "$o/small_m.log"; grep -v "^\[" "$o/bundled.log" | tail -40
