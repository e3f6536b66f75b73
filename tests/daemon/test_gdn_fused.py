"""The fused GatedDeltaNet recurrence (daemon/engine/kernels/gdn_fused.py, gdn_layer.py) on this CPU.

The kernel itself runs only on CUDA (bench/gdn_check.py checks it there against
``gated_delta_reference``). Here: that reference computes what mlx-lm's recurrence computes;
it is the same arithmetic token by token as in one call (the kernel's promise, which
exactness rests on); and the routing: once a model is installed on a recurrence, every
GatedDeltaNet forward the daemon runs (decode step, capture verify, mixed step, compiled step)
goes through it, which the exactness probes then prove on a model whose recurrence rounds
differently from mlx-lm's."""

from __future__ import annotations

import copy
import random

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.gated_delta import compute_g, gated_delta_ops  # noqa: E402

from daemon.engine.decoders.batch import batch_matches_serial  # noqa: E402
from daemon.engine.decoders.exactness import ragged_verify_matches_serial, verify_matches_serial  # noqa: E402
from daemon.engine.kernels import gdn_fused, gdn_layer  # noqa: E402
from daemon.engine.kernels.forward import gdn_conv_qkv, gdn_heads  # noqa: E402
from daemon.engine.model.compiled import enable_compiled_decode  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.prefill.mixed_forward import cache_states, mixed_hidden  # noqa: E402
from daemon.engine.prefill.prefill import prefill  # noqa: E402

pytestmark = pytest.mark.quick


def _inputs(B, T, Hk, Hv, Dk, Dv, seed=0):
    d = gdn_fused.sample_inputs(B, T, Hk, Hv, Dk, Dv, mx.bfloat16, mx.random.key(seed))
    return dict(d, A_log=mx.log(mx.random.uniform(1, 16, (Hv,), key=mx.random.key(seed + 1))), dt_bias=mx.ones((Hv,)))


def _ref(d, mask=None, all_states=False, state=None, **cut):
    d = {**d, **cut}
    return gdn_fused.gated_delta_reference(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"], d["dt_bias"],
                                           d["state"] if state is None else state, mask, all_states=all_states)


@pytest.mark.parametrize("shape", [(2, 3, 2, 4, 32, 16), (1, 5, 4, 4, 64, 64), (3, 1, 1, 3, 32, 8)])
def test_the_reference_computes_mlx_lms_recurrence(shape):
    d = _inputs(*shape)
    y, s = _ref(d)
    g = compute_g(d["A_log"], d["a"], d["dt_bias"])
    y_mlx, s_mlx = gated_delta_ops(d["q"], d["k"], d["v"], g, mx.sigmoid(d["b"]), d["state"])
    f = mx.float32
    assert mx.abs(y.astype(f) - y_mlx.astype(f)).max().item() <= 0.02 * mx.abs(y_mlx.astype(f)).max().item()
    # mlx-lm takes a + dt_bias and the softplus in bfloat16, the reference in float32: the
    # decay differs in bfloat16's last bits, so the states agree to about that.
    assert mx.abs(s - s_mlx).max().item() <= 0.01 * mx.abs(s_mlx).max().item()
    assert y.dtype == d["q"].dtype and s.dtype == mx.float32


def test_tokens_in_one_call_are_the_tokens_one_at_a_time_and_masked_tokens_keep_the_state():
    d = _inputs(3, 4, 2, 4, 32, 16, seed=3)
    y, s, every = _ref(d, all_states=True)
    state, ys = d["state"], []
    for t in range(4):
        yt, state = _ref(d, state=state, **{n: d[n][:, t:t + 1] for n in ("q", "k", "v", "a", "b")})
        ys.append(yt)
        assert mx.array_equal(every[:, t], state).item()
    assert mx.array_equal(mx.concatenate(ys, axis=1), y).item() and mx.array_equal(state, s).item()
    mask = mx.array([[True] * 4, [False, False, True, True], [False] * 4])
    ym, sm = _ref(d, mask)
    assert mx.array_equal(sm[2], d["state"][2]).item() and mx.array_equal(sm[0], s[0]).item()
    assert not mx.any(ym[1, :2]).item() and not mx.any(ym[2]).item()


