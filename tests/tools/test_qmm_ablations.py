"""bench/probes/qmm_ablations.py: each ablation of the tensor-core matmul still applies to the
kernel's text (exactly one place per substitution, so a kernel edit cannot silently leave an
ablation unchanged or half-applied), and its copy imports as a module whose kernel name (a hash
of the source) differs from the real kernel's, so MLX compiles it as a module of its own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # text and one import per ablation

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "probes"))

import qmm_ablations  # noqa: E402

from daemon.engine.kernels import quant_mma  # noqa: E402


@pytest.mark.parametrize("name", sorted(qmm_ablations.ABLATIONS))
def test_ablation_applies_and_names_its_own_kernel(name, tmp_path):
    assert qmm_ablations.main(["--out", str(tmp_path), "--names", name]) == 0
    path = tmp_path / f"qmm_{name}.py"
    text = path.read_text()
    for old, new in qmm_ablations.ABLATIONS[name]:
        assert old not in text and new in text
    spec = importlib.util.spec_from_file_location(f"ablation_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._NAME.startswith("councild_qmm_mma_") and mod._NAME != quant_mma._NAME


def test_a_changed_kernel_text_is_refused():
    text = qmm_ablations.SOURCE.read_text().replace("return qmm_fma2<BF>(qmm_fma2<BF>(v, one, neg), s2, b2);", "")
    with pytest.raises(SystemExit, match="the kernel's text changed"):
        qmm_ablations.ablated_source("nofma", text)
