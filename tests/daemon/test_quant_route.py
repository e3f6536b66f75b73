"""Which kernel a quantized layer takes, on the CPU: the tensor-core kernel's layout rules
(engine/kernels/quant_mma.py), the per-layer route in engine/kernels/invariant_quant.py, and the speed route by
row count (engine/kernels/quant_route.py) with the CUDA kernel replaced by a recorder (the kernel itself
runs only on a GPU: bench/qmm_device.py; bench/results/qmm_h200_2026-12-03)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from daemon.engine.kernels import invariant, invariant_quant, quant_mma, quant_route
from daemon.engine_thread.kernel_choice import swap_kernels

pytestmark = pytest.mark.quick


def _layer(N=64, K=256, bits=4, gs=64, dtype=mx.bfloat16):
    mx.random.seed(4)
    q = nn.QuantizedLinear.from_linear(nn.Linear(K, N, bias=False), group_size=gs, bits=bits)
    q.update({k: v.astype(dtype) for k, v in q.parameters().items() if k in ("scales", "biases")})
    return q


@pytest.mark.parametrize("kw,needle", [
    (dict(x_dtype=mx.float32), "float32"), (dict(bits=2), "2-bit"), (dict(N=40), "multiples of 16"),
    (dict(K=192), "multiples of 128"), (dict(bits=8, K=96), "multiples of 64"), (dict(group_size=16), "group size"),
])
def test_the_tensor_core_kernel_refuses_what_it_cannot_take(kw, needle):
    args = dict(x_dtype=mx.bfloat16, N=64, K=256, group_size=64, bits=4) | kw
    why = quant_mma.mma_refusal(**args)
    assert why is not None and needle in why, why
    assert quant_mma.mma_refusal(mx.float16, 48, 5120, 64, 8) is None
    assert quant_mma.mma_refusal(mx.bfloat16, 248320, 5120, 32, 4) is None


def test_the_split_of_k_depends_on_the_shape_never_on_rows():
    """S is part of the summation order: one value per (N, K, bits), within the block limit."""
    for N, K, bits in ((17408, 5120, 4), (5120, 17408, 4), (48, 5120, 8), (1024, 256, 4)):
        s = quant_mma.split_for(N, K, bits)
        assert 1 <= s <= 16 and s & (s - 1) == 0
    # a layer whose column tiles alone fill the chip: WIDE_SPLIT warps, where each keeps 4 chunks
    assert quant_mma.split_for(248320, 5120, 4) == quant_mma.default_split(34816, 5120, 4) == quant_mma.WIDE_SPLIT
    assert quant_mma.split_for(34816, 5120, 4) == quant_mma.SPLITS[(34816, 5120, 4)]  # the table over the default
    assert quant_mma.split_for(248320, 1536, 4) == 3  # 12 chunks: 4 a warp
    assert quant_mma.split_for(248320, 1024, 4) == 1  # 8 chunks: fewer than 4 a warp at 3 warps
    assert quant_mma.tiles_for(1) == 1 and quant_mma.tiles_for(8) == 1 and quant_mma.tiles_for(9) == 2
    assert quant_mma.tiles_for(1000) == quant_mma.MAX_TILES


def test_the_shared_memory_feed_fits_a_blocks_static_shared_memory():
    """P (chunks in flight through shared memory) is speed only, but a block's static shared
    memory is 48 KB: the ring (S * P * NA slots of 1.5 KB) plus the warps' 2 KB of partial sums
    must fit, or the launch fails on the device."""
    for S in (1, 2, 4, 8, 16):
        for NA in (1, 2, 4):
            for wanted in (0, 2, 4, 8):
                P = quant_mma.stages_for(1, S, NA, wanted)
                assert 0 <= P <= wanted
                assert S * P * NA * 1536 + S * 32 * 4 * 4 <= 48 * 1024
    assert quant_mma.stages_for(1, 2, 1, 4) == 4 and quant_mma.stages_for(1, 8, 1, 4) == 3
    assert quant_mma.stages_for(1, 16, 1, 4) == 0  # one stage is no pipeline: the register feed
    assert quant_mma.stages_for(1, 2, 1) == quant_mma.STAGES_BY_TILES[1] > 0
    # 4- and 8-bit layers both launch with the table's stages (each checked on a GPU, same bits)
    quant_mma.forget_launches()
    for bits, K in ((4, 5120), (8, 17408)):
        launch = quant_mma._launch((1,), 5120, K, mx.bfloat16, bits, 64, None, None, None, None, None)
        assert dict(launch["template"])["P"] == quant_mma.STAGES_BY_TILES[1]


def test_a_narrow_layer_keeps_its_blocks_at_two_row_tiles():
    """Column tiles per warp are speed only; at 2 row tiles a layer keeps MIN_BLOCKS_BY_TILES
    blocks (the 27B's 5120 outputs: 320 tiles, one a warp), at 1 and 4 row tiles the table rules
    (measured: fewer blocks won at 32 rows), and a launch that asks for NA gets it."""
    floor = quant_mma.MIN_BLOCKS_BY_TILES[2]
    assert 5120 // 32 < floor <= 5120 // 16
    assert quant_mma.column_tiles_for(5120, 2, 8) == 1
    assert quant_mma.column_tiles_for(34816, 2, 4) == quant_mma.COLUMN_TILES_BY_TILES[2] == 2  # 1,088 blocks
    assert quant_mma.column_tiles_for(5120, 4, 4) == quant_mma.COLUMN_TILES_BY_TILES[4] == 4
    assert quant_mma.column_tiles_for(5120, 1, 8) == 1
    assert quant_mma.column_tiles_for(5120, 2, 8, wanted=2) == 2
    quant_mma.forget_launches()
    for rows in (9, 12, 16):  # the same launch at every count of 2 row tiles
        launch = quant_mma._launch((rows,), 5120, 17408, mx.bfloat16, 4, 64, None, None, None, None, None)
        assert dict(launch["template"])["NA"] == 1 and launch["grid"][0] == 32 * 8 * 320


def test_the_activations_prefetch_is_the_4_bit_shared_memory_feeds_at_few_row_tiles():
    """Loading the next chunk's activations ahead (template XPRE) is speed only and costs 12-20
    registers a lane (nvcc, sm_90): on for 4-bit launches of the shared-memory feed up to
    PREFETCH_TILES row tiles, never for the register feed or 8-bit; a launch that asks gets it."""
    limit = quant_mma.PREFETCH_TILES
    assert 1 <= limit <= 2
    assert quant_mma.prefetch_for(4, 1, 2) == 1 and quant_mma.prefetch_for(4, limit, 2) == 1
    assert quant_mma.prefetch_for(4, limit + 1, 2) == 0
    assert quant_mma.prefetch_for(4, 1, 0) == 0 and quant_mma.prefetch_for(8, 1, 2) == 0
    assert quant_mma.prefetch_for(4, 4, 2, wanted=1) == 1 and quant_mma.prefetch_for(4, 1, 2, wanted=0) == 0
    assert quant_mma.prefetch_for(4, 1, 0, wanted=1) == 0  # the register feed has no such path
    quant_mma.forget_launches()
    for rows, want in ((1, 1), (8, 1), (8 * limit + 1, 0)):
        launch = quant_mma._launch((rows,), 5120, 17408, mx.bfloat16, 4, 64, None, None, None, None, None)
        assert dict(launch["template"])["XPRE"] == want
    launch = quant_mma._launch((1,), 5120, 17408, mx.bfloat16, 8, 64, None, None, None, None, None)
    assert dict(launch["template"])["XPRE"] == 0


def test_tiled_scales_hold_a_column_tiles_pairs_contiguous_and_only_move_values():
    """quant_mma.tile_pairs: element (tile, pair, 2r + h) is row 16 tile + r's group 2 pair + h, so a
    warp's copy of one chunk's pairs for its 16 rows is contiguous; every value kept, none added
    (the kernel reads the same values from other addresses: the same bits, checked on the GPU by
    bench/qmm_graph.py --mode check). A launch of the tiled layout is its own template (SBT)."""
    N, G = 48, 10
    a = mx.arange(N * G).reshape(N, G)
    t = quant_mma.tile_pairs(a)
    assert t.shape == (N // 16, G // 2, 32)
    for tile, pair, r, h in ((0, 0, 0, 0), (1, 2, 5, 1), (2, 4, 15, 1), (2, 0, 7, 0)):
        assert t[tile, pair, 2 * r + h].item() == a[16 * tile + r, 2 * pair + h].item()
    assert sorted(t.reshape(-1).tolist()) == list(range(N * G))
    for bad in ((40, 10), (48, 9)):
        with pytest.raises(ValueError, match="multiple of 16 and G even"):
            quant_mma.tile_pairs(mx.zeros(bad))
    quant_mma.forget_launches()
    plain, tiled = (quant_mma._launch((1,), 5120, 17408, mx.bfloat16, 4, 64, None, None, None, None, None, None, t)
                    for t in (False, True))
    assert dict(plain["template"])["SBT"] == 0 and dict(tiled["template"])["SBT"] == 1
    assert {k: v for k, v in plain.items() if k != "template"} == {k: v for k, v in tiled.items() if k != "template"}


def test_registered_layers_hand_the_kernel_their_tiled_pairs_and_others_mlxs(monkeypatch):
    """quant_mma.tile_layers: a registered layer's call passes the tiled copies with SBT = 1, by the
    identity of the arrays the module passes (a compiled trace captures the same objects); a
    layer the kernel cannot read tiled, or any other array, keeps MLX's layout; forget_tiled
    frees them."""
    seen = []

    def kernel(inputs, template, output_shapes, output_dtypes, **launch):
        seen.append((inputs[2], inputs[3], dict(template)["SBT"]))
        return [mx.zeros(output_shapes[0], dtype=output_dtypes[0])]

    monkeypatch.setattr(quant_mma, "_get_kernel", lambda residual=False: kernel)
    quant_mma.forget_launches()
    tiled_layer, odd_layer = _layer(), nn.QuantizedLinear(64, 40, group_size=32, bits=4)  # 40 rows: no tiles of 16
    model = nn.Sequential(tiled_layer, odd_layer)
    try:
        assert quant_mma.tile_layers(model) == 1
        assert quant_mma.tile_layers(model) == 0  # registered once
        x = mx.zeros((1, 256), dtype=mx.bfloat16)
        s, b = tiled_layer["scales"], tiled_layer["biases"]
        quant_mma.quantized_matmul_mma(x, tiled_layer["weight"], s, b, 64, 4)
        got_s, got_b, sbt = seen[-1]
        assert sbt == 1 and got_s.shape == (s.shape[0] // 16, s.shape[1] // 2, 32)
        assert mx.array_equal(got_s, quant_mma.tile_pairs(s)).item() and mx.array_equal(got_b, quant_mma.tile_pairs(b)).item()
        with pytest.raises(ValueError, match="tiled=True takes tile_pairs"):  # MLX's layout said to be tiled
            quant_mma.quantized_matmul_mma(x, tiled_layer["weight"], s, b, 64, 4, tiled=True)
        copy = mx.array(s)  # the same values in another array: not the layer's
        quant_mma.quantized_matmul_mma(x, tiled_layer["weight"], copy, b, 64, 4)
        assert seen[-1][0] is copy and seen[-1][2] == 0
    finally:
        quant_mma.forget_tiled()
    quant_mma.quantized_matmul_mma(x, tiled_layer["weight"], s, b, 64, 4)
    assert seen[-1][0] is s and seen[-1][2] == 0


def test_invariant_quant_routes_a_layer_once_by_its_layout_and_dtype():
    lay = _layer()
    w, s, b = lay["weight"], lay["scales"], lay["biases"]
    xb = mx.zeros((3, 256), dtype=mx.bfloat16)
    assert invariant_quant._route("cuda", xb, w, s, b, 64, 4, False) == "mma"
    assert invariant_quant._route("cuda", xb[:1], w, s, b, 64, 4, False) == "mma"  # rows never decide
    assert invariant_quant._route("cuda", xb, w, s, b, 64, 4, True) == "scalar"
    assert invariant_quant._route("metal", xb, w, s, b, 64, 4, False) == "scalar"
    assert invariant_quant._route("cuda", xb.astype(mx.float32), w, s, b, 64, 4, False) == "scalar"
    assert "do not fit" in invariant_quant._route("cuda", xb, w, s, b, 32, 4, False)


@pytest.mark.parametrize("rows,want", [(1, True), (3, True), (6, True), (8, True), (12, False), (40, False)])
def test_the_speed_route_reads_the_measured_table(rows, want):
    assert quant_route.use_mma(17408, 5120, 4, rows) is want


def test_the_speed_route_keeps_mlx_for_one_row_of_8_bit_weights():
    """The 2026-12-06 H200 sweep: MLX's one-row 8-bit kernel beat the tensor-core kernel on every
    27B shape, which won from 2 rows; 4-bit: the kernel at every count up to 16."""
    for N, K in ((34816, 5120), (5120, 17408), (16480, 5120), (5120, 6144), (14336, 5120)):
        assert not quant_route.use_mma(N, K, 8, 1) and quant_route.use_mma(N, K, 8, 4)
        assert all(quant_route.use_mma(N, K, 4, r) for r in (1, 3, 12))


def test_a_shape_the_table_lacks_takes_the_nearest_measured_one_of_its_bits():
    assert quant_route.use_mma(16384, 5120, 4, 1) is quant_route.use_mma(17408, 5120, 4, 1) is True
    assert quant_route.use_mma(16384, 5120, 8, 1) is False  # 8-bit at one row: MLX's was faster
    assert quant_route.use_mma(64, 256, 4, 2) is quant_route.use_mma(48, 5120, 4, 2)


@pytest.fixture
def recorded_kernel(monkeypatch):
    """The process looks like CUDA and the tensor-core kernel records its calls (returning the
    reference's product, so the layer's output is still a product)."""
    calls = []

    def fake(x, w, scales, biases, group_size, bits, **launch):
        calls.append(x.size // x.shape[-1])  # the kernel's rows: every leading index of x [..., K]
        return invariant_quant.reference_quantized_matmul(x, w, scales, biases, group_size, bits)

    monkeypatch.setattr(invariant, "backend", lambda: "cuda")
    monkeypatch.setattr(quant_mma, "quantized_matmul_mma", fake)
    return calls


def test_routed_layers_take_the_kernel_only_at_the_rows_it_wins(recorded_kernel, monkeypatch):
    lay = _layer()
    monkeypatch.setitem(quant_route.MEASURED_FASTER, (64, 256, 4), (2, 4))
    quant_route.use_mma.cache_clear()
    model = nn.Sequential(lay)
    assert quant_route.install(model) == 1 and quant_route.installed(model)
    x = mx.random.normal((1, 40, 256)).astype(mx.bfloat16)
    mlx_out = {r: nn.QuantizedLinear.__call__(lay, x[:, :r]) for r in (1, 3, 20)}
    got = {r: lay(x[:, :r]) for r in (1, 3, 20)}
    assert recorded_kernel == [3]  # 1 row and 20 rows: MLX's; 3 rows (bucket 4): the kernel
    assert mx.array_equal(got[1], mlx_out[1]).item() and mx.array_equal(got[20], mlx_out[20]).item()
    ref = invariant_quant.reference_quantized_matmul(x[:, :3], lay.weight, lay.scales, lay.biases, 64, 4)
    assert mx.array_equal(got[3], ref).item()  # the recorder's product, not MLX's
    quant_route.uninstall(model)
    assert type(lay) is nn.QuantizedLinear
    quant_route.use_mma.cache_clear()


def test_float32_activations_stay_on_mlx_when_routed(recorded_kernel):
    lay = _layer(dtype=mx.float32)
    model = nn.Sequential(lay)
    quant_route.install(model)
    lay(mx.random.normal((2, 256)))
    assert recorded_kernel == []
    quant_route.uninstall(model)


def test_on_the_cpu_the_daemon_never_routes(tmp_path):
    """swap_kernels back to MLX's with routing asked: no CUDA here, so nothing is swapped and the
    kernels stay "mlx" (the verdicts cache key unchanged)."""
    from daemon.engine.model.loading import load_model
    from daemon.engine.model.random_model import build_random_model

    lm = load_model(build_random_model(tmp_path / "m", seed=5), compile_decode=False)
    nn.quantize(lm.text_module, group_size=32, bits=4)
    swap_kernels(lm, False, rows=2, compile_decode=False, route_quantized=True)
    assert lm.kernels == "mlx" and not quant_route.installed(lm.text_module)
