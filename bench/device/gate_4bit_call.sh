#!/usr/bin/env bash
# One device call (after staging): the bundled model quantized to 4 bits (group 64, with its
# MTP head added back and quantized like the base), then the fidelity gate's batched arms on
# it (exact greedy rows batched at heights 2, 4, 8 against serial decode).
#   bash bench/device/gate_4bit_call.sh [more gate arguments, e.g. --batched-only --modes exact]
# (the whole gate, every serial arm first, took 3 min 13 s on the H200 before its batched arms)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/r"
M=/tmp/tiny-qwen35-4bit
[ -f $M/mtp.safetensors ] || { rm -rf $M; python3 -m mlx_lm convert --hf-path daemon/assets/tiny-qwen35 --mlx-path $M -q --q-bits 4 --q-group-size 64 > "$OUT/r/gate4_prep.log" 2>&1
python3 -m daemon.cli model pull $M --mtp-from daemon/assets/tiny-qwen35 >> "$OUT/r/gate4_prep.log" 2>&1; }
tail -2 "$OUT/r/gate4_prep.log"
s=$(date +%s)
timeout ${GATE_TIMEOUT:-480} python3 -m daemon.cli gate fidelity --model $M --batched 2,4,8 "$@" --json "$OUT/r/gate_4bit_batched.json" \
  > "$OUT/r/gate_4bit_batched.log" 2>&1
echo "gate rc $? ($(( $(date +%s) - s )) s)"; tail -25 "$OUT/r/gate_4bit_batched.log"
