"""Which kernel an invariant dense matmul takes, on the CPU: one row on MLX's gemv and more on
``ik.gemv_rows`` for a weight its bit check passed, the fixed-order kernel
for any other; and the check itself (``verify_gemv_rows``) accepts only a kernel whose every
row has the bits MLX gives that row alone. The CUDA kernels are replaced by recorders here
(they run only on a GPU: bench/probes/small_m_matmul_host.py checks and times the real one,
bench/device/gemv_rows_call.sh runs the fidelity gate on it)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from daemon.engine.kernels import invariant, invariant_kernels as ik

pytestmark = pytest.mark.quick


@pytest.fixture
def on_cuda(monkeypatch):
    """The CUDA backend as far as routing goes: the kernels record their calls and compute
    with a plain matmul (a row's bits then match MLX's CPU matmul of that row alone)."""
    calls: list[tuple[str, int]] = []

    def rows_kernel(x, w):
        calls.append(("gemv_rows", x.size // x.shape[-1]))
        return x @ w.T

    def fixed_kernel(**kw):
        x2, w = kw["inputs"]
        calls.append(("fixed", x2.shape[0]))
        return [x2 @ w.T]

    monkeypatch.setattr(ik, "backend", lambda: "cuda")
    monkeypatch.setattr(invariant, "backend", lambda: "cuda")
    monkeypatch.setattr(ik, "gemv_rows", rows_kernel)
    monkeypatch.setattr(ik, "_get_matmul_kernel", lambda: fixed_kernel)
    monkeypatch.setattr(ik, "GEMV_MATCHED", set())
    monkeypatch.setattr(ik, "GEMV_MISMATCHED", {})
    return calls


def _w(N=64, K=256, dtype=mx.bfloat16):
    return (mx.random.normal((N, K), key=mx.random.key(N + K)) * 0.05).astype(dtype)


def test_one_row_takes_mlx_s_gemv_and_more_rows_the_matched_kernel(on_cuda):
    w = _w()
    ik.GEMV_MATCHED.add(ik.gemv_key(w))
    x1 = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    assert mx.array_equal(ik.invariant_matmul(x1, w), x1 @ w.T)
    assert on_cuda == []  # no custom launch for one row
    y = ik.invariant_matmul(mx.ones((2, 3, 256), dtype=mx.bfloat16), w)
    assert y.shape == (2, 3, 64) and on_cuda == [("gemv_rows", 6)]
    # activations of another dtype than the checked weight's: not routed by the check's answer
    ik.invariant_matmul(mx.ones((1, 256), dtype=mx.float16), w)
    assert on_cuda[-1] == ("fixed", 1)


def test_a_weight_the_check_did_not_pass_stays_on_the_fixed_order_kernel_at_every_row_count(on_cuda):
    w = _w()
    for rows in (1, 4):
        ik.invariant_matmul(mx.ones((rows, 256), dtype=mx.bfloat16), w)
    assert on_cuda == [("fixed", 1), ("fixed", 4)]


def test_the_check_passes_a_kernel_with_gemv_s_bits_and_fails_one_without(on_cuda, monkeypatch):
    same, other = _w(64, 256), _w(32, 128)
    assert ik.verify_gemv_rows([same, same]) == {ik.gemv_key(same): None}
    assert ik.gemv_matched(same, mx.bfloat16) and not ik.gemv_matched(same, mx.float16)
    # One output of many rounded otherwise: refused, with what differed.
    monkeypatch.setattr(ik, "gemv_rows", lambda x, w: (x @ w.T) + mx.where(
        mx.arange(w.shape[0]) == 3, mx.array(2.0 ** -4, dtype=x.dtype), mx.array(0.0, dtype=x.dtype)))
    got = ik.verify_gemv_rows([other, same])
    assert list(got) == [ik.gemv_key(other)]  # ``same`` was decided before: not checked again
    assert "differ from MLX's gemv at 2 rows" in got[ik.gemv_key(other)]
    assert not ik.gemv_matched(other, mx.bfloat16) and ik.gemv_key(other) in ik.GEMV_MISMATCHED


def test_install_checks_every_swapped_dense_weight_and_says_what_it_found(on_cuda, monkeypatch):
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(256, 64, bias=False)
            self.down = nn.Linear(64, 32, bias=False)
            self.embed_tokens = nn.Embedding(48, 256)

    model = Tiny()
    model.update({"up": {"weight": model.up.weight.astype(mx.bfloat16)}})
    odd = ik.gemv_key(model.down.weight)
    real = ik.gemv_rows
    monkeypatch.setattr(ik, "gemv_rows", lambda x, w: real(x, w) * (2.0 if ik.gemv_key(w) == odd else 1.0))
    invariant.install(model)
    try:
        assert type(model.up) is invariant.InvariantLinear and type(model.embed_tokens) is invariant.InvariantEmbedding
        assert invariant.DENSE_ROWS["matched"] == ["48x256 float32", "64x256 bfloat16"]
        assert list(invariant.DENSE_ROWS["mismatched"]) == ["32x64 float32"]
        # A kernel that does not compile leaves every shape on the fixed-order kernel and says why.
        ik.GEMV_MATCHED.clear()
        ik.GEMV_MISMATCHED.clear()
        monkeypatch.setattr(ik, "gemv_rows", lambda x, w: (_ for _ in ()).throw(RuntimeError("nvrtc: error")))
        invariant.verify_dense_rows(model)
        assert invariant.DENSE_ROWS["matched"] == [] and "nvrtc: error" in invariant.DENSE_ROWS["error"]
    finally:
        invariant.uninstall(model)
