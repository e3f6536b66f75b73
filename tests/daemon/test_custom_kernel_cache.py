"""engine/kernels/mlx_custom_source.py and custom_kernel_cache.py: the daemon's custom CUDA
kernels written where MLX reads them. That MLX reads them and computes the same bits is
CUDA's to show (bench/probes/custom_kernel_cache.py on the device, bench/results); here, on
the CPU: the module name's parts (libstdc++'s string hash, MLX's generated text, its file
path), the daemon's kernels' texts, the files written whole, and that nothing happens off CUDA."""

from __future__ import annotations

import mlx.core as mx
import pytest

from daemon.config import Config
from daemon.engine.kernels import custom_kernel_cache as ckc
from daemon.engine.kernels import gdn_fused, invariant
from daemon.engine.kernels import mlx_custom_source as src

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

# std::hash<std::string> as g++ 12 / libstdc++ on x86_64 printed it for these strings.
LIBSTDCXX_HASHES = {
    "": 0x553E93901E462A6E,
    "a": 0x454DDEE488C1ED6B,
    "abcdefg": 0xDEEE6830A3AF82AF,
    "abcdefgh": 0x783DB3E38DB898BB,
    "abcdefghi": 0xB4EC9257851C8AAF,
}


def test_string_hash_is_libstdcxx():
    for text, want in LIBSTDCXX_HASHES.items():
        assert src.libstdcxx_hash(text.encode()) == want, text


def test_generated_text_follows_mlx_build_kernel():
    """custom_kernel.cpp's build_kernel, by hand: the fixed header, the kernel's header, the
    signature (shape and strides only for an input of 1+ dimensions that the source names),
    the template arguments as constants, the source."""
    source = "o[0] = a_shape[0] + a_strides[1] + b_shape[0];"
    func = src.kernel_name("t", [("T", src.DtypeName("float16")), ("N", 3), ("F", False)])
    assert func == "custom_kernel_t_float16_t_3_f"
    text = src.generated_source(func_name=func, header="// h\n", source=source, input_names=["a", "b"],
                                inputs=[(src.DtypeName("bfloat16"), 2), (src.DtypeName("float32"), 0)],
                                output_names=["o", "p"], output_dtypes=[src.DtypeName("float32"), src.DtypeName("int32")],
                                template=[("T", src.DtypeName("float16")), ("N", 3), ("F", False)])
    assert text == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n// h\n'
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_t_float16_t_3_f(\n"
        "    const __nv_bfloat16* a,\n"
        "    const __grid_constant__ Shape a_shape,\n"
        "    const __grid_constant__ Strides a_strides,\n"
        "    const float* b,\n"
        "    float* o,\n"
        "    int32_t* p) {\n"
        "  using T = __half;\n  constexpr int N = 3;\n  constexpr bool F = false;\n\n"
        + source + "\n}\n\n} // namespace mlx::core::cu\n")
    # No template arguments: no constants and no blank line before the source.
    bare = src.generated_source(func_name="custom_kernel_u", header="", source="o[0] = 1;", input_names=[], inputs=[],
                                output_names=["o"], output_dtypes=[src.DtypeName("uint32")], template=[])
    assert bare.endswith("__global__ void custom_kernel_u(\n    uint32_t* o) {\no[0] = 1;\n}\n\n} // namespace mlx::core::cu\n")
    assert src.module_name(func, text) == f"{func}_{src.libstdcxx_hash(text.encode()):x}"


def test_dtype_names_come_from_mlx_dtypes():
    assert src.DtypeName.of(mx.bfloat16) == "bfloat16"
    assert src.template_suffix([("X", True), ("Y", src.DtypeName.of(mx.float32)), ("Z", 12)]) == "_t_float_12"


def test_long_module_names_nest_as_mlx_does(tmp_path):
    short = "custom_kernel_x_1f"
    assert src.module_path(tmp_path, short) == tmp_path / (short + ".ptx")
    long = "k" * 600
    assert src.module_path(tmp_path, long) == tmp_path / ("k" * 245) / ("k" * 245) / ("k" * 110 + ".ptx")
    assert src.module_path(tmp_path, "k" * 490) == tmp_path / ("k" * 245) / ("k" * 245 + ".ptx")


