#!/usr/bin/env bash
# One device call (after staging MLX): bench/device/qmm_sweep_call.sh on fewer shapes (the matmul
# A/B of the activation loading, device time from ncu), then the 27B-shaped 4-bit decoders on
# both loadings (bench/device/spec27_pf_call.sh, kernel sets ...+xl0 and ...+xl1, no gate).
#   bash bench/device/xl_both_call.sh            (results under $OUT)
t0=$(date +%s)
SHAPES=${SHAPES:-gate/up,down,lm_head} MS=${MS:-1,4,16} CHECK_LIMIT=${CHECK_LIMIT:-90} SWEEP_LIMIT=${SWEEP_LIMIT:-120} \
    DETAIL_LIMIT=${DETAIL_LIMIT:-45} LAUNCHES=${LAUNCHES:-0:0:0:0:0,4:0:0:0:1} bash bench/device/qmm_sweep_call.sh
left=$(( ${CALL_LIMIT:-580} - ($(date +%s) - t0) ))
ROUNDS=${ROUNDS:-6} KERNELS=${KERNELS:-gdn+conv+merge+qmm+xl0,gdn+conv+merge+qmm+xl1} SKIP_GATE=1 GATE_S=0 CALL_LIMIT=$left \
    bash bench/device/spec27_pf_call.sh