def test_cuda_only_and_said_so_here(random_model_path):
    assert "not CUDA" in gdn_fused.backend_refusal()
    lm = load_model(random_model_path, compile_decode=False)
    assert lm.recurrence.startswith("mlx-lm: not CUDA") and not gdn_layer.installed(lm.text_module)
    assert load_model(random_model_path, compile_decode=False, fused_recurrence=False).recurrence == \
        'mlx-lm: configured (gdn_kernel = "off")'
    with pytest.raises(ValueError, match="cannot run here: not CUDA"):
        load_model(random_model_path, compile_decode=False, fused_recurrence=True)
    assert gdn_fused.shape_refusal(128, 128, 16, 48) is None
    assert "multiple of 32" in gdn_fused.shape_refusal(48, 128, 16, 48)
    assert "evenly" in gdn_fused.shape_refusal(128, 128, 5, 48)


@pytest.fixture(scope="module")
def routed(random_model_path):
    """The random model with every GatedDeltaNet layer on the reference recurrence, counted."""
    lm = load_model(random_model_path, compile_decode=False)
    calls = []

    def counted(*args, **kw):
        calls.append(args[0].shape[:2])
        return gdn_fused.gated_delta_reference(*args, **kw)

    n = gdn_layer.install(lm.text_module, counted)
    assert n == len(gdn_layer.layers(lm.text_module)) > 0 and gdn_layer.installed(lm.text_module)
    return lm, calls


def test_every_forward_the_daemon_runs_goes_through_the_installed_recurrence(routed):
    lm, calls = routed
    n_layers = len(gdn_layer.layers(lm.text_module))
    rng = random.Random(1)
    cache = lm.make_cache()
    prefill(lm, [rng.randrange(1, 200) for _ in range(9)], cache)  # short: the layer's own forward
    calls.clear()
    mx.eval(lm.hidden(mx.array([[5]]), cache))
    assert calls == [(1, 1)] * n_layers  # the decode step
    calls.clear()
    other = lm.make_cache()
    prefill(lm, [3, 4, 5], other)
    calls.clear()
    mx.eval(mixed_hidden(lm, [(mx.array([[7]]), copy.deepcopy(cache)), (mx.array([[8, 9]]), other)]))
    assert sorted(calls) == sorted([(1, 1), (1, 2)] * n_layers)  # each group of the mixed step
    calls.clear()
    # The compiled step traces the installed layers (its self-check then holds it to eager's
    # bits): the recurrence runs while tracing, at one token and at the check's verify length.
    assert enable_compiled_decode(lm) is None
    assert (1, 1) in calls and any(t > 1 for _, t in calls)
    lm.compiled_decode = None


def test_the_exactness_probes_pass_on_a_model_whose_recurrence_is_not_mlx_lms(routed):
    """The reference rounds unlike mlx-lm's ops (another gate arithmetic): a path that still
    ran mlx-lm's recurrence (a verify's capture, a batch) would break these bit-for-bit probes."""
    lm, _ = routed
    for key in ("_verify_matches_serial", "_batch_matches_serial", "_ragged_verify_matches_serial"):
        lm.__dict__.pop(key, None)
    assert verify_matches_serial(lm, "capture")
    assert verify_matches_serial(lm, "snapshot")
    assert batch_matches_serial(lm, 4)
    assert ragged_verify_matches_serial(lm)