def test_daemon_kernels_texts_name_their_strides_and_template():
    """A real kernel of the daemon (the folded conv recurrence, masked), its text from arrays
    as a call hands them over, without CUDA: made lazily, the MLX kernel is never built here."""
    inputs_, outputs_ = gdn_fused.kernel_names(masked=True, all_states=False, conv=True)
    kernel = ckc.cuda_kernel(name="councild_gdn_conv_mask", input_names=inputs_, output_names=outputs_,
                             source=gdn_fused.kernel_source(True, False, conv=True), ensure_row_contiguous=False)
    arrays = [mx.zeros((1, 2, 8), dtype=mx.bfloat16)] * 3 + [mx.zeros((1, 2, 2), dtype=mx.bfloat16)] * 2 + \
        [mx.zeros((2,), dtype=mx.float32)] * 2 + [mx.zeros((1, 2, 4, 4), dtype=mx.float32), mx.ones((1, 2), dtype=mx.bool_)]
    template = [("InT", mx.bfloat16), ("Dk", 32), ("Dv", 32), ("Hk", 1), ("Hv", 2), ("KC", 4), ("KEY", 32)]
    func, text = kernel.instantiation(arrays, template, [mx.bfloat16, mx.float32, mx.bfloat16])
    assert func == "custom_kernel_councild_gdn_conv_mask_bfloat16_t_32_32_1_2_4_32"
    assert "    const __nv_bfloat16* qkv,\n    const __grid_constant__ Shape qkv_shape,\n" in text
    assert "    const bool* mask,\n    const __grid_constant__ Strides mask_strides,\n" in text
    assert "  using InT = __nv_bfloat16;\n  constexpr int Dk = 32;\n" in text
    assert text.rstrip().endswith("} // namespace mlx::core::cu")
    # Another dtype is another module.
    _, other = kernel.instantiation([a.astype(mx.float16) if a.dtype == mx.bfloat16 else a for a in arrays],
                                    [("InT", mx.float16)] + template[1:], [mx.float16, mx.float32, mx.float16])
    assert src.module_name(func, text) != src.module_name(func.replace("bfloat16", "float16"), other)


def test_module_files_are_written_whole(tmp_path):
    path = src.module_path(tmp_path / "ptx", "custom_kernel_x_ab12")
    ckc.write_module(path, b"\x7fELF code", [("mlx::core::cu::custom_kernel_x", "_ZN3mlx4core2cu15custom_kernel_xEv")], "text")
    assert path.read_bytes() == b"\x7fELF code"
    assert path.with_suffix(".txt").read_text() == "mlx::core::cu::custom_kernel_x\t_ZN3mlx4core2cu15custom_kernel_xEv\n"
    assert path.with_suffix(".cu").read_text() == "text"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.stem + ".cu", path.name, path.stem + ".txt"]


def test_off_cuda_nothing_is_compiled_or_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    cache = ckc.CustomKernelCache()
    assert cache.may_write  # undecided until the first kernel call
    cache.ensure("custom_kernel_x", "text")
    assert cache.summary() == {"found": 0, "compiled": 0, "failed": 0, "compile_s": 0.0, "active": False}
    assert not cache.may_write  # decided: the kernel calls no longer key their instantiations
    assert list(tmp_path.iterdir()) == []
    assert invariant.backend() is None  # this test runs where the daemon's kernels do not


def test_the_folder_is_mlx_s(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "x"))
    assert ckc.ptx_folder() == tmp_path / "x"
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert ckc.ptx_folder() == tmp_path / "mlx" / mx.__version__ / "ptx"


def test_include_folders_follow_mlx(tmp_path):
    root = tmp_path / "site" / "mlx"
    (root / "include" / "cccl").mkdir(parents=True)
    (tmp_path / "site" / "nvidia" / "cu13" / "include").mkdir(parents=True)
    assert ckc.include_folders(root, 13, environ={}) == [root / "include", root / "include" / "cccl",
                                                         tmp_path / "site" / "nvidia" / "cu13" / "include"]
    assert ckc.include_folders(root, 12, environ={"CUDA_HOME": "/opt/cuda"})[-1] == ckc.Path("/opt/cuda/include")


def test_a_loaded_library_is_found_by_name():
    assert ckc.loaded_library("libc.so") is not None
    assert ckc.loaded_library("libnothing-councild") is None


def test_config_key():
    assert Config().custom_kernel_cache is True


class _BrokenCompiler:
    """An NVRTC whose compile raises what ctypes or the library might: any error at all."""

    def compile(self, *args, **kwargs):
        raise RuntimeError("nvrtc went away")


def test_a_failing_compile_is_logged_and_never_raised(tmp_path, monkeypatch):
    """What fails in the cache (here the compile) must leave the kernel call to MLX's own
    compile: ensure returns, counts the failure, and writes nothing."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    cache = ckc.CustomKernelCache()
    cache._ready, cache._nvrtc = True, _BrokenCompiler()
    cache.ensure("custom_kernel_x", "text")
    assert cache.counts == {"found": 0, "compiled": 0, "failed": 1}
    assert list(tmp_path.iterdir()) == []
    # A module already in the folder is counted as found and not compiled again.
    src.module_path(tmp_path, src.module_name("custom_kernel_x", "text")).write_bytes(b"code")
    cache.ensure("custom_kernel_x", "text")
    assert cache.counts == {"found": 1, "compiled": 0, "failed": 1}
