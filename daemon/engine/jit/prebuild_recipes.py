"""The ops that meet MLX's JIT-compiled CUDA modules, one recipe per module, on tiny arrays.

MLX-on-CUDA compiles (NVRTC) a module the first time an op needs it; the module's name and
code depend on dtypes and the op graph, never on sizes: a gather is ``gather_{T}_{I}_{n}``
(T the values' dtype, I the indices', n how many index arrays; every rank and index width is
in the one module), ``take_along_axis`` ``gather_axis_{T}_{I}``, an indexed assignment
``scatter_{T}_{I}_Assign_{n}``, and a fused ``mx.compile`` graph is named by its tape (each
op, its inputs' dtypes, whether the graph was traced shapeless) and a hash of its constants.
So running the same ops on arrays of two elements compiles the very module the model's first
step would. The list is what the bundled model's start and first requests compiled on the
H200 (bench/results/h200_2026-12-05/call2: 17 modules, 2.5-8 s each), one a council met on an
H100 and two read from the code (below); ``F`` stands for the model's float dtype. A recipe missing from here costs only what it cost before: MLX compiles
that module itself at first use.

Run one recipe: ``python -m daemon.engine.jit.prebuild_recipes "gather float32 int32 2" bfloat16``
(prebuild.py runs each in its own process, with its own MLX_PTX_CACHE_DIR)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

# Slowest first (an H100's 15 workers side by side, bench/results/h100_2026-12-06g: take_along_axis
# and the fused graphs 9-13 s from the daemon's start, the plain gathers 6-7 s): with fewer
# workers than recipes, the ones left to start last are the quick ones.
RECIPES = (
    # mlx.nn's softplus and silu, mlx-lm's compiled activations alone (shapeless: broadcasts in
    # the tape) and inside a traced step (mx.compile of a caller: no broadcasts).
    "fused softplus", "fused silu",
    "gather_axis float32 int32", "gather_axis F int32",
    "fused swiglu", "fused swiglu traced", "fused precise_swiglu", "fused precise_swiglu traced",
    # The gated attention's output, ``attn * sigmoid(gate)``, traced with its output projection
    # since the compiled step traces an attention around its middle (compiled._attention_parts):
    # a fresh H100's start compiled it itself, on the path to ready (bench/results/h100_2026-12-07).
    "fused gated traced",
    "scatter float32 int32 2", "gather float32 int32 2",
    "gather uint32 uint32 1", "gather F uint32 1",  # a quantized embedding's rows, by token id
    "gather float32 uint32 1", "gather F int32 1", "gather int32 int32 1", "gather float32 int32 1",
    "gather bool int32 1",
    # A ragged cache's row leaving a batch of two (ragged_cache.extract: keys[i:i+1, :, slots], the
    # slices' uint32 aranges and the int32 slots promote to int64): a council's first round
    # on an H100 stalled 3.6 s on it, every request waiting (bench/results/h100_2026-12-06g).
    "gather F int64 3",
    # Top logprobs (sampling.logprob_arrays: argpartition's and argsort's uint32 ids), by
    # reading the code: what the first request asking for logprobs would compile.
    "gather_axis float32 uint32", "gather_axis uint32 uint32",
)


# Modules neither the way to "ready" nor a council's first round meets: the top-logprobs gathers
# (a request asking for logprobs). The prebuild starts them last and the first forward does not
# wait for them: on a fresh H100 they were the last two workers of the second wave (11.7 s and
# ~12 s each, 1 MB of PTX), ready at 21-23.5 s of which they held the last ~4.5
# (bench/results/h100_2026-12-06i). Until they land, such a request compiles its module itself,
# as it did before the prebuild.
AFTER_READY = ("gather_axis float32 uint32", "gather_axis uint32 uint32")


# The daemon's own CUDA kernels (engine/kernels/custom_kernel_cache.py writes them where MLX
# reads them): a module per kernel, template arguments (head shapes) and input dtypes, so
# these recipes carry them, read from the model's config.json and its weights' headers
# (``custom_recipes``). On an H100 the bundled model's start compiled six, 1.4-2.8 s each,
# one after another on the path to ready (bench/results/h100_2026-12-06h).
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
GDN_TENSORS = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight")


def _stored_dtypes(model_path: Path, suffixes: tuple[str, ...]) -> dict[str, str]:
    """{suffix: dtype} of the first tensor whose name ends with each suffix, from the
    safetensors headers (a few KB each: no weight is read)."""
    found: dict[str, str] = {}
    for f in sorted(model_path.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size)) if 0 < size < 1 << 26 else {}
        except (OSError, ValueError):  # unreadable here: the loader will say so; no recipe from it
            continue
        for name, info in header.items():
            for s in suffixes:
                if s not in found and name.endswith(s) and isinstance(info, dict):
                    found[s] = SAFETENSORS_DTYPES.get(info.get("dtype"), "")
        if len(found) == len(suffixes):
            break
    return found


def custom_recipes(model_path: Path, config: dict, float_dtype: str) -> tuple[str, ...]:
    """The daemon's own kernels a start meets for this model (run by prebuild_custom.py): the
    folded-conv recurrence (plain, masked, every state) where the model has GatedDeltaNet
    layers, the fixed-order matmul, the gemv-matched rows (``gemv_rows``) and attention. A
    quantized model's fixed-order matmuls are not among them (a launch per layer shape and row
    count): each compiles at its first use and is then kept on disk. A shape or dtype read
    wrong here names a module the daemon never asks for: it then compiles its own at first
    use, as without the recipe."""
    text = config.get("text_config") or config
    out = [f"custom invariant_matmul {float_dtype}", f"custom gemv_rows {float_dtype}"]
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // heads if heads else 0)
    if head_dim:
        out.append(f"custom invariant_sdpa {float_dtype} {head_dim}")
    dims = [text.get(k) for k in ("linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                                  "linear_num_value_heads", "linear_conv_kernel_dim")]
    stored = _stored_dtypes(model_path, GDN_TENSORS) if all(isinstance(d, int) for d in dims) else {}
    if len(stored) == len(GDN_TENSORS) and all(stored.values()):
        spec = " ".join([float_dtype] + [stored[s] for s in GDN_TENSORS] + [str(d) for d in dims])
        out += [f"custom gdn_conv {variant} {spec}" for variant in ("plain", "mask", "all")]
    return tuple(out)


def recipes_for(float_dtype: str) -> tuple[str, ...]:
    """The recipes with F spelled out (a float32 model's repeat its float32 ones: kept once)."""
    return tuple(dict.fromkeys(r.replace(" F ", f" {float_dtype} ") for r in RECIPES))


def _mlx_lm_activations():
    """mlx-lm's activations module, read from its file: ``import mlx_lm.models.activations`` runs
    mlx_lm's package init, which imports transformers (1-14 s a process), for three functions
    that import only mlx. The tape, so the module's name, is the function's, whatever module
    holds it."""
    spec = importlib.util.find_spec("mlx_lm")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("mlx_lm is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "activations.py"
    module_spec = importlib.util.spec_from_file_location("_councild_prebuild_activations", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _fused(which: str, traced: bool, dtype) -> mx.array:
    a = mx.ones((2, 4), dtype=dtype)
    b = mx.ones((2, 4), dtype=dtype)
    if which in ("softplus", "silu"):
        fn = lambda g, x: getattr(nn, which)(g)  # noqa: E731
    elif which == "gated":  # mlx-lm's gated attention output: ``output * mx.sigmoid(gate)``
        fn = lambda out, gate: out * mx.sigmoid(gate)  # noqa: E731
    else:
        act = _mlx_lm_activations()
        fn = {"swiglu": lambda g, x: act.swiglu(g, x), "precise_swiglu": lambda g, x: act.precise_swiglu(x, g, x)}[which]
    return (mx.compile(fn) if traced else fn)(a, b)


def _dtype(name: str):
    return mx.bool_ if name == "bool" else getattr(mx, name)  # MLX spells it bool_; its modules, "bool"


def run(recipe: str, float_dtype: str) -> None:
    """Run ``recipe`` (one of ``recipes_for(float_dtype)``) and evaluate it on the default device."""
    kind, *args = recipe.split()
    dtypes = [_dtype(float_dtype if a == "F" else a) for a in args if not a.isdigit() and kind != "fused"]
    if kind == "gather":
        n = int(args[2])
        src = mx.zeros((2,) * n + (3,), dtype=dtypes[0])
        out = [src[tuple(mx.array([0, 1], dtype=dtypes[1]) for _ in range(n))]]
    elif kind == "gather_axis":
        out = [mx.take_along_axis(mx.zeros((2, 3), dtype=dtypes[0]), mx.array([[1], [0]], dtype=dtypes[1]), axis=-1)]
    elif kind == "scatter":
        n = int(args[2])
        dst = mx.zeros((2,) * n + (3,), dtype=dtypes[0])
        dst[tuple(mx.array([0, 1], dtype=dtypes[1]) for _ in range(n))] = mx.ones((2, 3), dtype=dtypes[0])
        out = [dst]
    elif kind == "fused":
        out = [_fused(args[0], args[-1] == "traced", getattr(mx, float_dtype))]
    else:
        raise ValueError(f"unknown recipe {recipe!r}")
    mx.eval(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python -m {__spec__.name} RECIPE FLOAT_DTYPE   (RECIPE one of: {', '.join(RECIPES)})")
    run(sys.argv[1], sys.argv[2])