def test_uninstall_puts_mlx_lms_layers_back(random_model_path):
    lm = load_model(random_model_path, compile_decode=False)
    cache = lm.make_cache()
    before = lm.hidden(mx.array([[1, 2, 3]]), cache)
    gdn_layer.install(lm.text_module, gdn_fused.gated_delta_reference)
    gdn_layer.uninstall(lm.text_module)
    assert not gdn_layer.installed(lm.text_module)
    assert all(type(m) in gdn_layer._BASES for m in gdn_layer.layers(lm.text_module))
    again = lm.make_cache()
    assert mx.array_equal(before, lm.hidden(mx.array([[1, 2, 3]]), again)).item()
    assert all(mx.array_equal(x, y).item() for x, y in zip(cache_states(cache), cache_states(again)))


def test_the_install_time_self_check_passes_the_reference_and_refuses_a_wrong_or_raising_kernel(random_model_path):
    lm = load_model(random_model_path, compile_decode=False)
    tm = lm.text_module
    assert gdn_layer.self_check(tm, gdn_fused.gated_delta_reference) is None

    def off(*args, **kw):  # a kernel whose readout is 5% off (4.5% once rounded to bfloat16)
        y, s = gdn_fused.gated_delta_reference(*args, **kw)
        return y * 1.05, s

    def per_call(*args, **kw):  # a kernel whose answer depends on how many tokens a call carries
        y, s = gdn_fused.gated_delta_reference(*args, **kw)
        return y, s + 1e-3 * args[0].shape[1]

    def raising(*args, **kw):
        raise RuntimeError("nvrtc: compilation failed")

    assert "off the reference: y by 0.04" in gdn_layer.self_check(tm, off)
    assert "state by" in gdn_layer.self_check(tm, per_call)
    assert gdn_layer.self_check(tm, raising) == \
        "the fused recurrence raised RuntimeError: nvrtc: compilation failed"

    calls = []

    def views_wrong(*args, **kw):  # right on contiguous inputs; the check's fourth call hands it views
        calls.append(1)
        y, s = gdn_fused.gated_delta_reference(*args, **kw)
        return (y, s) if len(calls) != 4 else (y, s * 1.01)

    assert "reads views of its inputs wrong" in gdn_layer.self_check(tm, views_wrong)


# The conv folded into the kernel (gated_delta_conv_fused): its reference, routing and check.

def _conv_inputs(attn, B, T, seed=0):
    ks = mx.random.split(mx.random.key(seed), 5)
    C, K = attn.conv_dim, attn.conv_kernel_size
    return {"qkv": mx.random.normal((B, T, C), key=ks[0]).astype(mx.bfloat16),
            "conv_state": mx.random.normal((B, K - 1, C), key=ks[1]).astype(mx.bfloat16),
            "a": mx.random.normal((B, T, attn.num_v_heads), key=ks[2]).astype(mx.bfloat16),
            "b": mx.random.normal((B, T, attn.num_v_heads), key=ks[3]).astype(mx.bfloat16),
            "state": mx.random.normal((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), key=ks[4]) * 0.1}


def _conv_ref(attn, d, mask=None, all_states=False, **cut):
    d = {**d, **cut}
    return gdn_fused.gated_delta_conv_reference(d["qkv"], d["conv_state"], attn.conv1d.weight, d["a"], d["b"],
                                                attn.A_log, attn.dt_bias, d["state"], mask,
                                                heads=gdn_heads(attn), all_states=all_states)


def test_the_folded_conv_reference_computes_mlx_lms_conv_and_normalisation(lm):
    attn = gdn_layer.layers(lm.text_module)[0]
    d = _conv_inputs(attn, 2, 3)
    q, k, v, conv_after = gdn_fused.conv_qkv_reference(d["qkv"], d["conv_state"], attn.conv1d.weight, None,
                                                       gdn_heads(attn))
    conv_input = mx.concatenate([d["conv_state"], d["qkv"]], axis=1)
    q_mlx, k_mlx, v_mlx = gdn_conv_qkv(attn, conv_input, 2, 3)  # bfloat16 between each op
    f = mx.float32
    for mine, theirs in ((q, q_mlx), (k, k_mlx), (v, v_mlx)):
        assert mine.dtype == f and mine.shape == theirs.shape
        assert mx.abs(mine - theirs.astype(f)).max().item() <= 0.02 * mx.abs(theirs.astype(f)).max().item()
    assert mx.array_equal(conv_after, conv_input[:, -(attn.conv_kernel_size - 1):]).item()


