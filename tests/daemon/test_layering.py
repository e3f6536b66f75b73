"""The house rules inside daemon/, read from the source (every import, also those inside
functions, which would otherwise hide a circle; imports under ``if TYPE_CHECKING:`` are
annotations, not dependencies, except for the circle rule):
- no import circle between daemon modules, not even one closed by an import inside a
  function or under ``if TYPE_CHECKING:`` (either would hide the circle, not remove it);
- the model tools (daemon/models/) do not reach up into the measurement wing;
- the engine imports nothing of the daemon outside daemon/engine/;
- no gate or benchmark code under daemon/engine/, and nothing the running daemon imports
  reaches the measurement wing (daemon/measure/) or the CLI;
- the wings of the running daemon stand in one order, bottom to top: the engine
  (daemon/engine/), request text (daemon/request_text/), the engine thread
  (daemon/engine_thread/), the tensor-parallel group (daemon/distributed/), the socket side
  (daemon/socket_side/): no module imports a wing above its own, and the wings, with the
  top-level modules and the other folders, form no circle;
- the floor (config, exits, logs, paths, the package) imports no serving wing but the engine;
- daemon/'s top level holds at most 14 files: the CLI, config and the floor, the demo;
- inside the engine, its wings stand in one order too, bottom to top: kernels (the arithmetic
  of a forward), caches (where a request's state is kept), model (a loaded checkpoint and its
  forwards), prefill (a prompt into the caches), decoders (tokens out): no engine module
  imports a wing above its own, annotations included; the engine's floor (pieces, types, the
  package) imports no wing; every other engine module stands in a wing, none holds more than
  12 modules, and each wing's ``__init__`` is a one-line docstring that imports nothing."""

from __future__ import annotations

import ast
import pathlib

import daemon
import pytest
from import_cycle import find_cycle

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

ROOT = pathlib.Path(daemon.__file__).parent
# What the running daemon imports, starting from `councild serve`'s server.
SERVING_ROOTS = ("daemon.socket_side.server", "daemon.engine_thread.worker")
# The running daemon's wings, bottom to top: each may import those below it, never one above.
WINGS = ("daemon.engine", "daemon.request_text", "daemon.engine_thread", "daemon.distributed", "daemon.socket_side")
# Top-level modules every wing may use; they import no serving wing (the engine only).
FLOOR = ("daemon", "daemon.config", "daemon.exits", "daemon.logs", "daemon.paths")
TOP_LEVEL_MAX = 14
# The engine's wings, bottom to top, and its floor (modules every engine wing may use).
ENGINE_WINGS = ("daemon.engine.kernels", "daemon.engine.jit", "daemon.engine.caches", "daemon.engine.model", "daemon.engine.prefill",
                "daemon.engine.decoders")
