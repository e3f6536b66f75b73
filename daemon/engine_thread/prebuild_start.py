"""Starting the kernel prebuild's workers (engine/jit/prebuild.py) from the CLI, before its
serving imports, so they compile while the daemon imports and reads its weights; the engine's
start-up (startup.py) waits for them before the model's first forward."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

from ..engine.jit import backend_env
from ..engine.jit.prebuild import MIN_CORES, RECIPES, KernelPrebuild, model_float_dtype, worker_count
from ..engine.jit.prebuild_recipes import custom_recipes, recipes_for
from ..logs import get_logger
from ..paths import cache_dir

log = get_logger("councild.engine")


def start_kernel_prebuild(cfg, model_path: str) -> KernelPrebuild | None:
    """Start the workers that compile MLX's CUDA modules for the first steps while this
    process imports and reads its weights (engine/jit/prebuild.py); None where they do
    not apply: ``kernel_prebuild = "off"``, a group; unless "on": a backend other than CUDA, too
    few cores; no usable cache folder or model config. Called by the CLI before its heavy imports."""
    forced = cfg.kernel_prebuild == "on"
    if cfg.kernel_prebuild == "off" or cfg.distributed.enabled or not (forced or mx.cuda.is_available()):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not worker_count(len(RECIPES), cores, min_cores=1 if forced else MIN_CORES):
        log.info("kernels.prebuild", state="off", reason=f"{cores} cores: the workers would take the start's own")
        return None
    try:
        ptx = backend_env.ptx_cache_folder(cache_dir())
        config = json.loads((Path(model_path) / "config.json").read_text())
        dtype = model_float_dtype(config)
        # The daemon's own kernels too, where it keeps them on disk (custom_kernel_cache.py).
        custom = custom_recipes(Path(model_path), config, dtype) if cfg.custom_kernel_cache and mx.cuda.is_available() else ()
    except (OSError, ValueError) as exc:
        log.info("kernels.prebuild", state="off", reason=f"{type(exc).__name__}: {exc}")
        return None
    recipes = recipes_for(dtype) + custom
    workers = worker_count(len(recipes), cores, min_cores=1 if forced else MIN_CORES)
    log.info("kernels.prebuild", state="started", folder=str(ptx), workers=workers, float_dtype=dtype,
             custom_kernels=len(custom))
    prebuild = KernelPrebuild(ptx, dtype, workers, recipes=recipes)
    # The recipes "ready" does not wait for (prebuild_recipes.AFTER_READY) end behind it: said once.
    prebuild.on_finished = lambda final: log.info("kernels.prebuilt_after_ready", **final)
    return prebuild.start()
