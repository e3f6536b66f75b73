"""The lockstep channel's frames and the per-rank memory probe, without a group."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.distributed.channel import SLOT_BYTES, LinkBroken, Report, _slot, _unslot
from daemon.distributed.group import PeerMemoryProbe

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def test_a_slot_round_trips_and_a_long_payload_is_marked_for_the_overflow_round():
    n, _, overflow, payload = _unslot(_slot(b"tick", 7), 7, 0)
    assert (n, overflow, payload) == (4, False, b"tick")
    n, _, overflow, payload = _unslot(_slot(b"x" * SLOT_BYTES, 8), 8, 0)
    assert (n, overflow, payload) == (SLOT_BYTES, True, b"")


@pytest.mark.parametrize("damage", ["zeros", "stale", "flipped"])
def test_a_frame_no_live_peer_sends_is_a_broken_link(damage):
    buf = _slot(b"tick", 5)
    if damage == "zeros":  # what a collective that failed may hand back
        buf = np.zeros_like(buf)
    elif damage == "flipped":
        buf[-SLOT_BYTES + 22] ^= 0xFF  # a payload byte (the header is 21 bytes)
    seq = 6 if damage == "stale" else 5
    with pytest.raises(LinkBroken):
        _unslot(buf, seq, 1)


def _report(level: str, avail: int) -> Report:
    return Report(rank=1, host="b", pid=2, level=level, available_bytes=avail, detail="psi", active_bytes=1,
                  cache_bytes=0, peak_bytes=1, total_bytes=10)


def test_the_governor_reads_another_ranks_pressure_and_forgets_a_silent_one():
    now = [100.0]
    reports = {1: (99.0, _report("critical", 5))}
    probe = PeerMemoryProbe(1, reports, clock=lambda: now[0])
    r = probe.read()
    assert r.available and r.level == "critical" and r.available_bytes == 5 and r.source == "rank1"
    now[0] = 200.0
    assert not probe.read().available
    assert not PeerMemoryProbe(2, reports, clock=lambda: now[0]).read().available


def test_the_hello_carries_rank_0s_compiled_batch_verdict():
    """Followers adopt whether batches run compiled (lockstep.serve); an older rank 0's hello
    without the field reads as "not compiled": batches stay eager rather than disagree."""
    import msgspec

    from daemon.distributed.channel import Hello, _hello_dec

    hello = Hello(verify_exact=True, batch_exact=True, compiled=True, tuned_profile=None, compiled_batch=True)
    assert _hello_dec.decode(msgspec.msgpack.encode(hello)).compiled_batch is True
    older = msgspec.msgpack.encode([True, True, True, None, "", "full"])
    assert _hello_dec.decode(older).compiled_batch is False
