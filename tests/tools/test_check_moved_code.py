"""tools/check_moved_code.py on a small repository of its own: a module moved into a wing and a
function moved between modules pass when only their import paths changed, and fail when a
moved body changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # a few git commands in a temporary folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import check_moved_code  # noqa: E402


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    pkg = tmp_path / "daemon" / "engine"
    pkg.mkdir(parents=True)
    (tmp_path / "daemon" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "serial.py").write_text(
        "CHUNK = 4\n\n\ndef prefill(ids):\n    '''Old words.'''\n    return ids[:CHUNK]\n\n\n"
        "def decode(ids):\n    return prefill(ids) + [1]\n")
    (pkg / "loop_guard.py").write_text("def guard(tokens):\n    return len(set(tokens[-8:])) > 2\n")
    (pkg / "user.py").write_text(
        "from .serial import decode, prefill\n\n\ndef run():\n    return decode([0]), prefill([1]), "
        "'daemon.engine.serial.decode'\n")
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "base")
    _git(tmp_path, "checkout", "-qb", "work")
    monkeypatch.setattr(check_moved_code, "REPO", tmp_path)
    return tmp_path


def _move(repo: Path, prefill_body: str) -> None:
    """serial.py and loop_guard.py into decoders/, prefill (and CHUNK) into prefill/pieces.py;
    user.py follows."""
    eng = repo / "daemon" / "engine"
    for wing in ("decoders", "prefill"):
        (eng / wing).mkdir()
        (eng / wing / "__init__.py").write_text("")
    _git(repo, "mv", "daemon/engine/serial.py", "daemon/engine/decoders/serial.py")
    _git(repo, "mv", "daemon/engine/loop_guard.py", "daemon/engine/decoders/loop_guard.py")  # as is
    (eng / "decoders" / "serial.py").write_text(
        "from ..prefill.pieces import prefill\n\n\ndef decode(ids):\n    return prefill(ids) + [1]\n")
    (eng / "prefill" / "pieces.py").write_text(
        f"CHUNK = 4\n\n\ndef prefill(ids):\n    '''New words.'''\n    return {prefill_body}\n")
    (eng / "user.py").write_text(
        "from .decoders.serial import decode\nfrom .prefill.pieces import prefill\n\n\ndef run():\n"
        "    return decode([0]), prefill([1]), 'daemon.engine.decoders.serial.decode'\n")
    _git(repo, "add", "-A")


def test_a_pure_move_is_the_same_code(repo, capsys):
    _move(repo, "ids[:CHUNK]")
    assert check_moved_code.main([]) == 0
    out = capsys.readouterr().out
    assert "moved: daemon/engine/serial.py:prefill -> daemon/engine/prefill/pieces.py" in out
    assert "1 with a docstring reworded" in out and "0 different" in out


def test_a_changed_body_is_found(repo, capsys):
    _move(repo, "ids[:CHUNK + 1]")
    assert check_moved_code.main([]) == 1
    out = capsys.readouterr().out
    assert "DIFF  daemon/engine/serial.py:prefill -> daemon/engine/prefill/pieces.py" in out
    assert "1 different" in out


def test_text_written_before_the_moves_is_rewritten(repo, capsys):
    _move(repo, "ids[:CHUNK]")
    note = repo / "notes.md"
    note.write_text("see daemon/engine/loop_guard.py (engine/loop_guard.py), daemon.engine.loop_guard.guard "
                    "and daemon.engine.serial.prefill\n")
    assert check_moved_code.main(["--rewrite", "notes.md"]) == 0
    assert note.read_text() == ("see daemon/engine/decoders/loop_guard.py (engine/decoders/loop_guard.py), "
                                "daemon.engine.decoders.loop_guard.guard and daemon.engine.prefill.pieces.prefill\n")
