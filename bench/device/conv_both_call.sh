#!/usr/bin/env bash
# One device call (after staging), for a session with little device time: conv_call.sh (the
# folded conv kernel against its reference, its invariance, the bundled model's probes, the
# exact fidelity gate batched, the bundled step folded and not), then conv27_call.sh (the
# 27B-shaped 4-bit decoders folded and not) in what is left of CALL_LIMIT; everything under
# $OUT/all.tgz (the device returns at most 8 files).
#   bash bench/device/conv_both_call.sh
o=/tmp/conv_both
mkdir -p "$o"
t0=$(date +%s)
OUT=$o CALL_LIMIT=${FIRST_LIMIT:-220} bash bench/device/conv_call.sh > "$o/conv_call.txt" 2>&1
left=$(( ${CALL_LIMIT:-560} - ($(date +%s) - t0) ))
OUT=$o CALL_LIMIT=$left OPS_TIMEOUT=${OPS_TIMEOUT:-60} ROUNDS=${ROUNDS:-3} bash bench/device/conv27_call.sh > "$o/conv27_call.txt" 2>&1
tar czf "$OUT/all.tgz" -C "$o" .
cp "$o/conv_call.txt" "$o/conv27_call.txt" "$OUT/"
tail -c 5000 "$o/conv_call.txt"; echo; tail -c 5000 "$o/conv27_call.txt"
