"""MLX's process-wide switches that decide what a new shape costs on CUDA, set before the
first forward.

Why (measured on the H200, MLX 0.32.4; bench/probes/attention_first_use.py):
- MLX's fused attention sends every query length > 1 to cuDNN when the head dimension is
  at most 128 (the bundled model's 64; a 27B Qwen3.5's 256 never goes there). cuDNN's
  execution plan is cached by the exact key length, strides and mask shape: the first call
  at a new key length costs 37-57 ms, the same shape again 0.12-0.28 ms. Every speculative cycle
  (the head's feed of 2+ positions, a verify) and every prompt remainder meets a key length
  it has not seen, so on cuDNN each pays a plan build: a depth-1 cycle cost ~10x a depth-0
  step and the governor, rightly, never speculated. With cuDNN off, MLX takes its vector
  kernel (1-3 queries, no mask array) or its matmul path: no plan, no first-use price.
- MLX's plan caches (cuDNN attention, CUDA graphs) count every miss since the process
  began and raise ``RuntimeError: Cache thrashing is happening`` after twice their
  capacity: a long-running daemon serving varied prompts would eventually hit it mid-request.
  A daemon turns that check off; a slower miss is better than a failed request.
- MLX compiles its CUDA kernels at first use and keeps the PTX under ``$TMPDIR/mlx``; a
  reboot (or a tmp cleaner) throws them away and the next start compiles again (99-145 s on
  a fresh H200 against 15-24 s warm). The daemon keeps them in its own cache folder, one per
  MLX version as MLX's own default is: a module's name stays when a new MLX changes its code.

MLX reads the first two once per process (a static, at the first attention of any thread),
so ``configure`` runs before the model loads; an operator's own environment value wins and
is reported as such. On CPU and Metal these variables are read by nothing.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

CUDNN_SDPA = "MLX_CUDA_USE_CUDNN_SDPA"
THRASHING_CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"
SDPA_CACHE_SIZE = "MLX_CUDA_SDPA_CACHE_SIZE"
PTX_CACHE_DIR = "MLX_PTX_CACHE_DIR"
# With cuDNN attention on (an operator's choice), the plan cache holds this many shapes: a
# prompt's full chunks take ~(context / chunk) key lengths, its remainder one more.
SDPA_PLANS_WITH_CUDNN = 1024


def ptx_cache_folder(cache_root: Path, environ=os.environ) -> Path:
    """Where MLX keeps its compiled CUDA modules for this daemon: the operator's
    MLX_PTX_CACHE_DIR where set (``configure`` keeps it), else ``<cache_root>/mlx-ptx/<mlx version>``."""
    if environ.get(PTX_CACHE_DIR):
        return Path(environ[PTX_CACHE_DIR])
    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:  # a source build of MLX: no distribution to ask
        version = "unknown"
    return cache_root / "mlx-ptx" / version


def configure(cudnn_attention: bool, ptx_cache: Path | None, environ=os.environ) -> dict:
    """Set MLX's shape-cost switches in ``environ`` where the operator has not; return
    {variable: (value, "set" | "operator")} for the start-up log."""
    wanted = {CUDNN_SDPA: "1" if cudnn_attention else "0", THRASHING_CHECK: "0"}
    if cudnn_attention:
        wanted[SDPA_CACHE_SIZE] = str(SDPA_PLANS_WITH_CUDNN)
    if ptx_cache is not None:
        wanted[PTX_CACHE_DIR] = str(ptx_cache)
    out = {}
    for name, value in wanted.items():
        if name in environ:
            out[name] = (environ[name], "operator")
        else:
            environ[name] = value
            out[name] = (value, "set")
    return out
