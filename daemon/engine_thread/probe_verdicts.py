"""The start-up exactness probes' verdicts, kept on disk so a restart need not probe again.

Probes run at every start: whether a speculative verify reproduces serial steps bit for
bit (engine/decoders/exactness.py ``verify_matches_serial``, per rollback strategy), whether batched
logits equal one-token ones (engine/decoders/batch.py ``batch_matches_serial``, per batch height)
and a ragged batched verify serial ones (``ragged_verify_matches_serial``), and whether
resuming a prefill off the chunk grid leaves a chunked prefill's state bit for bit
(engine/caches/prefix_cache.py ``splits_agree``, per prefill chunk: the prefix cache's
``splits_exact``), and, before all of them, whether the compiled one-token step is bit for
bit the eager one, for one row and for batches (engine/model/compiled.py ``self_check``,
engine/model/compiled_batch.py ``batch_self_check``; their key leaves out the decode paths, which
those checks decide). The verify and batch probes took about 1.3 s together on the
bundled model on CPU, longer on a big model. Their answer depends only on the code that computes the forwards,
the libraries under it, the device, and the model, so it is stored under the daemon's
cache folder keyed by all of those: the mlx, mlx-lm and councild versions, a hash of the
engine's source (a development tree changes code without changing its version), the
device, the model's parameter dtypes, decode paths (one row, batch) and prefill path, the
kernels the forward runs through (MLX's or the invariant ones, engine/kernels/invariant.py), and
the model's content hash (profile.model_hash). Any change to one of them is another file, so a stale verdict
is never read.

The cache is optional: an unusable cache folder, or a file that does not parse or does not
carry the verdict asked for, is a miss, and the probe runs. A process group serving one
model tensor-parallel never uses it: every rank must run the probe's collective forwards
together, and one rank's hit with another's miss would leave the other waiting.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from ..logs import get_logger
from ..paths import cache_dir
from .profile import current_device, current_versions, model_hash

log = get_logger("councild.engine")

VERDICTS_FORMAT = 1


def verdict_key(lm, *, decode_path: bool = True) -> dict:
    """Everything a probe's verdict depends on, for this loaded model here. Without
    ``decode_path``: the key of the compiled step's own self-check, which decides it."""
    from mlx.utils import tree_flatten

    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(lm.model.parameters())})
    return {"format": VERDICTS_FORMAT, "versions": current_versions(), **lm.arithmetic_key(),
            "device": current_device(), "dtypes": dtypes,
            "decode_path": lm.decode_path if decode_path else "(being decided)",
            "batch_decode_path": lm.batch_decode_path if decode_path else "(being decided)",
            "chunked_prefill": bool(lm.chunked_prefill), "model_hash": model_hash(lm.path)}


class ProbeVerdicts:
    """The verdicts file for one loaded model; ``folder`` None (or unusable) means no cache."""

    def __init__(self, lm, folder: Path | None, *, decode_path: bool = True):
        self.key = verdict_key(lm, decode_path=decode_path)
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        self.path = None if folder is None else Path(folder) / "probe-verdicts" / f"{digest}.json"

    def get(self, probe: str, variant: str, run: Callable[[], bool]) -> tuple[bool, str]:
        """The verdict of ``probe`` (e.g. "verify", "batch") for ``variant`` (a rollback
        strategy, a batch height), and "cached" or "probed": read from the file when it
        holds it, else ``run()`` and stored."""
        return self._kept(probe, variant, lambda: bool(run()), lambda v: isinstance(v, bool))

    def measure(self, probe: str, variant: str, run: Callable[[], float]) -> float:
        """A start-up measurement kept like a verdict (e.g. what a forward of several rows
        costs over one row's: the backend's answer, not the moment's load): read from the
        file when it holds it, else ``run()`` and stored."""
        value, _ = self._kept(probe, variant, lambda: float(run()),
                              lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
        return float(value)

    def _kept(self, probe: str, variant: str, run: Callable, valid: Callable[[object], bool]) -> tuple:
        """The stored value of ``probe``/``variant`` where ``valid`` takes it ("cached"), else
        ``run()``'s, stored ("probed")."""
        stored = self._read()
        value = stored.get(probe, {}).get(variant)
        if valid(value):
            return value, "cached"
        value = run()
        stored.setdefault(probe, {})[variant] = value
        self._write(stored)
        return value, "probed"

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # absent, unreadable or corrupt: a miss
            return {}
        if not isinstance(data, dict) or data.get("key") != self.key:
            return {}
        verdicts = data.get("verdicts")
        if not isinstance(verdicts, dict) or not all(isinstance(v, dict) for v in verdicts.values()):
            return {}
        return verdicts

    def _write(self, verdicts: dict) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": self.key, "verdicts": verdicts}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)  # readers see the old file or the new one, never half
        except OSError as exc:
            log.warning("cache.unavailable", path=str(self.path), error=f"{type(exc).__name__}: {exc}",
                        message="the probe's verdict is not stored; the next start probes again")


def verdicts_for(lm, group=None, *, decode_path: bool = True) -> ProbeVerdicts:
    """The verdicts cache for ``lm`` under the daemon's cache folder; none for a process group."""
    folder = None
    if group is None:
        try:
            folder = cache_dir()
        except OSError as exc:
            log.warning("cache.unavailable", path=exc.filename, error=f"{type(exc).__name__}: {exc.strerror or exc}",
                        message="the start-up probes' verdicts are not cached; they run at every start")
    return ProbeVerdicts(lm, folder, decode_path=decode_path)


class CompiledStepCheck:
    """``load_model``'s ``compile_check``: the compiled step's self-checks (engine/model/compiled.py:
    a few steps and verifies, eager and compiled, compared bit for bit; "self_check" for one
    row, 0.4-0.5 s of every start on the bundled model on CPU, and "batch_self_check" for
    batches) read from the verdicts file, each run on a miss. A cached "not identical"
    gives no reason (that start logged it): that path stays eager all the same.
    ``verdicts[variant]`` is "cached" or "probed" once it has answered; ``verdict`` is the
    one-row check's, ``batch_verdict`` the batches' (None when that check was not asked)."""

    def __init__(self, group=None):
        self.group = group
        self.verdicts: dict[str, str] = {}

    @property
    def verdict(self) -> str | None:
        return self.verdicts.get("self_check")

    @property
    def batch_verdict(self) -> str | None:
        return self.verdicts.get("batch_self_check")

    def __call__(self, lm, run: Callable[[], str | None], variant: str = "self_check") -> str | None:
        reason = None  # run()'s, when it runs on a miss

        def probe() -> bool:
            nonlocal reason
            reason = run()
            return reason is None

        verdicts = verdicts_for(lm, self.group, decode_path=False)
        ok, self.verdicts[variant] = verdicts.get("compiled_step", variant, probe)
        if ok:
            return None
        return reason or "compiled differs from eager (the verdict of an earlier start's self-check)"
