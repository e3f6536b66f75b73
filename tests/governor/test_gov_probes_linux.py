"""Linux memory signals: parsers on recorded file contents, the reader on a fake root,
the classifier's thresholds, and the live box (which must at least not raise)."""

from __future__ import annotations

import os
import sys

import pytest

from governor.config import LinuxThresholds
from governor.probes.linux import (
    Cgroup,
    LinuxMemoryProbe,
    classify,
    parse_cgroup_bytes,
    parse_meminfo,
    parse_own_cgroup,
    parse_psi,
)

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

GiB = 1 << 30

# Recorded from a 6.x kernel under a memory hog.
PSI_BUSY = """some avg10=12.50 avg60=4.10 avg300=1.02 total=88123456
full avg10=3.20 avg60=1.00 avg300=0.25 total=22334455
"""
PSI_IDLE = """some avg10=0.00 avg60=0.00 avg300=0.00 total=0
full avg10=0.00 avg60=0.00 avg300=0.00 total=0
"""
MEMINFO = """MemTotal:       65536000 kB
MemFree:         1200000 kB
MemAvailable:    6553600 kB
Buffers:          204800 kB
Cached:          4096000 kB
SwapTotal:             0 kB
HugePages_Total:       0
"""
CGROUP_V2 = "0::/user.slice/user-1000.slice/session-3.scope\n"
CGROUP_V1 = """9:name=systemd:/
4:memory:/process_api/3d00153e
1:cpu:/
0::/
"""


# ---------------------------------------------------------------- parsers


def test_parse_psi_some_and_full():
    psi = parse_psi(PSI_BUSY)
    assert psi is not None
    assert psi.some.avg10 == 12.5 and psi.some.avg60 == 4.1 and psi.some.avg300 == 1.02
    assert psi.some.total == 88123456
    assert psi.full is not None and psi.full.avg10 == 3.2


def test_parse_psi_some_only_is_fine():
    psi = parse_psi("some avg10=1.00 avg60=0.50 avg300=0.10 total=42\n")
    assert psi is not None and psi.full is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage",
        "some avg10=abc avg60=0 avg300=0 total=0",
        "some avg10=1.0 avg60=0.0 total=0",  # missing avg300
        "full avg10=1.0 avg60=0.0 avg300=0.0 total=0",  # no some line
        "some avg10 avg60=0 avg300=0 total=0",
        "weird avg10=1.0 avg60=0.0 avg300=0.0 total=0",
        "\x00\x01\x02",
    ],
)
def test_parse_psi_malformed_is_none(text):
    assert parse_psi(text) is None


def test_parse_meminfo_bytes():
    m = parse_meminfo(MEMINFO)
    assert m is not None
    assert m["MemTotal"] == 65536000 * 1024
    assert m["MemAvailable"] == 6553600 * 1024
    assert m["HugePages_Total"] == 0  # no unit: a count, kept as is


@pytest.mark.parametrize("text", ["", "MemTotal: 100 kB\n", "MemAvailable: lots\nMemTotal: 1 kB", "nonsense"])
def test_parse_meminfo_malformed_is_none(text):
    assert parse_meminfo(text) is None


def test_parse_own_cgroup():
    assert parse_own_cgroup(CGROUP_V2) == "/user.slice/user-1000.slice/session-3.scope"
    assert parse_own_cgroup(CGROUP_V1) == "/"  # hybrid: the unified line is there, empty
    assert parse_own_cgroup("4:memory:/foo\n") is None
    assert parse_own_cgroup("") is None


@pytest.mark.parametrize(
    "text,want",
    [("123456\n", 123456), ("max\n", "max"), ("0", 0), ("", None), ("-5", None), ("12k", None), ("max max", None)],
)
def test_parse_cgroup_bytes(text, want):
    assert parse_cgroup_bytes(text) == want


# ---------------------------------------------------------------- classifier


def test_classify_psi_levels():
    th = LinuxThresholds()
    assert classify(th, psi=parse_psi(PSI_IDLE)).level == "normal"
    busy = classify(th, psi=parse_psi(PSI_BUSY))
    assert busy.level == "warn"  # some 12.5 >= 10, full 3.2 >= 2 but < 10
    crit = classify(th, psi=parse_psi("some avg10=45.0 avg60=1 avg300=1 total=1\n"))
    assert crit.level == "critical"
    full_crit = classify(th, psi=parse_psi("some avg10=5 avg60=1 avg300=1 total=1\nfull avg10=11 avg60=1 avg300=1 total=1"))
    assert full_crit.level == "critical"


def test_classify_memavailable_fractions():
    th = LinuxThresholds()  # warn < 10%, critical < 5% of MemTotal
    total = 64 * GiB
    for avail, want in [(20 * GiB, "normal"), (6 * GiB, "warn"), (2 * GiB, "critical")]:
        r = classify(th, meminfo={"MemTotal": total, "MemAvailable": avail})
        assert r.level == want, (avail, r.detail)
        assert r.available_bytes == avail and r.total_bytes == total


def test_classify_memavailable_absolute_bytes_override_fractions():
    # As the integration test does: thresholds set relative to what was free at its start.
    th = LinuxThresholds(memavail_warn_bytes=10 * GiB, memavail_critical_bytes=8 * GiB)
    total = 64 * GiB
    assert classify(th, meminfo={"MemTotal": total, "MemAvailable": 11 * GiB}).level == "normal"
    assert classify(th, meminfo={"MemTotal": total, "MemAvailable": 9 * GiB}).level == "warn"
    assert classify(th, meminfo={"MemTotal": total, "MemAvailable": 7 * GiB}).level == "critical"


