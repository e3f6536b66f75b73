"""The daemon's custom CUDA kernels on disk: compiled once per machine, not once per process.

``cuda_kernel(...)`` stands in for ``mx.fast.cuda_kernel`` (same arguments, same call). The
first time a process calls a kernel with a new instantiation (template arguments, input and
output dtypes), it works out the module name MLX will ask for (engine/kernels/mlx_custom_source.py)
and, when MLX's folder has no such module, compiles the text with NVRTC (the library MLX
itself loads, through ctypes) and writes ``<module>.txt``, ``.cu`` and then ``<module>.ptx``,
which MLX reads instead of compiling (about as long as MLX's own compile, once per machine;
every later process and start finds it: bench/results/h100_2026-12-06h).

What is compiled is MLX's own text, with one difference: MLX gives NVRTC its device header
``mlx/backend/cuda/device/utils.cuh`` from memory (it is not in the wheel), and this module
gives under that name the part a custom kernel's signature needs: the same standard headers,
the wheel's ``config.h`` (``MAX_NDIM``), ``Shape`` and ``Strides`` as MLX defines them. The
daemon's kernels use nothing else from it; a kernel that did would fail to compile here, and
MLX would compile it as before. Flags are MLX's (``--device-as-default-execution-space``,
the device's ``sm_XYa`` SASS). Any failure (no NVRTC, no headers, a compile error, a folder
that cannot be written) is logged (``kernels.custom_cache_failed``, once per module) and
changes nothing else: MLX compiles the kernel itself, as it always did.

MLX on Metal and the CPU: the stand-in returns MLX's kernel and does nothing more.
"""

from __future__ import annotations

import ctypes
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import structlog

from . import mlx_custom_source as src

log = structlog.get_logger()

# MLX's folder variable (engine/jit/backend_env.py sets it for the daemon before the first forward).
PTX_CACHE_DIR = "MLX_PTX_CACHE_DIR"

# Under MLX's include name: what a custom kernel's generated signature needs (see the docstring).
SIGNATURE_HEADER = """#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda/std/complex>
#include <cuda/std/type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
} // namespace mlx::core::cu
"""
SIGNATURE_HEADER_NAME = "mlx/backend/cuda/device/utils.cuh"
# The MLX versions whose custom-kernel text and module name mlx_custom_source.py reproduces.
SUPPORTED_MLX = re.compile(r"^0\.32\.")


class CompileError(RuntimeError):
    pass


