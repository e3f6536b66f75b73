"""speculative_decode: token identity with serial decode, head history, depth changes."""

from __future__ import annotations

import itertools
import random

import mlx.core as mx
import pytest

from daemon.engine.model.mtp_head import copy_head_tensors, load_mtp_head
from daemon.engine.decoders.rollback import STRATEGIES, attention_offset
from daemon.engine.decoders.sampling import Sampler
from daemon.engine.decoders.serial import serial_decode
from daemon.engine.caches.head_history import HeadHistory
from daemon.engine.decoders.speculative import speculative_decode
from daemon.engine.types import SamplingParams

from model_helpers import make_copy_head

PROMPTS = ["def load(path):\n    with open(path) as f:", "import json\n\nclass Encoder:", "x"]


@pytest.fixture(scope="module")
def copy_head(lm, tmp_path_factory):
    return make_copy_head(lm, tmp_path_factory.mktemp("copyhead"))


def serial(lm, prompt, n, params=SamplingParams()):
    steps = itertools.islice(serial_decode(lm, prompt, Sampler(params)), n)
    return [t for s in steps for t in s.tokens]


def spec(lm, head, prompt, n, depth, params=SamplingParams(), **kw):
    out, steps = [], []
    for s in speculative_decode(lm, head, prompt, Sampler(params), depth, **kw):
        out += s.tokens
        steps.append(s)
        assert len(s.tokens) == s.accepted + 1 and len(s.accepted_mask) == s.drafted
        if len(out) >= n:
            return out[:n], steps


@pytest.mark.quick
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exact_is_token_identical_with_the_real_head(lm, head, strategy):
    for text in PROMPTS[:2]:
        prompt = lm.tokenizer.encode(text)
        ref = serial(lm, prompt, 24)
        for k in (1, 2, 3, 4):
            got, _ = spec(lm, head, prompt, 24, k, rollback=strategy)
            assert got == ref, (text, k)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accepting_head_is_token_identical_and_accepts(lm, copy_head, strategy):
    partial = full = 0
    for text in PROMPTS:
        prompt = lm.tokenizer.encode(text)
        ref = serial(lm, prompt, 40)
        for k in (1, 2, 3, 4):
            for exact in (True, False):
                got, steps = spec(lm, copy_head, prompt, 40, k, exact=exact, rollback=strategy)
                assert got == ref, (text, k, exact)
                partial += sum(0 < s.accepted < s.drafted for s in steps)
                full += sum(s.accepted == s.drafted for s in steps)
    assert partial > 0 and full > 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_depth_may_change_every_cycle_and_head_history_stays_paired(lm, copy_head, pipeline, monkeypatch):
    import daemon.engine.decoders.speculative as speculative

    monkeypatch.setattr(speculative, "PIPELINE_MIN_FULL", 0.0)  # build ahead at every chance
    monkeypatch.setattr(speculative, "PIPELINE_MIN_CYCLE_S", 0.0)
    prompt = lm.tokenizer.encode(PROMPTS[0])
    ref = serial(lm, prompt, 60)
    rng = random.Random(7)
    depths = iter([rng.choice([0, 0, 1, 2, 3, 4]) for _ in range(200)])
    cache = lm.make_cache()
    hist = HeadHistory(copy_head)
    got, steps = spec(lm, copy_head, prompt, 60, lambda: next(depths), cache=cache, history=hist, pipeline=pipeline)
    assert got == ref
    assert {s.depth for s in steps} >= {0, 1, 2, 3, 4}
    # A cycle at another depth than the stream's last (or its first) is a transition: the
    # governor books its acceptance, not its cost (governor/cost_model.py).
    assert [s.transition for s in steps] == [i == 0 or s.depth != steps[i - 1].depth for i, s in enumerate(steps)]
    produced = [t for s in steps for t in s.tokens]
    tokens = prompt + produced
    P = len(tokens) - 1  # base positions decided: the last committed token is not forwarded yet
    if pipeline:
        # The next cycle may already run (built on a full accept): its drafts sit in
        # speculative head slots past the committed ones (or a serial step is issued ahead).
        assert hist.offset + hist.n >= P and attention_offset(cache) >= P
        hist.feed(keep_last=False)
    else:
        # Invariant: committed head slots + queued pairs cover every base position.
        assert hist.offset + hist.n == P == attention_offset(cache)
        hist.feed(keep_last=False)
    mx.eval(hist.state())
    # Slot S holds (base hidden at S, real token S+1): recompute the whole history.
    base_h = lm.hidden(mx.array([tokens[:P]]), lm.make_cache())
    ref_cache = copy_head.make_cache()
    copy_head(base_h, mx.array([tokens[1 : P + 1]]), ref_cache)
    for a, b in zip(hist.cache, ref_cache):
        assert a.offset >= P and b.offset == P
        ka, kb = a.keys[..., :P, :].astype(mx.float32), b.keys[..., :P, :].astype(mx.float32)
        assert mx.allclose(ka, kb, atol=5e-2), mx.abs(ka - kb).max().item()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3),
                                    SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3, logprobs=True,
                                                   top_logprobs=2)])