def test_the_folded_conv_reference_is_the_same_one_token_at_a_time_and_zeroes_padding(lm):
    attn = gdn_layer.layers(lm.text_module)[0]
    d = _conv_inputs(attn, 2, 4, seed=2)
    y, s, every, c = _conv_ref(attn, d, all_states=True)
    cs, st, ys = d["conv_state"], d["state"], []
    for t in range(4):
        yt, st, cs = _conv_ref(attn, d, conv_state=cs, state=st,
                               **{n: d[n][:, t:t + 1] for n in ("qkv", "a", "b")})
        ys.append(yt)
        assert mx.array_equal(every[:, t], st).item()
    assert mx.array_equal(mx.concatenate(ys, axis=1), y).item()
    assert mx.array_equal(st, s).item() and mx.array_equal(cs, c).item()
    # A padding row counts as zeros in the conv, as mlx-lm zeroes it before its conv.
    mask = mx.array([[True, False, True, True]] * 2)
    zeroed = d["qkv"] * mask[..., None].astype(d["qkv"].dtype)
    assert mx.array_equal(_conv_ref(attn, d, mask)[0], _conv_ref(attn, d, mask, qkv=zeroed)[0]).item()
    assert not mx.any(_conv_ref(attn, d, mask)[0][:, 1]).item()


@pytest.fixture(scope="module")
def folded(random_model_path):
    """The random model with the conv folded in: every GatedDeltaNet layer on the folded
    reference, counted."""
    lm = load_model(random_model_path, compile_decode=False)
    calls = []

    def counted(*args, **kw):
        calls.append(args[0].shape[:2])
        return gdn_fused.gated_delta_conv_reference(*args, **kw)

    assert gdn_layer.conv_refusal(lm.text_module) is None
    gdn_layer.install(lm.text_module, gdn_fused.gated_delta_reference, conv_recurrence=counted)
    assert gdn_layer.conv_folded(lm.text_module)
    return lm, calls


def test_every_forward_goes_through_the_folded_kernel_and_the_exactness_probes_pass(folded):
    lm, calls = folded
    n_layers = len(gdn_layer.layers(lm.text_module))
    cache = lm.make_cache()
    prefill(lm, list(range(3, 12)), cache)
    calls.clear()
    mx.eval(lm.hidden(mx.array([[5]]), cache))
    assert calls == [(1, 1)] * n_layers
    other = lm.make_cache()
    prefill(lm, [3, 4, 5], other)
    calls.clear()
    mx.eval(mixed_hidden(lm, [(mx.array([[7]]), copy.deepcopy(cache)), (mx.array([[8, 9]]), other)]))
    assert sorted(calls) == sorted([(1, 1), (1, 2)] * n_layers)
    calls.clear()
    for key in ("_verify_matches_serial", "_batch_matches_serial", "_ragged_verify_matches_serial"):
        lm.__dict__.pop(key, None)
    assert verify_matches_serial(lm, "capture") and verify_matches_serial(lm, "snapshot")
    assert batch_matches_serial(lm, 4) and ragged_verify_matches_serial(lm)
    assert any(t > 1 for _, t in calls)  # the capture verify took it too
    assert enable_compiled_decode(lm) is None  # the compiled step holds it to eager's bits
    lm.compiled_decode = None