class Nvrtc:
    """The few NVRTC calls a compile needs, on the library MLX has loaded."""

    def __init__(self, lib_path: str):
        self.lib = ctypes.CDLL(lib_path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise CompileError(f"{what}: {self.lib.nvrtcGetErrorString(code).decode()}")

    def compile(self, text: str, file_name: str, kernel: str, headers: dict[str, str],
                options: list[str], sass: bool) -> tuple[bytes, str]:
        """(the cubin or PTX, the kernel's lowered name)."""
        prog = ctypes.c_void_p()
        names = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
        bodies = (ctypes.c_char_p * len(headers))(*[b.encode() for b in headers.values()])
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), file_name.encode(),
                                                len(headers), bodies, names), "nvrtcCreateProgram")
        try:
            self._check(self.lib.nvrtcAddNameExpression(prog, kernel.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            if self.lib.nvrtcCompileProgram(prog, len(options), opts) != 0:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                buf = ctypes.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(prog, buf)
                raise CompileError(f"{file_name}: {buf.value.decode(errors='replace')[:2000]}")
            lowered = ctypes.c_char_p()
            self._check(self.lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
            mangled = lowered.value.decode()
            kind = "CUBIN" if sass else "PTX"
            size = ctypes.c_size_t()
            self._check(getattr(self.lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"nvrtcGet{kind}Size")
            buf = ctypes.create_string_buffer(size.value)
            self._check(getattr(self.lib, f"nvrtcGet{kind}")(prog, buf), f"nvrtcGet{kind}")
            return buf.raw, mangled
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def loaded_library(fragment: str) -> str | None:
    """The path of a shared library this process has mapped whose file name holds ``fragment``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.strip() else ""
        if fragment in Path(path).name and "builtins" not in path:
            return path
    return None


def include_folders(mlx_root: Path, nvrtc_major: int, environ=os.environ) -> list[Path]:
    """NVRTC's include folders as MLX's ``include_path_args`` finds them."""
    folders = [p for p in (mlx_root / "include", mlx_root / "include" / "cccl") if p.exists()]
    cudart = mlx_root.parent / "nvidia" / ("cu13" if nvrtc_major >= 13 else "cuda_runtime") / "include"
    if not cudart.exists():
        home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH") or "/usr/local/cuda"
        cudart = Path(home) / "include"
    return folders + [cudart]


def ptx_folder(environ=os.environ) -> Path:
    """MLX's ``ptx_cache_dir``: $MLX_PTX_CACHE_DIR, else ``<temp>/mlx/<version>/ptx``."""
    if environ.get(PTX_CACHE_DIR):
        return Path(environ[PTX_CACHE_DIR])
    return Path(environ.get("TMPDIR") or "/tmp") / "mlx" / mx.__version__ / "ptx"


def write_module(path: Path, code: bytes, names: list[tuple[str, str]], text: str) -> None:
    """The names table and the text first, the code last and by rename: MLX takes a module
    whose ``.ptx`` exists, so a reader never meets a half-written one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".txt").write_text("".join(f"{n}\t{m}\n" for n, m in names))
    path.with_suffix(".cu").write_text(text)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".custom-", suffix=".part")
    with os.fdopen(fd, "wb") as f:
        f.write(code)
    os.replace(tmp, path)


class CustomKernelCache:
    """Decides once per process whether it can work (CUDA, a supported MLX, NVRTC), then
    compiles each new instantiation that MLX's folder lacks."""

    def __init__(self):
        self.enabled = True
        self._ready: bool | None = None
        self._lock = threading.Lock()
        self._nvrtc: Nvrtc | None = None
        self._options: list[str] = []
        self._sass = False
        self.counts = {"found": 0, "compiled": 0, "failed": 0}
        self.compile_s = 0.0

    @property
    def may_write(self) -> bool:
        """Enabled, and not found unable (off CUDA, another MLX, no NVRTC): the kernel calls
        stop keying their instantiations once it is not."""
        return self.enabled and self._ready is not False

    def configure(self, enabled: bool) -> None:
        self.enabled = enabled
        self._ready = None

    def summary(self) -> dict:
        """For the start-up log: modules found on disk, compiled here, failed; seconds compiling."""
        return {**self.counts, "compile_s": round(self.compile_s, 3), "active": bool(self._ready)}

    def _setup(self) -> bool:
        if not self.enabled or mx.default_device() != mx.gpu or mx.metal.is_available() or not mx.cuda.is_available():
            return False
        if not SUPPORTED_MLX.match(mx.__version__):
            log.info("kernels.custom_cache_off", reason=f"MLX {mx.__version__}: its custom-kernel names are not known here")
            return False
        lib = loaded_library("libnvrtc.so")
        if lib is None:
            return self.fail("MLX has no NVRTC library loaded")
        self._nvrtc = Nvrtc(lib)
        info = mx.device_info()
        major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
        # MLX's compiler_supports_device_sass: NVRTC 11.8 and later compile SASS for any device.
        self._sass = self._nvrtc.version >= (11, 8)
        arch = f"{'sm' if self._sass else 'compute'}_{major}{minor}{'a' if major >= 9 else ''}"
        mlx_root = Path(mx.__file__).parent
        self._options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}"]
        self._options += [f"--include-path={p}" for p in include_folders(mlx_root, self._nvrtc.version[0])]
        return True

    def fail(self, reason: str) -> bool:
        self.counts["failed"] += 1
        log.warning("kernels.custom_cache_failed", reason=reason)
        return False

    def ensure(self, func_name: str, text: str) -> None:
        """Put this instantiation's module where MLX will look, unless it is there."""
        with self._lock:
            if self._ready is None:
                try:
                    self._ready = self._setup()
                except Exception as e:  # a broken NVRTC or device query: MLX compiles as before
                    self._ready = self.fail(f"setup: {e}")
            if not self._ready:
                return
            module = src.module_name(func_name, text)
            path = src.module_path(ptx_folder(), module)
            if path.exists():
                self.counts["found"] += 1
                return
            started = time.perf_counter()
            try:
                code, mangled = self._nvrtc.compile(text, module + ".cu", src.KERNEL_NAMESPACE + func_name,
                                                    {SIGNATURE_HEADER_NAME: SIGNATURE_HEADER}, self._options, self._sass)
                write_module(path, code, [(src.KERNEL_NAMESPACE + func_name, mangled)], text)
            except Exception as e:  # noqa: BLE001 - NVRTC, ctypes or the folder: MLX compiles it itself
                self.fail(f"{module}: {type(e).__name__}: {e}")
                return
            took = time.perf_counter() - started
            self.compile_s += took
            self.counts["compiled"] += 1
            log.info("kernels.custom_compiled", module=module, seconds=round(took, 3))


CACHE = CustomKernelCache()


def _template_value(value: Any) -> src.TemplateValue:
    return value if isinstance(value, (bool, int)) else src.DtypeName.of(value)


class CachedCudaKernel:
    """``mx.fast.cuda_kernel``'s function, which first makes sure its module is on disk."""

    def __init__(self, *, name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, shared_memory: int = 0):
        self._spec = dict(name=name, input_names=input_names, output_names=output_names, source=source, header=header)
        self._options = dict(ensure_row_contiguous=ensure_row_contiguous, shared_memory=shared_memory)
        self._mlx_kernel = None  # made at the first call: MLX refuses to make one without CUDA
        self._seen: set = set()

    @property
    def _kernel(self):
        if self._mlx_kernel is None:
            self._mlx_kernel = mx.fast.cuda_kernel(**self._spec, **self._options)
        return self._mlx_kernel

    def instantiation(self, inputs, template, output_dtypes) -> tuple[str, str]:
        """(the kernel's name, MLX's text) for one call."""
        arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        targs = [(n, _template_value(v)) for n, v in (template or [])]
        func = src.kernel_name(self._spec["name"], targs)
        text = src.generated_source(func_name=func, header=self._spec["header"], source=self._spec["source"],
                                    input_names=self._spec["input_names"],
                                    inputs=[(src.DtypeName.of(a.dtype), a.ndim) for a in arrays],
                                    output_names=self._spec["output_names"],
                                    output_dtypes=[src.DtypeName.of(d) for d in output_dtypes], template=targs)
        return func, text

    def __call__(self, *, inputs, output_dtypes, template=None, **launch):
        if CACHE.may_write:
            # Every call of a kernel comes here (an eager step: every layer's): the key is the
            # dtypes themselves, not their names (2.6 against 12 us a call on this CPU).
            key = (tuple((getattr(x, "dtype", type(x)), getattr(x, "ndim", 0) > 0) for x in inputs),
                   tuple(map(tuple, template or ())), tuple(output_dtypes))
            if key not in self._seen:
                self._seen.add(key)
                try:
                    CACHE.ensure(*self.instantiation(inputs, template, output_dtypes))
                except Exception as e:  # noqa: BLE001 - never a request's failure: MLX compiles as before
                    CACHE.fail(f"{self._spec['name']}: {type(e).__name__}: {e}")
        return self._kernel(inputs=inputs, output_dtypes=output_dtypes, template=template, **launch)


def cuda_kernel(**spec) -> CachedCudaKernel:
    """``mx.fast.cuda_kernel`` with its compiled code kept on disk (see the module docstring)."""
    return CachedCudaKernel(**spec)