def test_building_cycles_ahead_commits_what_building_them_after_does(lm, copy_head, head, params, monkeypatch):
    """The pipeline (next cycle built on the guess of a full accept, undone when wrong)
    commits the same tokens, cycle by cycle, as building each cycle after the last."""
    import daemon.engine.decoders.speculative as speculative

    # Build ahead whatever the acceptance and however short the cycles (this CPU is slow or
    # fast); count the builds ahead and the undos through the cache marks they take.
    monkeypatch.setattr(speculative, "PIPELINE_MIN_FULL", 0.0)
    monkeypatch.setattr(speculative, "PIPELINE_MIN_CYCLE_S", 0.0)
    counts = {"built": 0, "undone": 0}

    class CountingMark(speculative.CacheMark):
        def __init__(self, caches):
            counts["built"] += 1
            super().__init__(caches)

        def restore(self):
            counts["undone"] += 1
            super().restore()

    monkeypatch.setattr(speculative, "CacheMark", CountingMark)
    prompt = lm.tokenizer.encode(PROMPTS[1])
    full = partial = 0
    for h, k in ((copy_head, 1), (copy_head, 2), (copy_head, 4), (head, 2)):
        steps = {}
        for pipeline in (False, True):
            _, s = spec(lm, h, prompt, 40, k, params=params, pipeline=pipeline)
            steps[pipeline] = [(x.tokens, x.depth, x.accepted, x.guarded, x.logprobs) for x in s]
        assert steps[True] == steps[False]
        full += sum(acc == d for _, d, acc, _, _ in steps[True])
        partial += sum(acc < d for _, d, acc, _, _ in steps[True])
    assert full > 0 and partial > 0
    # Both ways out were taken: a prebuilt cycle run, and one undone.
    assert counts["built"] > counts["undone"] > 0


