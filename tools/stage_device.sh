#!/usr/bin/env bash
# Stage MLX-on-CUDA for the lent GPU machine, which has no package index and takes at most
# 64 MiB a call, this repo's tracked tree (~47 MB) included: the mlx-cuda-13 wheel (~90 MB) goes
# in ignored folders of <= 14 MiB each (.part1-.part7; 23 MB parts stopped fitting beside the
# tree on 2026-12-06, 18 MiB ones on 2026-12-07e with a 47 MB tree), every other wheel the daemon, the front
# and the benchmarks need in .whl5 (its own call: with the last part it would not fit).
# Then device calls back to back (the machine stays warm ~30 s between calls):
#   carry [".part1"]:          mkdir -p /root/stage && cp .part1/* /root/stage/
#   carry [".partN"], N = 2..: cp .partN/* /root/stage/
#   carry [".whl5"]:           bash .whl5/install.sh && export PYTHONPATH=/tmp/site:$PWD && ...
# and, for bench/council_http.py (its seats are the official openai client, which the machine
# lacks), one more call before it:
#   carry [".whl6"]:           python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl6/*.whl
# install.sh installs the reassembled wheel and .whl5's in ONE pip command: a second
# `pip install --target --upgrade` of the `mlx` wheel replaces the `mlx/` folder that
# mlx-cuda-13 filled and loses libmlx.so.
#   bash tools/stage_device.sh
set -euo pipefail
MLX=${MLX_VERSION:-0.32.4}
MLXLM=${MLX_LM_VERSION:-0.32.2}
PART=${PART_BYTES:-14M}
cd "$(git rev-parse --show-toplevel)"
exclude() { grep -qx "/$1/" .git/info/exclude 2>/dev/null || echo "/$1/" >> .git/info/exclude; }
rm -rf .part[0-9]* .whl[0-9]*
for d in .whl5 .whl6; do exclude "$d"; mkdir -p "$d"; done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "$@"; }
plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get "${plat[@]}" -d "$tmp" "mlx-cuda-13==$MLX" "mlx==$MLX" "mlx-lm==$MLXLM" msgspec structlog pyzmq greenlet psutil \
  starlette uvicorn anyio h11 sniffio click prometheus-client typing_extensions idna
get --abi abi3 --platform manylinux_2_31_x86_64 -d "$tmp" llguidance
get "${plat[@]}" -d .whl6 openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore pydantic pydantic-core jiter \
  distro typing-inspection annotated-types
cuda=$(ls "$tmp"/mlx_cuda_13-*.whl)
name=$(basename "$cuda")
split -b "$PART" "$cuda" "$tmp/part_"
n=0
for part in $(ls "$tmp"/part_* | sort); do
  n=$((n + 1)); exclude ".part$n"; mkdir -p ".part$n"; mv "$part" ".part$n/"
done
rm "$cuda"
mv "$tmp"/*.whl .whl5/
cat > .whl5/install.sh <<INSTALL
#!/usr/bin/env bash
# Reassemble the wheel the calls before this one staged (.part1-.part$n) and install everything into /tmp/site.
set -e
here=\$(cd "\$(dirname "\$0")" && pwd)
test "\$(ls /root/stage/part_* | wc -l)" -eq $n || { echo "expected $n parts in /root/stage: \$(ls /root/stage)"; exit 1; }
cat \$(ls /root/stage/part_* | sort) > /root/stage/$name
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /root/stage/$name "\$here"/*.whl
PYTHONPATH=/tmp/site python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
INSTALL
chmod +x .whl5/install.sh
du -sh .part* .whl5 .whl6
