"""macOS and MLX probes (injected readers), the load tracker, default probe selection."""

from __future__ import annotations

import threading

import pytest

from governor.config import GovernorConfig
from governor.probes import (
    LinuxMemoryProbe,
    LoadTracker,
    MacMemoryProbe,
    MlxMemoryProbe,
    default_memory_probes,
)
from governor.probes.macos import parse_pressure_level

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

GiB = 1 << 30


@pytest.mark.parametrize("text,want", [("1\n", "normal"), ("2", "warn"), ("4\n", "critical"), ("3", None), ("x", None), ("", None)])
def test_parse_pressure_level(text, want):
    assert parse_pressure_level(text) == want


def test_mac_probe_with_injected_reader():
    p = MacMemoryProbe(read_level=lambda: "2\n", read_memory=lambda: (3 * GiB, 64 * GiB))
    r = p.read()
    assert r.available and r.level == "warn" and r.available_bytes == 3 * GiB and r.total_bytes == 64 * GiB


def test_mac_probe_failures_are_unavailable():
    def boom():
        raise OSError("sysctl: unknown oid")

    assert MacMemoryProbe(read_level=boom).read().available is False
    assert MacMemoryProbe(read_level=lambda: "7").read().available is False
    # psutil failing leaves the level usable, headroom unknown.
    def no_mem():
        raise RuntimeError

    r = MacMemoryProbe(read_level=lambda: "4", read_memory=no_mem).read()
    assert r.available and r.level == "critical" and r.available_bytes is None


def test_mac_probe_off_darwin_is_unavailable():
    assert MacMemoryProbe(platform="linux").read().available is False


def test_mlx_probe_injected_callables():
    r = MlxMemoryProbe(active=lambda: 5 * GiB, cache=lambda: GiB, peak=lambda: 6 * GiB, recommended=lambda: 20 * GiB).read()
    assert r.available and r.active_bytes == 5 * GiB and r.cache_bytes == GiB
    assert r.headroom_bytes() == 15 * GiB


def test_mlx_probe_partial_and_failing():
    def boom():
        raise RuntimeError("no device_info on this backend")

    r = MlxMemoryProbe(active=lambda: 1, recommended=boom).read()
    assert r.available and r.recommended_bytes is None and r.headroom_bytes() is None
    assert MlxMemoryProbe().read().available is False
    assert MlxMemoryProbe(active=boom, cache=boom).read().available is False


def test_load_tracker_rate_and_queues():
    t = LoadTracker(tau_s=10.0, cpu_load=lambda: 0.5)
    for i in range(600):  # 2 arrivals a second for 300 s
        t.record_arrival(i * 0.5)
    r = t.read(300.0)
    assert r.arrival_rate == pytest.approx(2.0, rel=0.05)
    assert t.read(330.0).arrival_rate < 0.2  # decays once arrivals stop
    t.set_active(3)
    t.set_queued("alice", 2)
    t.set_queued("bob", 5)
    t.set_queued("alice", 0)
    r = t.read(330.0)
    assert r.active_streams == 3 and r.queued == 5 and r.queued_by_seat == {"bob": 5} and r.cpu_load == 0.5


def test_load_tracker_cpu_failure_and_threads():
    def boom():
        raise OSError

    t = LoadTracker(cpu_load=boom)

    def writer(k):
        for i in range(2000):
            t.record_arrival(float(i))
            t.set_queued(f"s{k}", i % 7)
            t.set_active(i % 4)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for _ in range(200):
        r = t.read(1000.0)
        assert r.cpu_load is None and r.arrival_rate >= 0
    for th in threads:
        th.join()


def test_default_memory_probes_per_platform():
    cfg = GovernorConfig()
    assert isinstance(default_memory_probes(cfg, "linux")[0], LinuxMemoryProbe)
    assert isinstance(default_memory_probes(cfg, "darwin")[0], MacMemoryProbe)
    assert default_memory_probes(cfg, "win32") == []


def test_mlx_probe_with_real_mlx_callables():
    """The daemon's wiring, on whatever backend is installed (CPU here: no working-set size)."""
    mx = pytest.importorskip("mlx.core")
    a = mx.ones((256, 256))
    mx.eval(a)
    r = MlxMemoryProbe(mx.get_active_memory, mx.get_cache_memory, mx.get_peak_memory,
                       lambda: mx.device_info().get("max_recommended_working_set_size")).read()  # fmt: skip
    assert r.available and r.active_bytes is not None and r.active_bytes >= 0
