"""Check that the engine thread's code moved, not changed, when EngineWorker went from five
mixins to a step loop plus parts (issue 42, item 1).

For every function of the old mixins, the old worker and the tensor-parallel workers that
subclass it, this compares its body at BASE (from git) with its body now, after applying the
renames listed below to the old text: ``self.X`` -> ``self.<part>.X`` where an attribute
moved into a part (the loaded engine, the status), methods that became a part's interface
(``_start`` -> ``start``), and the calls that now go through a part. Bodies are compared as
syntax trees (``ast.dump``), so comments and line breaks do not count; docstrings are left
out of the comparison and reported when they changed. One function was split:
``EngineStartup._load_unfrozen`` is now ``EngineStartup.load`` (which returns the engine it
built) and the tail of ``EngineWorker._load_unfrozen`` (the first publish and "ready", once
the parts exist); the statements that only build the parts are listed as GLUE.

New code (the parts' constructors, ``EngineStatus.attach``, the worker's one-line hooks that
call a part, ``LoadedEngine``) is listed at the end, not compared.

    .venv/bin/python tools/check_moved_code.py [--base COMMIT]

Item 2 then moved the files into wings (daemon/engine_thread/, ...): the new side is found
wherever its class now lives, and relative imports are compared by the module they name.

Exit status 0 when every moved function is the same code modulo the renames.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import pathlib
import re
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE = "fce93e8ddd8bf563b9eb57ed0efcf81286a4d7f9"  # the commit item 1 started from

ENGINE_ATTRS = ("lm", "slot", "verify_exact", "verdicts", "batch_speculates", "batch", "prefix_cache",
                "governance", "tuned_profile")


def engine(names=ENGINE_ATTRS):
    """``self.X`` -> ``self.engine.X``: an attribute now on the LoadedEngine start-up returns."""
    return [(rf"self\.{a}\b", f"self.engine.{a}") for a in names]


STATUS = [(r"self\.snapshot_lock\b", "self.status.snapshot_lock"), (r"self\.snapshot\.", "self.status.snapshot."),
          (r"self\._published_at\b", "self.status.published_at")]

# The renames per new class: (pattern on the old text, replacement).
RENAMES: dict[str, list[tuple[str, str]]] = {
    "EngineStartup": engine(ENGINE_ATTRS + ("max_prompt_tokens",)) + STATUS + [
        (r"self\._head_changed\b", "self.status.head_changed"),
        (r"self\._warm_up\(", "self.warm_up("),
        (r"self\._build_ahead\(", "self.build_ahead("),
        (r"self\._open_prefix_cache\(", "PrefixCacheUse(self.cfg, self.engine, self.group).open_prefix_cache("),
    ],
    "CommandHandling": engine(("governance",)) + [
        (r"self\._published_at\b", "self.status.published_at"),
        (r"self\._apply_command\(", "self.apply("),
        (r"self\._fail_all\(", "self.fail_all("),
        (r"self\._stopping\b", "self.stopping"),
    ],
    "DecodePaths": engine() + [
        (r"self\._open_prefix_cache\(", "self.prefix_use.open_prefix_cache("),
    ],
    "PrefixCacheUse": engine() + [
        (r'getattr\(self, "prefix_cache", None\)', "self.engine.prefix_cache"),
    ],
    "EngineStatus": engine(("slot", "prefix_cache", "governance")) + [
        (r"self\._published_at\b", "self.published_at"),
    ],
    "EngineWorker": engine() + STATUS + [
        (r'getattr\(self, "prefix_cache", None\)', 'getattr(self.engine, "prefix_cache", None)'),
        (r"self\._start\(", "self.paths.start("),
        (r"self\._begin_decode\(", "self.paths.begin_decode("),
        (r"self\._keep_continuation\(", "self.prefix_use.keep_continuation("),
        (r"self\._count_tokens\(", "self.status.count_tokens("),
        (r"self\._fail_all\(", "self.handling.fail_all("),
        (r"self\._stopping\b", "self.handling.stopping"),
    ],
}
RENAMES["_GroupMember"] = RENAMES["LeaderWorker"] = RENAMES["FollowerWorker"] = engine() + STATUS + [
    (r"self\._warm_up\(", "self.startup.warm_up("),
    (r"self\.warmup_mode\(", "self.startup.warmup_mode("),
]

# (old file, old qualified name) -> (new class or None for module level, new name).
MOVES: list[tuple[str, str, str | None, str]] = [
    ("daemon/startup.py", "EngineStartup._load", "EngineWorker", "_load"),
    ("daemon/startup.py", "EngineStartup._configure_backend", "EngineStartup", "_configure_backend"),
    ("daemon/startup.py", "EngineStartup.warmup_mode", "EngineStartup", "warmup_mode"),
    ("daemon/startup.py", "EngineStartup._warm_up", "EngineStartup", "warm_up"),
    ("daemon/startup.py", "EngineStartup._prompt_limit", "EngineStartup", "_prompt_limit"),
    ("daemon/startup.py", "EngineStartup._load_progress", "EngineStartup", "_load_progress"),
    ("daemon/startup.py", "EngineStartup._choose_kernels", "EngineStartup", "_choose_kernels"),
    ("daemon/startup.py", "EngineStartup._probe_exactness", "EngineStartup", "_probe_exactness"),
    ("daemon/commands.py", "CommandHandling._drain_commands", "CommandHandling", "drain"),
    ("daemon/commands.py", "CommandHandling._apply_command", "CommandHandling", "apply"),
    ("daemon/commands.py", "CommandHandling._submit", "CommandHandling", "_submit"),
    ("daemon/commands.py", "CommandHandling._override", "CommandHandling", "_override"),
    ("daemon/commands.py", "CommandHandling._cancel", "CommandHandling", "_cancel"),
    ("daemon/commands.py", "CommandHandling._fail_all", "CommandHandling", "fail_all"),
    ("daemon/decode_paths.py", "_fail_after", None, "_fail_after"),
    ("daemon/decode_paths.py", "DecodePaths._start", "DecodePaths", "start"),
    ("daemon/decode_paths.py", "DecodePaths._begin_decode", "DecodePaths", "begin_decode"),
    ("daemon/decode_paths.py", "DecodePaths._batchable", "DecodePaths", "_batchable"),
    ("daemon/decode_paths.py", "DecodePaths._row_depth", "DecodePaths", "_row_depth"),
    ("daemon/decode_paths.py", "DecodePaths._rejoin_batch", "DecodePaths", "_rejoin_batch"),
    ("daemon/decode_paths.py", "DecodePaths._hand_solo_to_batch", "DecodePaths", "_hand_solo_to_batch"),
    ("daemon/decode_paths.py", "DecodePaths._request_depth", "DecodePaths", "_request_depth"),
    ("daemon/decode_paths.py", "DecodePaths._drafting_options", "DecodePaths", "_drafting_options"),
    ("daemon/decode_paths.py", "DecodePaths._build_ahead", "EngineStartup", "build_ahead"),
    ("daemon/decode_paths.py", "DecodePaths.depth_pinned", "EngineWorker", "depth_pinned"),
    ("daemon/prefix_cache_use.py", "PrefixCacheUse._open_prefix_cache", "PrefixCacheUse", "open_prefix_cache"),
    ("daemon/prefix_cache_use.py", "PrefixCacheUse._decode_keeps_cold_state", "PrefixCacheUse",
     "_decode_keeps_cold_state"),
    ("daemon/prefix_cache_use.py", "PrefixCacheUse._keep_continuation", "PrefixCacheUse", "keep_continuation"),
    ("daemon/status_snapshot.py", "EngineStatus._count_tokens", "EngineStatus", "count_tokens"),
    ("daemon/status_snapshot.py", "EngineStatus._publish", "EngineStatus", "publish"),
    ("daemon/status_snapshot.py", "EngineStatus.read_snapshot", "EngineStatus", "read_snapshot"),
    ("daemon/status_snapshot.py", "EngineStatus._head_changed", "EngineStatus", "head_changed"),
]
WORKER_KEPT = ("run", "requests_holding_head", "_loop", "_step", "_step_budget", "_now", "_expire_deadlines",
               "_token_text", "_prefill_chunk", "_advance", "_step_batch", "_log_displaced", "_park_batched",
               "_failed", "_deliver", "_tally", "_finish", "_send")
MOVES += [("daemon/worker.py", f"EngineWorker.{n}", "EngineWorker", n) for n in WORKER_KEPT]
GROUP = {"_GroupMember": ("_join", "_report", "_deliver", "_now", "_exchange", "_failed"),
         "LeaderWorker": ("__init__", "run", "_load", "_attach_peer_probes", "_collect", "_settings", "_wire",
                          "_apply_command", "_drain_commands", "_publish"),
         "FollowerWorker": ("__init__", "serve", "depth_pinned", "_send", "_publish", "_drain_commands", "_command",
                            "_apply_settings", "_follow_head_load")}
MOVES += [("daemon/distributed/lockstep.py", f"{c}.{n}", c, n) for c, ns in GROUP.items() for n in ns]
# Classes whose whole definition moved as is (the commands, the snapshot, the fault).
SAME_CLASSES = [("daemon/commands.py", c) for c in ("Submit", "CancelJob", "CancelAll", "Stop", "ReloadGovernor",
                                                      "ReloadScheduler", "GovernorOverride")]
SAME_CLASSES += [("daemon/status_snapshot.py", "EngineSnapshot"), ("daemon/decode_paths.py", "InjectedFault")]

# The split: old EngineStartup._load_unfrozen == EngineStartup.load + EngineWorker._load_unfrozen, less GLUE.
SPLIT = ("daemon/startup.py", "EngineStartup._load_unfrozen",
         [("EngineStartup", "load"), ("EngineWorker", "_load_unfrozen")])
GLUE = {  # statements of the new pieces that only build the parts (compared as ast.unparse text)
    "from daemon.engine_thread.prefix_cache_use import PrefixCacheUse",
    "return self.engine",
    "self.startup = EngineStartup(self.cfg, self.model_path, self.group, self.status, self.hooks, "
    "requests_holding_head=self.requests_holding_head)",
    "engine = self.engine = self.startup.load()",
    "self.max_prompt_tokens = engine.max_prompt_tokens",
    "self.prefix_use = PrefixCacheUse(self.cfg, engine, self.group)",
    "self.paths = DecodePaths(self.cfg, engine, self.scheduler, self.group, self.prefix_use, failed=self._failed, "
    "deliver=self._deliver, depth_pinned=self.depth_pinned, build_ahead=self.startup.build_ahead)",
    "self.handling = CommandHandling(self._ready, self.scheduler, self.jobs, engine, self.status, "
    "finish=self._finish, send=self._send, publish=self._publish)",
    "self.status.attach(engine)",
}
# The tail the worker took over reads the engine through self.engine and the status through self.status.
SPLIT_TAIL_RENAMES = RENAMES["EngineStartup"]

# Item 2 moved the modules into wings: a relative import is compared by the module it names,
# the old one mapped to where that module lives now.
WINGS = {"socket_side": ("server", "client_delivery", "endpoint", "keys", "status_reply", "notify"),
         "engine_thread": ("worker", "startup", "loaded_engine", "decode_paths", "prefix_cache_use",
                           "status_snapshot", "commands", "governance", "kernel_choice", "probe_verdicts", "warmup",
                           "head_slot", "profile", "scheduler", "seat_stats", "stats"),
         "request_text": ("requests", "intake", "tool_calls", "tool_grammar", "reasoning", "detokenize")}
MODULE_MOVES = {f"daemon.{m}": f"daemon.{w}.{m}" for w, ms in WINGS.items() for m in ms}

NEW = ["LoadedEngine (loaded_engine.py)", "EngineStartup.__init__", "CommandHandling.__init__", "DecodePaths.__init__",
       "PrefixCacheUse.__init__", "EngineStatus.__init__", "EngineStatus.attach", "EngineWorker.__init__ (rewritten)",
       "EngineWorker._drain_commands / _apply_command / _publish / read_snapshot (one line each: call the part)"]


def _find(tree: ast.Module, qual: str) -> ast.AST:
    node: ast.AST = tree
    for part in qual.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node


def _split_docstring(fn: ast.AST) -> tuple[str | None, list[ast.stmt]]:
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return inspect.cleandoc(body[0].value.value), body[1:]
    return None, body


def _old_source(path: str, base: str) -> str:
    return subprocess.run(["git", "show", f"{base}:{path}"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


def _new_classes() -> dict[str, tuple[pathlib.Path, ast.Module]]:
    """Where each class (and module-level function) lives now, wherever its file moved."""
    found: dict[str, tuple[pathlib.Path, ast.Module]] = {}
    for path in sorted((REPO / "daemon").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for n in tree.body:
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)):
                found.setdefault(n.name, (path, tree))
    return found


def _moved(mod: str) -> str:
    for old, new in MODULE_MOVES.items():
        if mod == old or mod.startswith(old + "."):
            return new + mod[len(old):]
    return mod


def _package(path: str) -> str:
    return ".".join(pathlib.PurePath(path).with_suffix("").parts[:-1])


class _Absolute(ast.NodeTransformer):
    """``from ..x import y`` -> ``from daemon.<...>.x import y`` (``remap``: old module names
    to where they live now; ``from . import warmup`` names a module, remapped as one)."""

    def __init__(self, package: str, remap: bool):
        self.package, self.remap = package, remap

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if not node.level:
            mod = node.module or ""
        else:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        if self.remap:
            names = [f"{mod}.{a.name}" for a in node.names]
            if all(n in MODULE_MOVES for n in names):  # `from . import warmup`
                mod = _moved(names[0]).rpartition(".")[0]
            else:
                mod = _moved(mod)
        return ast.ImportFrom(module=mod, names=node.names, level=0)


def _renamed(src: str, renames) -> str:
    for pat, rep in renames:
        src = re.sub(pat, rep, src)
    return src


def _old_fn(path: str, qual: str, base: str, renames) -> tuple[str | None, list[ast.stmt], ast.AST]:
    src = _old_source(path, base)
    node = _find(ast.parse(src), qual)
    text = textwrap.dedent(ast.get_source_segment(src, node, padded=True))
    fn = _Absolute(_package(path), remap=True).visit(ast.parse(_renamed(text, renames)).body[0])
    doc, body = _split_docstring(fn)
    return doc, body, fn


def _new_fn(where, cls: str | None, name: str) -> tuple[str | None, list[ast.stmt], ast.AST, pathlib.Path]:
    path, tree = where[cls or name]
    node = _find(tree, name if cls is None else f"{cls}.{name}")
    node = _Absolute(_package(str(path.relative_to(REPO))), remap=False).visit(
        ast.parse(textwrap.dedent(ast.get_source_segment(path.read_text(), node, padded=True))).body[0])
    doc, body = _split_docstring(node)
    return doc, body, node, path


def _dump(stmts: list[ast.stmt]) -> str:
    return "\n".join(ast.dump(s) for s in stmts)


def _diff(a: list[ast.stmt], b: list[ast.stmt]) -> str:
    return "\n".join(difflib.unified_diff("\n".join(ast.unparse(s) for s in a).splitlines(),
                                          "\n".join(ast.unparse(s) for s in b).splitlines(), "before", "after",
                                          lineterm=""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE)
    args = ap.parse_args(argv)
    where = _new_classes()
    bad, docs, n = [], [], 0
    for old_path, qual, cls, name in MOVES:
        renames = RENAMES.get(cls or "", [])
        old_doc, old_body, old_node = _old_fn(old_path, qual, args.base, renames)
        new_doc, new_body, new_node, new_path = _new_fn(where, cls, name)
        n += 1
        label = f"{old_path}:{qual} -> {new_path.relative_to(REPO)}:{(cls + '.') if cls else ''}{name}"
        same = _dump(old_body) == _dump(new_body) and ast.dump(old_node.args) == ast.dump(new_node.args)
        print(("same  " if same else "DIFF  ") + label)
        if not same:
            bad.append(label)
            print(textwrap.indent(_diff(old_body, new_body), "      "))
        if (old_doc or "") != (new_doc or ""):
            docs.append(label)
    for old_path, cname in SAME_CLASSES:
        src = _old_source(old_path, args.base)
        old = _Absolute(_package(old_path), remap=True).visit(_find(ast.parse(src), cname))
        new_path, tree = where[cname]
        new = _Absolute(_package(str(new_path.relative_to(REPO))), remap=False).visit(_find(tree, cname))
        n += 1
        same = ast.dump(old) == ast.dump(new)
        label = f"{old_path}:{cname} -> {new_path.relative_to(REPO)}:{cname}"
        print(("same  " if same else "DIFF  ") + label)
        if not same:
            bad.append(label)
    # the split function
    old_path, qual, pieces = SPLIT
    _, old_body, _ = _old_fn(old_path, qual, args.base, SPLIT_TAIL_RENAMES)
    new_body: list[ast.stmt] = []
    for cls, name in pieces:
        new_body += [s for s in _new_fn(where, cls, name)[1] if ast.unparse(s) not in GLUE]
    n += 1
    label = f"{old_path}:{qual} -> " + " + ".join(f"{c}.{m}" for c, m in pieces) + f" (less {len(GLUE)} glue statements)"
    same = _dump(old_body) == _dump(new_body)
    print(("same  " if same else "DIFF  ") + label)
    if not same:
        bad.append(label)
        print(textwrap.indent(_diff(old_body, new_body), "      "))
    print(f"\n{n} moved functions and classes compared against {args.base[:12]}: "
          f"{n - len(bad)} the same code modulo the renames, {len(bad)} different.")
    if docs:
        print(f"docstrings reworded (not compared): {len(docs)}: " + "; ".join(d.split(' -> ')[1] for d in docs))
    print("new code, not compared: " + "; ".join(NEW))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
