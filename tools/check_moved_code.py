"""Check that code moved, not changed: every function, class and module-level name at BASE is
compared with its namesake in the work tree, as syntax trees, modulo where modules and
definitions moved.

    .venv/bin/python tools/check_moved_code.py [--base REV] [-v] [PATH ...]

Where things moved is read, not listed by hand:
- module moves: the .py files git's rename detection pairs between BASE and the work tree
  (daemon/engine/serial.py -> daemon/engine/decoders/serial.py, so daemon.engine.serial ->
  daemon.engine.decoders.serial);
- definition moves: a name gone from its module (at the module's new path) and defined now in
  exactly one module that did not define it at BASE (serial.prefill -> prefill.prefill).
Before comparing, both sides' imports are made absolute, one statement per imported name, and
the BASE side's names are mapped through those moves (an import of a moved definition follows
the definition); so are module names and file paths inside string constants (monkeypatch
targets, help texts). Docstrings are left out of the comparison and counted when reworded;
comments and line breaks are not in a syntax tree. A module's other top-level statements
(``if __name__ == "__main__":``, sys.path set-up) are compared as one piece, ``<module>``.

PATHs (files or folders) limit the comparison to definitions found under them at BASE
(default: every tracked .py file). ``--rewrite PATH...`` instead brings text written before
the moves up to date (module names and file paths, through the same maps; run it once per
file: ``daemon.engine.model`` was a module before and is a wing after). Reported: each definition that differs, with a diff of the
two unparsed trees, the ones gone and the new ones. Exit status 0 when every definition found
on both sides is the same code modulo the moves.

The engine thread's split into parts (an earlier use of this tool, with hand-listed renames
of ``self.X`` attributes) is in this file's git history.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("daemon", "protocol", "front", "governor")  # folders imported as packages from the root


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def _module(path: str) -> str:
    parts = list(pathlib.PurePosixPath(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(path: str) -> str:
    mod = _module(path)
    return mod if path.endswith("__init__.py") else mod.rpartition(".")[0]


def _renames(base: str) -> dict[str, str]:
    """Old path -> new path for the .py files git pairs as renamed (BASE -> work tree)."""
    out = {}
    for line in _git("diff", "-M", "--name-status", base, "--", "*.py").splitlines():
        fields = line.split("\t")
        if fields[0].startswith("R"):
            out[fields[1]] = fields[2]
    return out


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Name -> its top-level definition; the other top-level statements (imports and the
    docstring aside) as ``<module>``."""
    defs: dict[str, ast.AST] = {}
    rest: list[ast.stmt] = []
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            defs[node.targets[0].id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defs[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        elif i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the module's docstring
        else:
            rest.append(node)
    if rest:
        defs["<module>"] = ast.Module(body=rest, type_ignores=[])
    return defs


class _Moves:
    """The module and definition moves, applied to names and strings of the BASE side."""

    def __init__(self, modules: dict[str, str], definitions: dict[tuple[str, str], str], paths: dict[str, str]):
        self.modules, self.definitions = modules, definitions
        # One pass over a string, longest names first: a name already moved is not moved again
        # (daemon.engine.loading -> daemon.engine.model.loading must not meet daemon.engine.model).
        self._names = {f"{m}.{n}": f"{new}.{n}" for (m, n), new in definitions.items()} | modules | paths
        alternatives = "|".join(re.escape(k) for k in sorted(self._names, key=len, reverse=True))
        self._pattern = re.compile(rf"(?<![\w.])({alternatives})(?![\w])") if self._names else None

    def module(self, mod: str) -> str:
        for old, new in sorted(self.modules.items(), key=lambda kv: -len(kv[0])):
            if mod == old or mod.startswith(old + "."):
                return new + mod[len(old):]
        return mod

    def text(self, s: str) -> str:
        return self._pattern.sub(lambda m: self._names[m.group(1)], s) if self._pattern else s


class _Normal(ast.NodeTransformer):
    """Absolute imports, one statement per name (moved on the BASE side), docstrings out."""

    def __init__(self, package: str, moves: _Moves | None):
        self.package, self.moves = package, moves
        self.docs: list[str] = []

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit_ImportFrom(self, node: ast.ImportFrom):
        mod = self._absolute(node)
        out = []
        for alias in node.names:
            target = mod
            if self.moves is not None:
                if f"{mod}.{alias.name}" in self.moves.modules:  # `from daemon.engine import serial`
                    target = self.moves.modules[f"{mod}.{alias.name}"].rpartition(".")[0]
                elif (mod, alias.name) in self.moves.definitions:
                    target = self.moves.definitions[(mod, alias.name)]
                else:
                    target = self.moves.module(mod)
            out.append(ast.ImportFrom(module=target, names=[ast.alias(alias.name, alias.asname)], level=0))
        return out

    def visit_Import(self, node: ast.Import):
        names = [ast.alias(self.moves.module(a.name) if self.moves else a.name, a.asname) for a in node.names]
        return [ast.Import(names=[a]) for a in names]

    def visit_Constant(self, node: ast.Constant):
        if self.moves is not None and isinstance(node.value, str):
            return ast.Constant(self.moves.text(node.value))
        return node

    def _strip_doc(self, node):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            self.docs.append(body[0].value.value)
            node.body = body[1:] or [ast.Pass()]
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _strip_doc


def _sorted_imports(node: ast.AST) -> ast.AST:
    """Each run of consecutive import statements in sorted order: moving a definition can
    split one import in two, and where the new one stands in the run does not matter."""
    for n in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(n, field, None)
            if not isinstance(stmts, list):
                continue
            out, run = [], []
            for s in stmts + [None]:
                if isinstance(s, (ast.Import, ast.ImportFrom)):
                    run.append(s)
                    continue
                out += sorted(run, key=ast.dump)
                run = []
                if s is not None:
                    out.append(s)
            setattr(n, field, out)
    return node


def _normal(node: ast.AST, package: str, moves: _Moves | None) -> tuple[ast.AST, list[str]]:
    n = _Normal(package, moves)
    out = _sorted_imports(n.visit(node))  # in place: each tree is normalised once
    return out, n.docs


def _read_all(base: str, files: list[str]) -> dict[str, str]:
    """Every file's text at ``base``, through one ``git cat-file --batch``."""
    request = "".join(f"{base}:{f}\n" for f in files).encode()
    raw = subprocess.run(["git", "cat-file", "--batch"], cwd=REPO, input=request, check=True,
                         capture_output=True).stdout
    out, pos = {}, 0
    for f in files:
        header_end = raw.index(b"\n", pos)
        size = int(raw[pos:header_end].split()[2])
        out[f] = raw[header_end + 1: header_end + 1 + size].decode()
        pos = header_end + 1 + size + 1
    return out



def _diff(a: ast.AST, b: ast.AST) -> str:
    return "\n".join(difflib.unified_diff(ast.unparse(a).splitlines(), ast.unparse(b).splitlines(), "before",
                                          "after", lineterm=""))


def _path_moves(renames: dict[str, str]) -> dict[str, str]:
    """File paths as text names them: the whole path and its tails of two parts or more that
    changed (daemon/engine/serial.py and engine/serial.py -> ...decoders/serial.py)."""
    out = {}
    for old, new in renames.items():
        o, n = old.split("/"), new.split("/")
        k = 0
        while k < min(len(o), len(n)) - 1 and o[k] == n[k]:
            k += 1
        for i in range(0, k + 1):
            if len(o) - i >= 2:
                out["/".join(o[i:])] = "/".join(n[i:])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="the commit the moves started from (default: merge-base with main)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the definitions that are the same too")
    ap.add_argument("--rewrite", action="store_true",
                    help="instead of comparing: rewrite the module names and file paths the moves changed in "
                         "the PATHs given (text files written before the moves: results, logs, notes)")
    ap.add_argument("paths", nargs="*", help="only definitions under these paths at BASE (with --rewrite: the files)")
    args = ap.parse_args(argv)
    base = args.base or _git("merge-base", "HEAD", "main").strip()

    renames = _renames(base)
    old_files = [f for f in _git("ls-tree", "-r", "--name-only", base).splitlines() if f.endswith(".py")]
    new_files = [f for f in _git("ls-files", "--cached", "--others", "--exclude-standard").splitlines()
                 if f.endswith(".py") and (REPO / f).exists()]
    old_texts = _read_all(base, old_files)
    new_texts = {f: (REPO / f).read_text() for f in new_files}
    # A file whose text did not change holds the same code: counted, not parsed twice.
    unchanged = {f for f, text in old_texts.items() if new_texts.get(f) == text}
    old_trees = {f: ast.parse(text) for f, text in old_texts.items()}
    new_trees = {f: ast.parse(text) for f, text in new_texts.items()}
    old_defs = {f: _definitions(t) for f, t in old_trees.items()}
    new_defs = {f: _definitions(t) for f, t in new_trees.items()}

    in_packages = lambda f: f.split("/")[0] in PACKAGES  # noqa: E731
    module_moves = {_module(o): _module(n) for o, n in renames.items() if in_packages(o) and in_packages(n)}
    # A name gone from its (moved) module and defined now in exactly one module that lacked it.
    defined_at = {}
    for f, defs in new_defs.items():
        for name in defs:
            defined_at.setdefault(name, []).append(f)
    def_moves: dict[tuple[str, str], str] = {}
    def_files: dict[tuple[str, str], str] = {}
    for f, defs in old_defs.items():
        now = renames.get(f, f)
        for name in defs:
            if name == "<module>" or name in new_defs.get(now, {}):
                continue
            fresh = [g for g in defined_at.get(name, ()) if name not in old_defs.get(
                next((o for o, n in renames.items() if n == g), g), {})]
            if len(fresh) == 1:
                def_files[(f, name)] = fresh[0]
                if in_packages(f) and in_packages(fresh[0]):
                    def_moves[(_module(f), name)] = _module(fresh[0])
    moves = _Moves(module_moves, def_moves, _path_moves(renames))
    if args.rewrite:
        for f in args.paths:
            text = (REPO / f).read_text()
            if (new_text := moves.text(text)) != text:
                (REPO / f).write_text(new_text)
                print(f"rewrote {f}")
        return 0

    wanted = [p.rstrip("/") for p in args.paths]
    same = differ = reworded = 0
    gone, bad = [], []
    for f in sorted(old_defs):
        if wanted and not any(f == p or f.startswith(p + "/") for p in wanted):
            continue
        for name, old_node in old_defs[f].items():
            g = def_files.get((f, name), renames.get(f, f))
            new_node = new_defs.get(g, {}).get(name)
            label = f"{f}:{name}" + (f" -> {g}" if g != f else "")
            if new_node is None:
                gone.append(label)
                continue
            if f in unchanged and g == f:
                same += 1
                if args.verbose:
                    print(f"same  {label} (file unchanged)")
                continue
            a, old_docs = _normal(old_node, _package(f), moves)
            b, new_docs = _normal(new_node, _package(g), None)
            if ast.dump(a) == ast.dump(b):
                same += 1
                if old_docs != new_docs:
                    reworded += 1
                if args.verbose:
                    print(f"same  {label}")
            else:
                differ += 1
                bad.append(label)
                print(f"DIFF  {label}")
                print("\n".join("      " + line for line in _diff(a, b).splitlines()))
    known = {(renames.get(f, f), n) for f, d in old_defs.items() for n in d} | {(g, n) for (_, n), g in def_files.items()}
    new = sorted(f"{f}:{n}" for f, d in new_defs.items() for n in d if (f, n) not in known
                 and (not wanted or any(f == p or f.startswith(p + "/") for p in wanted)))
    print(f"\nBASE {base[:12]}: {len(module_moves)} modules and {len(renames) - len(module_moves)} other files moved, "
          f"{len(def_moves) + len(def_files) - len(def_moves)} definitions moved between files.")
    for (f, name), g in sorted(def_files.items()):
        print(f"  moved: {f}:{name} -> {g}")
    print(f"{same + differ} definitions compared: {same} the same code modulo the moves "
          f"({reworded} with a docstring reworded), {differ} different.")
    if gone:
        print(f"gone ({len(gone)}): " + "; ".join(gone))
    if new:
        print(f"new ({len(new)}): " + "; ".join(new))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