def test_the_folded_conv_self_check_passes_the_reference_and_refuses_wrong_kernels(lm):
    tm = lm.text_module
    assert gdn_layer.conv_self_check(tm, gdn_fused.gated_delta_conv_reference) is None

    def stale_conv_state(*args, **kw):  # hands back the conv state it was given
        y, s, _ = gdn_fused.gated_delta_conv_reference(*args, **kw)
        return y, s, args[1]

    def ignores_padding(*args, **kw):
        return gdn_fused.gated_delta_conv_reference(*args[:8], None, **kw)

    calls = []

    def views_wrong(*args, **kw):  # its last call of the check hands it qkv contiguous
        calls.append(1)
        y, s, c = gdn_fused.gated_delta_conv_reference(*args, **kw)
        return (y, s, c) if len(calls) < 5 else (y, s * 1.001, c)

    assert "the conv state it leaves" in gdn_layer.conv_self_check(tm, stale_conv_state)
    assert "off the reference" in gdn_layer.conv_self_check(tm, ignores_padding)
    assert "reads views of its inputs wrong" in gdn_layer.conv_self_check(tm, views_wrong)
    attn = gdn_layer.layers(tm)[0]
    attn.conv_dim += 1
    try:
        assert "not depthwise" in gdn_layer.conv_refusal(tm)
    finally:
        attn.conv_dim -= 1


def test_load_model_folds_the_conv_where_its_check_passes_and_not_when_configured_off(random_model_path, monkeypatch):
    """load_model's choice, as on CUDA: the backend refusal lifted, the kernels replaced by
    their references (the checks then run the references, which pass)."""
    monkeypatch.setattr(gdn_fused, "backend_refusal", lambda: None)
    monkeypatch.setattr(gdn_fused, "gated_delta_conv_fused", gdn_fused.gated_delta_conv_reference)
    checks, conv_check = [], gdn_layer.conv_self_check
    monkeypatch.setattr(gdn_layer, "conv_self_check",
                        lambda tm: checks.append("conv") or conv_check(tm, gdn_fused.gated_delta_conv_reference))
    monkeypatch.setattr(gdn_layer, "self_check", lambda tm: checks.append("plain") or None)
    lm = load_model(random_model_path, compile_decode=False)
    assert lm.recurrence == "fused" and gdn_layer.conv_folded(lm.text_module) and checks == ["conv"]
    assert lm.linears.startswith("merged")
    checks.clear()
    off = load_model(random_model_path, compile_decode=False, fold_conv=False)
    assert off.recurrence == 'fused recurrence, conv in mlx ops: configured (gdn_conv_fold = "off")'
    assert gdn_layer.installed(off.text_module) and not gdn_layer.conv_folded(off.text_module)
    assert checks == ["plain"]


def test_rows_of_given_lengths_keep_the_conv_state_at_their_own_ends_when_folded(lm):
    """mlx-lm's batch caches may carry per-row lengths (``prepare``): the conv state then ends
    at each row's length, which the folded path takes outside its kernel, as mlx-lm's ops do."""
    from mlx_lm.models.cache import ArraysCache

    from daemon.engine.kernels.forward import gdn_mix

    attn = gdn_layer.layers(lm.text_module)[0]
    d = _conv_inputs(attn, 2, 4, seed=5)

    def run(folded: bool):
        cache = ArraysCache(2)
        cache[0], cache[1] = d["conv_state"], d["state"]
        cache.prepare(lengths=[2, 4])
        mask = cache.make_mask(4)
        attn.fused_conv_recurrence = gdn_fused.gated_delta_conv_reference if folded else None
        try:
            gdn_mix(attn, d["qkv"], d["a"], d["b"], mask, cache)
        finally:
            del attn.fused_conv_recurrence
        return cache[0]

    unfolded, folded = run(False), run(True)
    assert mx.array_equal(unfolded, folded).item()
    window = mx.concatenate([d["conv_state"], d["qkv"]], axis=1)
    assert mx.array_equal(folded[0], window[0, 2:2 + attn.conv_kernel_size - 1]).item()  # row 0 ends at 2