ENGINE_FLOOR = ("daemon.engine", "daemon.engine.pieces", "daemon.engine.types")
ENGINE_WING_MAX = 12


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: pathlib.Path, modules: set[str], type_only: bool = False, root: pathlib.Path = ROOT) -> set[str]:
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                out.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            for a in node.names:  # `from . import x` / `from .engine import model`
                if f"{mod}.{a.name}" in modules:
                    out.add(f"{mod}.{a.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    # keep daemon modules only; a package import means its __init__
    return {m for m in out if m in modules and m != name}


def _graph(type_only: bool = False, root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports; ``type_only`` adds the annotation-only ones."""
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(f, root) for f in files}
    return {_module_name(f, root): _imports(f, modules, type_only, root) for f in files}


def _in(mod: str, package: str) -> bool:
    return mod == package or mod.startswith(package + ".")


def _wing(mod: str) -> str:
    """The folder a module stands in (``daemon.engine_thread.worker`` -> ``daemon.engine_thread``);
    a top-level module is its own node."""
    return ".".join(mod.split(".")[:2])


def _engine_wing(mod: str) -> str:
    """The engine wing a module stands in (``daemon.engine.model.loading`` ->
    ``daemon.engine.model``); a floor module is its own node."""
    return ".".join(mod.split(".")[:3])


def _arrows_up(graph: dict[str, set[str]], wings=WINGS, wing=_wing) -> list[str]:
    rank = {w: i for i, w in enumerate(wings)}
    found = []
    for mod, deps in graph.items():
        mine = rank.get(wing(mod))
        if mine is None:
            continue
        for d in sorted(deps):
            theirs = rank.get(wing(d))
            if theirs is not None and theirs > mine:
                found.append(f"{mod} -> {d}")
    return found


def _wing_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        out.setdefault(_wing(mod), set()).update(_wing(d) for d in deps if _wing(d) != _wing(mod))
    return out


def _reachable(graph: dict[str, set[str]], roots) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += graph.get(n, ())
    return seen


def test_the_graph_is_read():
    graph = _graph()
    assert "daemon.engine.kernels.forward" in graph["daemon.engine.decoders.rollback"]
    assert "daemon.engine.model.model" in graph["daemon.engine.model.loading"]
    assert len(graph) >= 30


def test_no_import_circle_inside_daemon():
    assert find_cycle(_graph()) is None, " -> ".join(find_cycle(_graph()))


def test_a_planted_circle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_circle_hidden_inside_a_function_or_behind_type_checking():
    """The graph with every import (module level, inside functions, type-only) has no circle:
    an import moved into a function or under TYPE_CHECKING to dodge a circle still counts."""
    cycle = find_cycle(_graph(type_only=True))
    assert cycle is None, " -> ".join(cycle)


def test_a_circle_hidden_by_local_and_type_only_imports_is_found(tmp_path):
    """The shape this rule was written for (engine/model -> chunked_prefill -> forward ->
    model): a function-local import one way, a type-only import back."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("def f():\n    from . import prefill\n    return prefill\n")
    (pkg / "prefill.py").write_text("from .forward import walk\n")
    (pkg / "forward.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from .model import f\ndef walk():\n    pass\n")
    assert find_cycle(_graph(root=pkg)) is None  # the lenient graph misses it
    assert find_cycle(_graph(type_only=True, root=pkg)) == ["pkg.forward", "pkg.model", "pkg.prefill", "pkg.forward"]


def test_model_tools_do_not_reach_into_measurement():
    for mod, deps in _graph(type_only=True).items():
        if mod.startswith("daemon.models"):
            up = {d for d in deps if d.startswith("daemon.measure")}
            assert not up, f"{mod} imports {up}"


def test_engine_imports_only_the_engine():
    for mod, deps in _graph().items():
        if _in(mod, "daemon.engine"):
            outside = {d for d in deps if not _in(d, "daemon.engine")}
            assert not outside, f"{mod} imports {outside}"


def test_no_gate_or_bench_under_engine():
    names = {p.stem for p in (ROOT / "engine").rglob("*.py")}
    assert not {n for n in names if "bench" in n or "fidelity" in n or "gate" in n}, names


def test_the_running_daemon_reaches_neither_measurement_nor_cli():
    reach = _reachable(_graph(), SERVING_ROOTS)
    assert "daemon.engine_thread.worker" in reach and "daemon.engine.decoders.speculative" in reach
    bad = {m for m in reach if m.startswith("daemon.measure") or m == "daemon.cli"}
    assert not bad, bad


def test_no_wing_imports_one_above_it():
    """Every import, annotations included: an arrow up hidden under TYPE_CHECKING still counts."""
    graph = _graph(type_only=True)
    assert all(any(_wing(m) == w for m in graph) for w in WINGS), "a wing is missing: update WINGS"
    up = _arrows_up(graph)
    assert not up, up


def test_a_planted_arrow_up_is_found():
    graph = {"daemon.engine_thread.worker": {"daemon.request_text.requests", "daemon.socket_side.server"},
             "daemon.request_text.requests": {"daemon.engine.types"}}
    assert _arrows_up(graph) == ["daemon.engine_thread.worker -> daemon.socket_side.server"]


def test_no_circle_between_wings():
    """Collapsed to folders (the wings, measure, models, service) and top-level modules, the
    import graph has no circle either."""
    cycle = find_cycle(_wing_graph(_graph(type_only=True)))
    assert cycle is None, " -> ".join(cycle)


def test_the_floor_imports_no_serving_wing():
    serving = WINGS[1:]
    for mod, deps in _graph(type_only=True).items():
        if mod in FLOOR:
            bad = {d for d in deps if any(_in(d, w) for w in serving)}
            assert not bad, f"{mod} imports {bad}"


def test_the_top_level_is_small():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, top
    assert {"cli.py", "config.py", "__init__.py"} <= set(top)


def test_the_live_view_is_a_protocol_client():
    """`councild top` reads the status reply only: nothing of the running daemon's wings, no mlx."""
    root = ROOT / "top"
    files = sorted(root.glob("*.py"))
    assert len(files) >= 4
    for f in files:
        tree = ast.parse(f.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        names |= {"daemon." + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 2}
        bad = {m for m in names if m.split(".")[0] in ("mlx", "mlx_lm") or any(_in(m, w) for w in WINGS)}
        assert not bad, f"{f.name} imports {bad}"


def _engine_graph() -> dict[str, set[str]]:
    """The engine's modules and their imports inside the engine, annotations included."""
    return {m: {d for d in deps if _in(d, "daemon.engine")}
            for m, deps in _graph(type_only=True).items() if _in(m, "daemon.engine")}


def test_no_engine_wing_imports_one_above_it():
    graph = _engine_graph()
    assert all(any(_engine_wing(m) == w for m in graph) for w in ENGINE_WINGS), "an engine wing is missing"
    up = _arrows_up(graph, ENGINE_WINGS, _engine_wing)
    assert not up, up


def test_a_planted_arrow_up_between_engine_wings_is_found():
    graph = {"daemon.engine.prefill.prefill": {"daemon.engine.model.model", "daemon.engine.decoders.serial"},
             "daemon.engine.model.model": {"daemon.engine.kernels.chunked_prefill", "daemon.engine.pieces"}}
    assert _arrows_up(graph, ENGINE_WINGS, _engine_wing) == [
        "daemon.engine.prefill.prefill -> daemon.engine.decoders.serial"]


def test_the_engine_floor_imports_no_wing():
    for mod, deps in _engine_graph().items():
        if mod in ENGINE_FLOOR:
            bad = {d for d in deps if any(_in(d, w) for w in ENGINE_WINGS)}
            assert not bad, f"{mod} imports {bad}"


def test_every_engine_module_stands_in_a_small_wing():
    """A reader names the engine's parts from its folder listing: the floor at the top, the
    rest in the wings, none over ENGINE_WING_MAX modules, no folder that is not a wing."""
    mods = set(_engine_graph())
    stray = {m for m in mods if m not in ENGINE_FLOOR and _engine_wing(m) not in ENGINE_WINGS}
    assert not stray, f"engine modules outside the wings and the floor: {sorted(stray)}"
    for w in ENGINE_WINGS:
        inside = [m for m in mods if _in(m, w) and m != w]
        assert 0 < len(inside) <= ENGINE_WING_MAX, f"{w}: {len(inside)} modules"
    folders = {p.name for p in (ROOT / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {w.rsplit(".", 1)[1] for w in ENGINE_WINGS}, folders


def test_each_engine_wing_says_what_it_holds_in_one_line():
    for w in ENGINE_WINGS:
        init = ROOT.parent / (w.replace(".", "/") + "/__init__.py")
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc and "\n" not in doc, f"{init}: one-line docstring wanted"
        assert len(tree.body) == 1, f"{init} holds more than its docstring"
