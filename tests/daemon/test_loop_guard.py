"""The loop guard: detection and the DRY penalty (pure), then inside speculative_decode:
it breaks a sampled loop and never touches greedy output."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest

from daemon.engine.decoders.loop_guard import LoopGuard, LoopGuardConfig, dry_penalty, periodic_tail

CFG = LoopGuardConfig(min_span=12, min_repeats=3, max_period=8)


@pytest.mark.quick
def test_periodic_tail_finds_the_smallest_unit():
    assert periodic_tail([9, 8] + [1, 2, 3] * 4, CFG) == 3
    assert periodic_tail([5] * 12, CFG) == 1
    assert periodic_tail([1, 2, 3] * 3, CFG) is None  # spans 9 < min_span
    assert periodic_tail(list(range(40)), CFG) is None


@pytest.mark.quick
def test_dry_penalty_grows_with_the_repeat_it_would_extend():
    # context ... 1 2 3 4 ... 1 2 3 : token 4 would extend a 3-token repeat; 7 a 1-token one.
    ctx = [1, 2, 3, 4, 0, 3, 7, 0, 1, 2, 3]
    pen = dry_penalty(ctx, LoopGuardConfig(multiplier=1.0, base=2.0, allowed_length=2))
    assert pen == {4: 2.0}  # match of length 3 -> 1.0 * 2 ** (3 - 2); "3 7" matched only 1
    pen1 = dry_penalty(ctx, LoopGuardConfig(multiplier=1.0, base=2.0, allowed_length=1))
    assert pen1 == {4: 4.0, 7: 1.0}


@pytest.mark.quick
def test_guard_arms_on_a_loop_and_disarms_after_the_cooldown():
    g = LoopGuard([1, 2], LoopGuardConfig(min_span=12, cooldown=10))
    g.extend([4, 5, 6] * 3)
    assert not g.armed and g.penalty() == {}
    g.extend([4, 5, 6])
    assert g.armed and g.arms == 1
    assert g.penalty()[4] > 0  # after "... 5 6", token 4 would extend the loop
    g.extend(list(range(100, 110)))
    assert not g.armed


# -- inside speculative_decode ----------------------------------------------------------------

from daemon.engine.decoders.lookup import LookupConfig  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.model.mtp_head import load_mtp_head  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.decoders.speculative import speculative_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


def _run(lm, head, prompt, params, n, **kw):
    out, steps = [], []
    for s in speculative_decode(lm, head, prompt, Sampler(params), 2, **kw):
        out += s.tokens
        steps.append(s)
        if len(out) >= n:
            return out[:n], steps


def _longest_periodic_run(seq, max_period=8):
    best = 0
    for p in range(1, max_period + 1):
        run = 0
        for i in range(p, len(seq)):
            run = run + 1 if seq[i] == seq[i - p] else 0
            best = max(best, run + p)
    return best


def test_guard_breaks_a_sampled_loop_and_leaves_greedy_alone(lm):
    head = load_mtp_head(lm)
    prompt = lm.tokenizer.encode("a b c d")
    greedy_ref = [t for s in itertools.islice(serial_decode(lm, prompt, Sampler(SamplingParams())), 64) for t in s.tokens]
    greedy, _ = _run(lm, head, prompt, SamplingParams(), 64, loop_guard=LoopGuardConfig(), lookup=LookupConfig())
    assert greedy == greedy_ref  # temperature 0: no guard at all
    # A low temperature loops like greedy (the random model's greedy output is periodic).
    assert _longest_periodic_run(greedy_ref) >= 24
    params = SamplingParams(temperature=0.05, seed=11)
    plain, _ = _run(lm, head, prompt, params, 96, lookup=LookupConfig())
    guarded, steps = _run(lm, head, prompt, params, 96, loop_guard=LoopGuardConfig(), lookup=LookupConfig())
    assert _longest_periodic_run(plain[24:]) > _longest_periodic_run(guarded[24:])
    assert any(s.depth == 0 for s in steps[len(steps) // 2 :])  # armed: serial steps
