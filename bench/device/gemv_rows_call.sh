#!/usr/bin/env bash
# One device call for engine/kernels/gemv_rows.py: (1) its bit check against MLX's gemv and the
# host encode per projection, M = 1..8, MLX's matmul / the fixed-order kernel / gemv_rows
# (bench/probes/small_m_matmul_host.py); (2) the bundled model's step by height, compiled, the
# daemon's CUDA kernel set with MLX's kernels ("gdn+conv+merge"), with the whole invariant set
# as the daemon runs it now ("+inv": gemv_rows from two rows, MLX's gemv at one) and as before
# ("+inv+fixed": the fixed-order kernel at every row count), arms alternated per round; (3) with
# GATE=1, the fidelity gate's exact arms on the bundled model (the kernels chosen as the daemon
# chooses them). After staging MLX:  bash .whl5/install.sh && bash bench/device/gemv_rows_call.sh
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0 PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}
mkdir -p "$o/bundled"
t0=$(date +%s)
if [ "${GATE:-0}" = 1 ]; then
  timeout ${GATE_TIMEOUT:-500} python3 -m daemon.cli gate fidelity --modes exact --draws 0 ${GATE_ARGS:---batched 2,4,8} \
      --json "$o/gate.json" > "$o/gate.log" 2>&1
  echo "gate rc $? after $(( $(date +%s) - t0 )) s" >> "$o/gate.log"
  grep -i "kernels\|dense_rows\|PASS\|FAIL\|diverg" "$o/gate.log" | head -30; grep "resumed\|paced\|together" "$o/gate.log"
  [ "${STEPS:-0}" = 1 ] || exit 0
fi
timeout 120 python3 bench/probes/small_m_matmul_host.py --json "$o/small_m.json" > "$o/small_m.log" 2>&1
echo "small_m rc $? after $(( $(date +%s) - t0 )) s" >> "$o/small_m.log"
left=$(( ${CALL_LIMIT:-570} - ($(date +%s) - t0) ))
timeout $left python3 bench/step_split.py --model daemon/assets/tiny-qwen35 --no-floors \
    --arms ${ARMS:-gdn+conv+merge,gdn+conv+merge+inv,gdn+conv+merge+inv+fixed} --paths compiled \
    --shapes ${SHAPES:-1x1,2x1,4x1,8x1,1x2,4x2} --rounds ${ROUNDS:-4} --budget $(( left - 20 )) \
    --out "$o/bundled" > "$o/bundled.log" 2>&1
echo "bundled rc $? after $(( $(date +%s) - t0 )) s" >> "$o/bundled.log"
tar czf "$o/gemv_rows.tgz" -C "$o" bundled small_m.log bundled.log
cat "$o/small_m.log"; grep -v "^\[" "$o/bundled.log" | tail -30