class _ScriptedClock:
    """``time`` for speculative.py: each loop iteration reads perf_counter twice (its start,
    then its end), so an iteration's cycle_s is the script's next value (the last repeats)."""

    def __init__(self, cycle_s: list[float]):
        self.script, self.now, self.reads = list(cycle_s), 0.0, 0

    def perf_counter(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # an iteration's end
            self.now += self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return self.now


@pytest.mark.parametrize("first_steady_s, then_s, most_builds", [(1.0, 0.001, 1), (0.02, 0.02, None)])
def test_a_slow_first_cycle_does_not_keep_building_ahead_where_cycles_are_short(
        lm, copy_head, monkeypatch, first_steady_s, then_s, most_builds):
    """Building ahead follows the shortest of a request's recent steady cycles against
    PIPELINE_MIN_CYCLE_S (10 ms): one slow cycle (a first use) opens it for a cycle at most,
    where a running mean kept it open for dozens; cycles at 20 ms keep it open."""
    import daemon.engine.decoders.speculative as speculative

    monkeypatch.setattr(speculative, "PIPELINE_MIN_FULL", 0.0)  # the cycle time alone decides
    counts = {"built": 0}

    class CountingMark(speculative.CacheMark):
        def __init__(self, caches):
            counts["built"] += 1
            super().__init__(caches)

    monkeypatch.setattr(speculative, "CacheMark", CountingMark)
    # The first cycle is a transition (not booked), the second the first steady one.
    monkeypatch.setattr(speculative, "time", _ScriptedClock([0.5, first_steady_s, then_s]))
    prompt = lm.tokenizer.encode(PROMPTS[0])
    got, steps = spec(lm, copy_head, prompt, 48, 2, pipeline=True)
    assert got == serial(lm, prompt, 48)
    assert len(steps) > 12
    if most_builds is not None:
        assert counts["built"] <= most_builds
    else:
        assert counts["built"] >= len(steps) - 3  # every cycle after the first steady one


def test_exact_guard_absorbs_kernel_rounding_fast_does_not(lm, copy_head):
    """logit_jitter stands in for M=1 vs M>=2 rounding differences in the verify."""
    exact_guarded = 0
    fast_diverged = 0
    for text in PROMPTS:
        prompt = lm.tokenizer.encode(text)
        ref = serial(lm, prompt, 40)
        for k in (1, 3):
            got, steps = spec(lm, copy_head, prompt, 40, k, exact=True, logit_jitter=0.01)
            assert got == ref
            exact_guarded += sum(s.guarded for s in steps)
            got_fast, _ = spec(lm, copy_head, prompt, 40, k, exact=False, logit_jitter=0.5)
            fast_diverged += got_fast != ref
    assert exact_guarded > 0 and fast_diverged > 0


def test_exact_without_the_guard_is_token_identical_where_verify_is_bit_identical(lm, copy_head, head):
    """guard_margin=None (what the daemon runs where the exactness probe passes, as on CPU):
    no position is re-decided serially, and the tokens are still serial's."""
    for h in (head, copy_head):
        for text in PROMPTS[:2]:
            prompt = lm.tokenizer.encode(text)
            ref = serial(lm, prompt, 32)
            for k in (1, 2, 4):
                got, steps = spec(lm, h, prompt, 32, k, exact=True, guard_margin=None)
                assert got == ref, (text, k)
                assert not any(s.guarded for s in steps)


def test_one_token_prompt_and_no_head(lm, head):
    ref = serial(lm, [17], 12)
    got, steps = spec(lm, head, [17], 12, 2)
    assert got == ref and steps[0].depth == 0 and steps[1].depth == 2
    got, steps = spec(lm, None, lm.tokenizer.encode(PROMPTS[1]), 12, 3)
    assert got == serial(lm, lm.tokenizer.encode(PROMPTS[1]), 12) and all(s.depth == 0 for s in steps)


def test_sampling_runs_and_commits_accept_plus_one(lm, copy_head):
    params = SamplingParams(temperature=0.8, top_k=20, seed=3)
    prompt = lm.tokenizer.encode(PROMPTS[0])
    out, steps = spec(lm, copy_head, prompt, 40, 3, params=params)
    assert len(out) == 40 and all(0 <= t < lm.text_args.vocab_size for t in out)
    again, _ = spec(lm, copy_head, prompt, 40, 3, params=params)
    assert again == out  # the request's seed reproduces it


def test_auto_rollback_is_capture_off_metal():
    from daemon.engine.decoders.speculative import resolve_rollback

    on_metal = mx.default_device() == mx.gpu and mx.metal.is_available()
    assert resolve_rollback("auto") == ("snapshot" if on_metal else "capture")
    assert resolve_rollback("snapshot") == "snapshot" and resolve_rollback("capture") == "capture"


def test_head_unloaded_mid_request_falls_back_to_serial(lm, tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    mx.save_safetensors(str(folder / "mtp.safetensors"), copy_head_tensors(lm.config["text_config"]), metadata={"format": "pt"})
    head = load_mtp_head(lm, folder=folder)
    prompt = lm.tokenizer.encode(PROMPTS[0])
    ref = serial(lm, prompt, 40)
    hist = HeadHistory(head)
    out, depths = [], []
    for s in speculative_decode(lm, head, prompt, Sampler(SamplingParams()), 3, history=hist):
        out += s.tokens
        depths.append(s.depth)
        if len(depths) == 3:
            head.unload()  # the governor evicted it between two cycles
        if len(out) >= 40:
            break
    assert out[:40] == ref
    assert depths[:3] == [3, 3, 3] and set(depths[3:]) == {0}
    assert hist.n <= 1  # no history piles up once the head is gone


def test_near_tie_flags_what_a_top2_partial_sort_flags():
    """Exact mode's guard without mx.topk: same flags, ties included."""
    from daemon.engine.decoders.sampling import near_tie

    for trial in range(30):
        lp = mx.random.normal((3, 64), key=mx.random.key(trial)).astype(mx.bfloat16)
        if trial % 2:
            lp = mx.round(lp * 2) / 2  # many exact ties
        logits = lp * 3
        top2 = mx.topk(lp.astype(mx.float32), 2, axis=-1)
        scale = mx.maximum(mx.abs(logits.max(axis=-1).astype(mx.float32)), 1.0)
        for margin in (0.0, 2.0**-5, 0.3):
            want = (top2.max(axis=-1) - top2.min(axis=-1)) <= margin * scale
            assert near_tie(lp, logits, margin).tolist() == want.tolist()


def _prefilled(lm, head, tokens: list[int]):
    """A chunked prefill of ``tokens`` (all but the last) with a head history, run to its end."""
    from daemon.engine.prefill.prefill import ChunkedPrefill

    pre = ChunkedPrefill(lm, tokens, 16, lm.make_cache(), HeadHistory(head))
    while pre.step():
        pass
    return pre


def test_serial_decode_keeps_a_head_history_in_step_that_its_continuation_stores(lm, head):
    """Before the verify verdict an exact request decodes serially with its prefill's head
    history (decode_paths.begin_decode): the tokens are serial decode's, bit for bit; the
    history stays at the cache's position (past a feed every HISTORY_FEED_EVERY pairs), so the
    continuation keeps it; and the head holds what a prefill of the same tokens gives it."""
    from daemon.engine.caches.prefix_cache import PrefixCache, cache_offset
    from daemon.engine.decoders.serial import HISTORY_FEED_EVERY

    prompt = lm.tokenizer.encode(PROMPTS[0])
    n = HISTORY_FEED_EVERY + 9
    ref = serial(lm, prompt, n)
    pre = _prefilled(lm, head, prompt)
    steps = serial_decode(lm, [pre.last_token], Sampler(SamplingParams()), cache=pre.cache, history=pre.history)
    out = [t for s in itertools.islice(steps, n) for t in s.tokens]
    assert out == ref
    hist = pre.history
    assert hist.offset + hist.n == cache_offset(pre.cache) == len(prompt) + n
    assert hist.offset >= len(prompt) - 1 + HISTORY_FEED_EVERY - 1  # fed along the way, not only at the end
    pc = PrefixCache(1 << 30, 16)
    snap = pc.store_final(prompt + out, pre.cache, hist)
    assert snap is not None and snap.head is not None and len(snap.tokens) == len(prompt) + n
    # The head saw each decoded token's hidden state: as a prefill of prompt + decoded does.
    again = _prefilled(lm, head, prompt + out + [0])
    again.history.feed(keep_last=True)
    assert again.history.offset == hist.offset
    n_fed = hist.offset
    for a, b in zip(again.history.state(), hist.state()):
        a, b = a[..., :n_fed, :].astype(mx.float32), b[..., :n_fed, :].astype(mx.float32)
        assert a.shape == b.shape and mx.abs(b).max().item() > 0
        assert mx.allclose(a, b, atol=2e-2, rtol=2e-2), mx.abs(a - b).max().item()


def test_serial_decode_takes_a_head_history_only_after_a_prefill(lm, copy_head):
    with pytest.raises(ValueError, match="one prompt token"):
        next(serial_decode(lm, [1, 2, 3], Sampler(SamplingParams()), history=HeadHistory(copy_head)))
