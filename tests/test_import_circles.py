"""No import circle anywhere in the tree: the packages (daemon, protocol, front, governor), the
scripts in tools/ and bench/ (which import their neighbours by bare name) and the tests.
Every import counts, also one inside a function or under ``if TYPE_CHECKING:``: either would
hide a circle, not remove it (tests/daemon/test_layering.py holds the finer rules inside
daemon/)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
from import_cycle import find_cycle

pytestmark = pytest.mark.quick  # reads the source only (tests/README.md)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("daemon", "protocol", "front", "governor")
# Folders a script's bare `import x` can find x in besides its own: the scripts put these on
# sys.path (bench/ for its helpers, tests/e2e for the harness, tools/ for the training tools).
SCRIPT_PATHS = ("bench", "tools", "tests", "tests/e2e", "tests/daemon")


def _files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=root,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (root / f).exists()]


def _module_file(parts: list[str], files: set[str]) -> str | None:
    for tail in (".py", "/__init__.py"):
        if "/".join(parts) + tail in files:
            return "/".join(parts) + tail
    return None


def _resolve(name: str, importer: str, files: set[str]) -> str | None:
    """The file an absolute import of ``name`` loads, as the importer's sys.path finds it."""
    parts = name.split(".")
    if parts[0] in PACKAGES:
        return _module_file(parts, files)
    if importer.split("/")[0] in PACKAGES:
        return None  # a package module's bare names are other libraries
    own = str(Path(importer).parent)
    for folder in (own, *SCRIPT_PATHS):
        prefix = [] if folder == "." else folder.split("/")
        if found := _module_file(prefix + parts, files):
            return found
    return None


def _edges(path: str, source: str, files: set[str]) -> set[str]:
    out: set[str] = set()
    pkg = Path(path).with_suffix("").parts
    pkg = list(pkg if pkg[-1] == "__init__" else pkg[:-1])
    if pkg and pkg[-1] == "__init__":
        pkg.pop()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {f for a in node.names if (f := _resolve(a.name, path, files))}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
                found = _module_file(mod.split("."), files)
            else:
                mod = node.module or ""
                found = _resolve(mod, path, files)
            for a in node.names:
                # `from pkg import module` needs the module; `from pkg import name`, the package
                # (Python loads a package's __init__ before any module in it either way, so an
                # __init__ that re-exports its modules is no circle with them).
                sub = _module_file(mod.split(".") + [a.name], files) if node.level else _resolve(f"{mod}.{a.name}", path, files)
                if sub or found:
                    out.add(sub or found)
    out.discard(path)
    return out


def _graph(root: Path) -> dict[str, set[str]]:
    files = _files(root)
    known = set(files)
    return {f: _edges(f, (root / f).read_text(), known) for f in files}


def test_the_whole_tree_is_read():
    graph = _graph(ROOT)
    assert "daemon/engine/model/model.py" in graph["daemon/engine/model/loading.py"]
    assert "tools/train_tiny_model.py" in graph["tools/tiny_finetune.py"]  # a script's bare import
    assert "bench/contention.py" in graph["bench/governor_bench.py"]
    assert len(graph) >= 300


def test_no_import_circle_anywhere():
    cycle = find_cycle(_graph(ROOT))
    assert cycle is None, " -> ".join(cycle)


def test_a_circle_between_two_scripts_is_found(tmp_path):
    """The shape tools/ had: two scripts importing each other by bare name, one of them
    inside a function."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "train.py").write_text("def main():\n    import finetune\n    return finetune\n")
    (tmp_path / "tools" / "finetune.py").write_text("import train\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    assert find_cycle(_graph(tmp_path)) == ["tools/finetune.py", "tools/train.py", "tools/finetune.py"]
