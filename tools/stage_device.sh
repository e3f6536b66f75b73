#!/usr/bin/env bash
# Stage MLX-on-CUDA for the lent GPU machine, which has no package index and takes at most
# 64 MiB a call, this repo's tracked tree (~38 MB) included: the mlx-cuda-13 wheel (~90 MB) goes
# in four ignored folders of <= 23 MB (.whl1-.whl4), every other wheel the daemon, the front and
# the benchmarks need in .whl5. Then four device calls back to back (the machine stays warm
# ~30 s between calls):
#   carry [".whl1"]:           mkdir -p /root/stage && cp .whl1/* /root/stage/
#   carry [".whl2"], [".whl3"]: cp .whlN/* /root/stage/
#   carry [".whl4", ".whl5"]:  bash .whl4/install.sh && export PYTHONPATH=/tmp/site:$PWD && ...
# and, for bench/council_http.py (its seats are the official openai client, which the machine
# lacks; .whl4 and .whl5 leave no room for it within 64 MiB), one more call before it:
#   carry [".whl6"]:           python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl6/*.whl
# install.sh installs the reassembled wheel and .whl5's in ONE pip command: a second
# `pip install --target --upgrade` of the `mlx` wheel replaces the `mlx/` folder that
# mlx-cuda-13 filled and loses libmlx.so.
#   bash tools/stage_device.sh
set -euo pipefail
MLX=${MLX_VERSION:-0.32.4}
MLXLM=${MLX_LM_VERSION:-0.32.2}
cd "$(git rev-parse --show-toplevel)"
for d in .whl1 .whl2 .whl3 .whl4 .whl5 .whl6; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
  rm -rf "$d"; mkdir -p "$d"
done
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
split -b 23M "$cuda" "$tmp/part_"
mv "$tmp/part_aa" .whl1/; mv "$tmp/part_ab" .whl2/; mv "$tmp/part_ac" .whl3/; mv "$tmp"/part_a? .whl4/
rm "$cuda"
mv "$tmp"/*.whl .whl5/
cat > .whl4/install.sh <<INSTALL
#!/usr/bin/env bash
# Reassemble the wheel staged by the calls before this one and install everything into /tmp/site.
set -e
here=\$(cd "\$(dirname "\$0")" && pwd)
cp "\$here"/part_a? /root/stage/
cat \$(ls /root/stage/part_a? | sort) > /root/stage/$name
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /root/stage/$name "\$here"/../.whl5/*.whl
PYTHONPATH=/tmp/site python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
INSTALL
chmod +x .whl4/install.sh
du -sh .whl1 .whl2 .whl3 .whl4 .whl5 .whl6
