"""MLX's CUDA modules for the first steps, compiled side by side while the daemon imports and
reads its weights, so that neither "ready" nor the first round waits on them one at a time.

Why: MLX-on-CUDA compiles each JIT module (NVRTC) the first time an op needs it, under one
lock per process: a fresh H200 spent 30-52 s of the bundled model's start on 17 modules of
2.5-8 s each, and a fresh H100's first council round ran at a tenth of the later ones
(bench/results/h200_2026-12-05, issue 46). MLX looks in its PTX folder (MLX_PTX_CACHE_DIR) for
``<module>.ptx`` before it compiles, and a module's name says what it holds (dtypes, op graph;
never sizes): worker processes, one per recipe (prebuild_recipes.py), each compile one module
into a folder of their own, and the files are renamed into the daemon's folder, the name
table (.txt) before the binary (.ptx): MLX writes its files in place, and a reader between
its writes could load half a module. A manifest in the folder keeps which modules each recipe
gave, so a later start whose modules are all there runs no worker.

Whatever a worker misses or fails costs what it always did: MLX compiles that module itself
at first use. The binaries are for this machine's GPU; the folder is per MLX version
(backend_env.ptx_cache_folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .prebuild_recipes import AFTER_READY, RECIPES, recipes_for

__all__ = ["AFTER_READY", "MIN_CORES", "RECIPES", "KernelPrebuild", "model_float_dtype", "worker_count"]

MANIFEST = "councild-prebuild.json"
# A worker imports mlx, starts a CUDA context and compiles one module (2.5-8 s measured on the
# H200): far above that, it is stuck; the daemon has long gone on without it.
WORKER_TIMEOUT_S = 300.0
# Where ``python -m daemon...`` resolves: the checkout's root, or site-packages.
_IMPORT_ROOT = Path(__file__).resolve().parents[3]
# Below this many cores the workers would take the cores the daemon's own start needs.
MIN_CORES = 4


def model_float_dtype(config: dict) -> str:
    """The float dtype a model's config.json names (mlx-lm loads the weights as stored)."""
    for table in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            if isinstance(table.get(key), str) and table[key] in ("bfloat16", "float16", "float32"):
                return table[key]
    return "bfloat16"


def worker_count(recipes: int, cores: int | None, min_cores: int = MIN_CORES) -> int:
    """Workers at once: a core each, one left to the daemon (at least one); none below
    ``min_cores``."""
    cores = cores or 1
    return 0 if cores < min_cores else max(1, min(recipes, cores - 1))