def test_classify_cgroup_headroom_and_pressure():
    th = LinuxThresholds()
    limit = 10 * GiB
    ok = classify(th, cgroup=Cgroup(current=5 * GiB, high="max", max=limit))
    assert ok.level == "normal" and ok.available_bytes == 5 * GiB and ok.total_bytes == limit
    warn = classify(th, cgroup=Cgroup(current=int(9.5 * GiB), high="max", max=limit))
    assert warn.level == "warn"
    crit = classify(th, cgroup=Cgroup(current=int(9.9 * GiB), high=limit, max="max"))
    assert crit.level == "critical"
    # memory.high below memory.max is the effective limit.
    high = classify(th, cgroup=Cgroup(current=7 * GiB, high=int(7.5 * GiB), max=limit))
    assert high.level == "warn" and high.total_bytes == int(7.5 * GiB)
    # Unlimited: no headroom signal, but the cgroup's own PSI still counts.
    unl = classify(th, cgroup=Cgroup(current=7 * GiB, pressure=parse_psi(PSI_BUSY)))
    assert unl.level == "warn" and unl.available_bytes is None


def test_classify_worst_signal_wins_and_min_headroom():
    th = LinuxThresholds()
    r = classify(
        th,
        psi=parse_psi(PSI_IDLE),
        meminfo={"MemTotal": 64 * GiB, "MemAvailable": 30 * GiB},
        cgroup=Cgroup(current=int(9.8 * GiB), max=10 * GiB),
    )
    assert r.level == "critical"
    assert r.available_bytes == 10 * GiB - int(9.8 * GiB)
    assert "cgroup" in r.detail and "psi" in r.detail and "memavail" in r.detail


def test_classify_nothing_is_unavailable():
    r = classify(LinuxThresholds())
    assert r.available is False


# ---------------------------------------------------------------- reader on a fake root


def _write(root, rel, text):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_reader_cgroup_v2_tree(tmp_path):
    scope = "sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope"
    _write(tmp_path, "proc/pressure/memory", PSI_IDLE)
    _write(tmp_path, "proc/meminfo", MEMINFO)
    _write(tmp_path, "proc/self/cgroup", CGROUP_V2)
    _write(tmp_path, f"{scope}/memory.current", str(9 * GiB))
    _write(tmp_path, f"{scope}/memory.high", "max\n")
    _write(tmp_path, f"{scope}/memory.max", str(10 * GiB))
    _write(tmp_path, f"{scope}/memory.pressure", PSI_IDLE)
    probe = LinuxMemoryProbe(LinuxThresholds(), root=str(tmp_path))
    cg = probe.read_cgroup()
    assert cg is not None and cg.current == 9 * GiB and cg.max == 10 * GiB and cg.high == "max"
    r = probe.read()
    assert r.available and r.level == "normal"  # 1 GiB of 10 is exactly 10%: not below it
    assert r.available_bytes == 1 * GiB
    _write(tmp_path, f"{scope}/memory.current", str(int(9.95 * GiB)))
    assert probe.read().level == "critical"


def test_reader_cgroup_v1_has_no_cgroup_signal(tmp_path):
    _write(tmp_path, "proc/meminfo", MEMINFO)
    _write(tmp_path, "proc/self/cgroup", CGROUP_V1)
    (tmp_path / "sys/fs/cgroup/memory").mkdir(parents=True)  # v1 layout: no memory.current
    probe = LinuxMemoryProbe(root=str(tmp_path))
    assert probe.read_cgroup() is None
    r = probe.read()
    assert r.available and "cgroup" not in r.detail and "memavail" in r.detail


def test_reader_malformed_files_are_unavailable_not_errors(tmp_path):
    _write(tmp_path, "proc/pressure/memory", "some avg10=?? total=x\n")
    _write(tmp_path, "proc/meminfo", "MemTotal: banana\n")
    _write(tmp_path, "proc/self/cgroup", "0::/x\n")
    _write(tmp_path, "sys/fs/cgroup/x/memory.current", "lots\n")
    r = LinuxMemoryProbe(root=str(tmp_path)).read()
    assert r.available is False


def test_reader_empty_root_is_unavailable(tmp_path):
    r = LinuxMemoryProbe(root=str(tmp_path / "nowhere")).read()
    assert r.available is False and r.source == "linux"


def test_reader_never_raises_even_on_binary_junk(tmp_path):
    (tmp_path / "proc/pressure").mkdir(parents=True)
    (tmp_path / "proc/pressure/memory").write_bytes(os.urandom(512))
    (tmp_path / "proc/meminfo").write_bytes(b"\xff\xfe" * 100)
    r = LinuxMemoryProbe(root=str(tmp_path)).read()
    assert r.available is False


# ---------------------------------------------------------------- the live box


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_live_probe_thresholds_relative_to_memory_free_now():
    """What a real-memory test on this box does: no swap keeps PSI at 0 and the cgroup is
    v1, so the level is driven by MemAvailable thresholds set relative to now."""
    base = LinuxMemoryProbe(LinuxThresholds()).read()
    assert base.available and base.available_bytes is not None
    free = base.available_bytes
    calm = LinuxThresholds(memavail_warn_bytes=max(0, free - 4 * GiB), memavail_critical_bytes=max(0, free - 6 * GiB))
    assert LinuxMemoryProbe(calm).read().level == "normal"
    warn = LinuxThresholds(memavail_warn_bytes=free + 4 * GiB, memavail_critical_bytes=max(0, free - 6 * GiB))
    assert LinuxMemoryProbe(warn).read().level == "warn"
    crit = LinuxThresholds(memavail_warn_bytes=free + 8 * GiB, memavail_critical_bytes=free + 4 * GiB)
    assert LinuxMemoryProbe(crit).read().level == "critical"
