"""tools/gdn_cpu_emulate.py: the GatedDeltaNet CUDA kernel's text (conv folded in or not), run on this CPU by C++
threads playing the GPU's, matches its float32 reference; and a kernel with a wrong read
does not (the emulation can fail)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the emulation with")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gdn_cpu_emulate  # noqa: E402

from daemon.engine.kernels import gdn_fused  # noqa: E402


@pytest.mark.parametrize("conv,masked,all_states", [(True, False, False), (True, True, True), (False, True, True)])
def test_the_kernel_text_matches_its_reference_on_cpu_threads(tmp_path, conv, masked, all_states):
    exe = gdn_cpu_emulate.build(tmp_path, masked, all_states, CXX, conv)
    for B, T in ((1, 1), (3, 4)):
        r = gdn_cpu_emulate.run_case(exe, masked, all_states, B, T, seed=B + T, conv=conv)
        assert r["ok"], r
        assert all(v[2] == 0 for k, v in r.items() if k != "ok")
        assert not conv or r["conv_out"][1]


def test_a_kernel_that_reads_k_from_the_q_buffer_fails(tmp_path, monkeypatch):
    real = gdn_fused.kernel_source

    def wrong(masked, all_states, conv=False):
        src = real(masked, all_states, conv)
        assert "kf[i] = qk_s[t & 1][1][ke + i];" in src
        return src.replace("kf[i] = qk_s[t & 1][1][ke + i];", "kf[i] = qk_s[t & 1][0][ke + i];")

    monkeypatch.setattr(gdn_fused, "kernel_source", wrong)
    exe = gdn_cpu_emulate.build(tmp_path, False, False, CXX)
    assert not gdn_cpu_emulate.run_case(exe, False, False, 2, 3)["ok"]
