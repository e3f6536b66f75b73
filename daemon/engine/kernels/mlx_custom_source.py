"""The text and module name MLX-on-CUDA gives a custom kernel (``mx.fast.cuda_kernel``), as MLX
0.32 builds them, so the daemon can put a kernel's compiled code where MLX looks for it.

Why: MLX keeps the code of its own CUDA modules on disk (``<MLX_PTX_CACHE_DIR>/<module>.ptx``
and ``.txt``) but compiles a custom kernel in every process and never writes it
(``custom_kernel.cpp`` asks ``get_jit_module`` for no disk cache). It does *read* the folder
first for every module, custom ones included (``JitModule``'s constructor). The daemon's own
kernels (the folded conv and GatedDeltaNet, the fixed-order matmuls and attention) cost 4.8 s
of NVRTC the first time in each process on an H100, most of a start with MLX's modules on disk,
and again 4.9-6.1 s at the first request (bench/results/h100_2026-12-06g). So the daemon writes
the files itself (engine/kernels/custom_kernel_cache.py) under the name MLX will ask for.

That name is ``custom_kernel_<name><template hash>_<std::hash of the generated text, hex>``.
The text is ``build_kernel`` of MLX's ``backend/cuda/custom_kernel.cpp``: a fixed header, the
kernel's own header, a signature from the inputs (dtype; shape, strides, ndim where the
source names ``<input>_shape`` and so on, for inputs of one or more dimensions), the outputs,
the template arguments as constants, the source. ``std::hash<std::string>`` is libstdc++'s
``_Hash_bytes`` (MurmurHash2, 64-bit, seed 0xc70f6907), which the Linux wheels link.
A text built differently from MLX's only costs the saved compile: MLX then asks for a name
no file has, and compiles as before. Nothing here imports mlx: dtypes are given by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

# MLX's dtype_to_cuda_type (backend/cuda/utils.cpp) and get_type_string (backend/common/compiled.cpp).
CUDA_TYPES = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
              "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
              "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
              "complex64": "mlx::core::cu::complex64_t"}
TYPE_STRINGS = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "float64": "double",
                "complex64": "complex64_t", "bool": "bool", "int8": "int8_t", "int16": "int16_t",
                "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t",
                "uint32": "uint32_t", "uint64": "uint64_t"}

DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
KERNEL_NAMESPACE = "mlx::core::cu::"
# A module name longer than this becomes nested folders (MLX's get_ptx_path).
MAX_FILE_NAME = 245

_HASH_SEED = 0xC70F6907
_HASH_MUL = 0xC6A4A7935BD1E995
_MASK = (1 << 64) - 1


class DtypeName(str):
    """A dtype by its MLX name ("bfloat16"); ``mx.bfloat16`` prints as "mlx.core.bfloat16"."""

    @classmethod
    def of(cls, dtype) -> "DtypeName":
        return cls(str(dtype).rsplit(".", 1)[-1])


TemplateValue = Union[bool, int, DtypeName]


def libstdcxx_hash(data: bytes) -> int:
    """``std::hash<std::string>`` of libstdc++ on a 64-bit machine (``_Hash_bytes``, hash_bytes.cc)."""

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    aligned = n & ~7
    h = (_HASH_SEED ^ (n * _HASH_MUL)) & _MASK
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h = ((h ^ ((shift_mix((word * _HASH_MUL) & _MASK) * _HASH_MUL) & _MASK)) * _HASH_MUL) & _MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _HASH_MUL) & _MASK
    h = (shift_mix(h) * _HASH_MUL) & _MASK
    return shift_mix(h)


def template_suffix(template: Sequence[tuple[str, TemplateValue]]) -> str:
    """``template_arguments_hash``: "_8_t_bfloat16_t" for (8, True, bfloat16)."""
    out = ""
    for _, value in template:
        if isinstance(value, bool):
            out += "_t" if value else "_f"
        elif isinstance(value, int):
            out += f"_{value}"
        else:
            out += "_" + TYPE_STRINGS[value]
    return out


def kernel_name(name: str, template: Sequence[tuple[str, TemplateValue]]) -> str:
    return "custom_kernel_" + name + template_suffix(template)


def shape_infos(source: str, input_names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    """Which of ``<input>_shape``, ``_strides``, ``_ndim`` the source names (``cuda_kernel``)."""
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def generated_source(*, func_name: str, header: str, source: str, input_names: Sequence[str],
                     inputs: Sequence[tuple[DtypeName, int]], output_names: Sequence[str],
                     output_dtypes: Sequence[DtypeName], template: Sequence[tuple[str, TemplateValue]]) -> str:
    """``build_kernel``: ``inputs`` as (dtype, ndim) in order."""
    text = DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {func_name}(\n"
    for name, (dtype, ndim), (shape, strides, ndims) in zip(input_names, inputs, shape_infos(source, input_names)):
        text += f"    const {CUDA_TYPES[dtype]}* {name},\n"
        if ndim > 0:
            text += f"    const __grid_constant__ Shape {name}_shape,\n" if shape else ""
            text += f"    const __grid_constant__ Strides {name}_strides,\n" if strides else ""
            text += f"    const __grid_constant__ int {name}_ndim,\n" if ndims else ""
    for i, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        text += f"    {CUDA_TYPES[dtype]}* {name}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    if template:
        for name, value in template:
            if isinstance(value, bool):
                text += f"  constexpr bool {name} = {'true' if value else 'false'};\n"
            elif isinstance(value, int):
                text += f"  constexpr int {name} = {value};\n"
            else:
                text += f"  using {name} = {CUDA_TYPES[value]};\n"
        text += "\n"
    return text + source + "\n}\n\n} // namespace mlx::core::cu\n"


def module_name(func_name: str, text: str) -> str:
    """``CustomKernel::eval_gpu``'s module name: ``fmt::format("{}_{:x}", name_, std::hash(source_))``."""
    return f"{func_name}_{libstdcxx_hash(text.encode()):x}"


def module_path(folder: Path, module: str) -> Path:
    """Where MLX reads a module's code (``get_ptx_path``); its names table is beside it, ``.txt``."""
    parts = [module[i:i + MAX_FILE_NAME] for i in range(0, len(module), MAX_FILE_NAME)] or [module]
    return folder.joinpath(*parts[:-1], parts[-1] + ".ptx")