class KernelPrebuild:
    """``start`` runs the workers from a thread of this process, which runs no mlx op itself
    (each worker is a ``python -m daemon.engine.jit.prebuild_recipes`` process); ``wait``
    waits, bounded, for every recipe but the ``after_ready`` ones (started last) and returns
    what it did (``report``); ``join`` waits for all of them (``final``), and ``on_finished``,
    where set, is called with ``final`` from the thread once a run that had after-ready
    recipes ends."""

    def __init__(self, ptx_dir: Path, float_dtype: str, workers: int, python: str = sys.executable,
                 recipes: tuple[str, ...] | None = None, after_ready: tuple[str, ...] = AFTER_READY):
        self.ptx_dir = Path(ptx_dir)
        self.float_dtype = float_dtype
        self.recipes = recipes if recipes is not None else recipes_for(float_dtype)
        self.after_ready = frozenset(after_ready)
        self.workers = max(1, workers)
        self.python = python
        self.report: dict | None = None
        self.final: dict | None = None
        self.on_finished = None
        self._t0 = 0.0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernel-prebuild", daemon=True)

    def start(self) -> KernelPrebuild:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def wait(self, timeout_s: float) -> dict:
        """Wait up to ``timeout_s`` for the workers of every recipe but the after-ready ones;
        the report, or one saying they still run (they go on, and what they finish is in the
        folder for whoever looks next)."""
        self._ready.wait(timeout_s)
        if self.report is None:
            return {"state": "still running", "waited_s": round(timeout_s, 1)}
        return self.report

    def join(self, timeout_s: float) -> dict | None:
        """Wait up to ``timeout_s`` for every recipe, the after-ready ones too; ``final``."""
        self._thread.join(timeout_s)
        return self.final

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            self.final = self._build()
        except Exception as exc:  # noqa: BLE001 - an unusable folder: the daemon compiles as before
            self.final = {"state": "failed", "error": f"{type(exc).__name__}: {exc}",
                          "seconds": round(time.monotonic() - self._t0, 2)}
        if self.report is None:
            self.report = self.final
        self._ready.set()
        if self.on_finished is not None and self.final.get("after_ready"):
            self.on_finished(self.final)

    def _build(self) -> dict:
        self.ptx_dir.mkdir(parents=True, exist_ok=True)
        remove_orphans(self.ptx_dir)
        manifest = read_manifest(self.ptx_dir)
        todo = [r for r in self.recipes if not modules_present(self.ptx_dir, manifest.get(r))]
        later = [r for r in todo if r in self.after_ready]
        todo = [r for r in todo if r not in self.after_ready] + later  # the after-ready ones start last
        failed: dict[str, str] = {}
        took: dict[str, float] = {}
        modules = 0
        pending = list(enumerate(todo))
        running: dict[str, tuple[subprocess.Popen, Path, float]] = {}

        def summary() -> dict:
            return {"state": "done", "recipes": len(self.recipes), "ran": len(todo), "modules": modules,
                    "failed": dict(failed), "workers": min(self.workers, len(todo)),
                    "after_ready": [r for r in later if r not in took],
                    "slowest": sorted(took.items(), key=lambda kv: -kv[1])[:3],
                    "seconds": round(time.monotonic() - self._t0, 2)}  # fmt: skip

        while pending or running:
            if self.report is None and all(r in took for r in todo if r not in self.after_ready):
                # What "ready" waits for is done: the rest goes on behind it. The manifest now
                # too, so that a daemon stopped before the rest end still skips these next time.
                if took:
                    write_manifest(self.ptx_dir, manifest)
                self.report = summary()
                self._ready.set()
            while pending and len(running) < self.workers:
                index, recipe = pending.pop(0)
                running[recipe] = self._spawn(recipe, index)
            time.sleep(0.05)
            for recipe, (proc, private, t0) in list(running.items()):
                code = proc.poll()
                if code is None and time.monotonic() - t0 < WORKER_TIMEOUT_S:
                    continue
                took[recipe] = round(time.monotonic() - t0, 2)
                if code is None:
                    proc.kill()
                    proc.wait()
                    failed[recipe] = f"no answer in {WORKER_TIMEOUT_S:.0f} s"
                elif code != 0:
                    failed[recipe] = _last_line(private / "stderr.log") or f"exit code {code}"
                else:
                    manifest[recipe] = move_modules(private, self.ptx_dir)
                    modules += len(manifest[recipe])
                shutil.rmtree(private, ignore_errors=True)
                del running[recipe]
        if todo:
            write_manifest(self.ptx_dir, manifest)
        out = summary()
        out["after_ready"] = later  # (all done now) the ones that ran behind "ready"
        return out

    def _spawn(self, recipe: str, index: int) -> tuple[subprocess.Popen, Path, float]:
        # Beside the folder (same file system, so a rename moves a file at once), never in it.
        private = self.ptx_dir.parent / f"{_private_prefix(self.ptx_dir)}{os.getpid()}-{index}"
        shutil.rmtree(private, ignore_errors=True)
        private.mkdir(parents=True)
        env = {**os.environ, "MLX_PTX_CACHE_DIR": str(private)}
        with open(private / "stderr.log", "wb") as err:  # a file, not a pipe: nothing to drain
            worker = "prebuild_custom" if recipe.startswith("custom ") else "prebuild_recipes"
            proc = subprocess.Popen([self.python, "-m", f"daemon.engine.jit.{worker}", recipe, self.float_dtype],
                                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    cwd=str(_IMPORT_ROOT))
        return proc, private, time.monotonic()


def _private_prefix(ptx_dir: Path) -> str:
    return f".{ptx_dir.name}-prebuild-"


def remove_orphans(ptx_dir: Path) -> list[Path]:
    """Remove the private folders of prebuilds whose daemon is gone (stopped mid-start: its
    workers finished into folders nobody moved); returns them."""
    gone = []
    for private in ptx_dir.parent.glob(f"{_private_prefix(ptx_dir)}*"):
        pid = private.name[len(_private_prefix(ptx_dir)):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(private, ignore_errors=True)
            gone.append(private)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive, not ours to touch
        return True
    return True


def move_modules(private: Path, ptx_dir: Path) -> list[str]:
    """Rename each module a worker wrote (``<name>.ptx`` with its ``.txt`` and ``.cu``; a long
    name is split into sub-folders by MLX) into ``ptx_dir``, the binary last; a module already
    there (the daemon compiled it first) is left as it is. Returns the modules' paths relative
    to the folders, the manifest's record of the recipe."""
    moved = []
    for ptx in sorted(private.rglob("*.ptx")):
        rel = ptx.relative_to(private)
        target = ptx_dir / rel
        moved.append(rel.as_posix())
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".cu", ".txt"):
            side = ptx.with_suffix(suffix)
            if side.exists():
                os.replace(side, target.with_suffix(suffix))
        os.replace(ptx, target)
    return moved


def modules_present(ptx_dir: Path, modules: list[str] | None) -> bool:
    """Whether a recipe ran before (the manifest lists what it gave) and all of that is there."""
    return modules is not None and all((ptx_dir / m).exists() for m in modules)


def read_manifest(ptx_dir: Path) -> dict[str, list[str]]:
    try:
        data = json.loads((ptx_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, list)} if isinstance(data, dict) else {}


def write_manifest(ptx_dir: Path, manifest: dict[str, list[str]]) -> None:
    tmp = ptx_dir / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, ptx_dir / MANIFEST)


def _last_line(path: Path) -> str:
    try:
        lines = path.read_bytes().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
