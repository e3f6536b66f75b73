#!/usr/bin/env bash
# One device call: the conv, SiLU and q/k norm folded into the GatedDeltaNet kernel
# (gdn_fused.gated_delta_conv_fused) on the H200. The kernel against its reference and its
# invariance (bench/gdn_check.py's conv section), 48 layers' conv + recurrence host and GPU
# time folded and not (layer_timing), the bundled model's exactness probes with it; then the
# fidelity gate, batched, exact mode (load_model folds the conv by default on CUDA); then the
# bundled model's compiled step folded and not (bench/step_split.py, arms alternated).
# After staging MLX:  bash .whl4/install.sh && bash bench/device/conv_call.sh
export PYTHONPATH=/tmp/site:$PWD MLX_CUDA_USE_CUDNN_SDPA=0
o=${OUT:-/tmp/out}
mkdir -p "$o/gdn" "$o/sb"
t0=$(date +%s)
timeout ${GDN_TIMEOUT:-300} python3 bench/gdn_check.py --out "$o/gdn" \
    --sections ${GDN_SECTIONS:-conv,layer_timing,bundled_probes} > "$o/gdn.log" 2>&1
echo "gdn rc $? after $(( $(date +%s) - t0 )) s" >> "$o/gdn.log"
timeout ${GATE_TIMEOUT:-150} python3 -m daemon.cli gate fidelity --model daemon/assets/tiny-qwen35 \
    --batched 2,4,8 --batched-only --modes exact > "$o/gate.log" 2>&1
echo "gate rc $? after $(( $(date +%s) - t0 )) s" >> "$o/gate.log"
left=$(( ${CALL_LIMIT:-570} - ($(date +%s) - t0) ))
timeout $left python3 bench/step_split.py --model daemon/assets/tiny-qwen35 --out "$o/sb" --no-floors \
    --arms ${ARMS:-gdn+merge,gdn+conv+merge} --paths compiled --shapes ${SHAPES:-1x1,4x1} \
    --rounds ${ROUNDS:-4} --steps 8 --budget $(( left - 20 )) > "$o/sb.log" 2>&1
echo "sb rc $? after $(( $(date +%s) - t0 )) s" >> "$o/sb.log"
grep -v "^\[" "$o/gdn.log" | tail -60; tail -25 "$o/gate.log"; tail -14 "$o/sb.log"
