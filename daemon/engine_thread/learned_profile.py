"""The learned profile: what the governor measured and chose on this machine, kept in the
cache folder so that the next start begins there instead of at the config's priors.

`councild tune` writes the tuned profile (profile.py) on purpose; the daemon writes this one
as it runs: every ``SAVE_EVERY_S`` while it decodes, and when it stops. It carries the same
header (versions, device, model hash) and is refused on the same grounds, since a cost
measured under another stack or model says nothing about this one. Where both exist, the
tuned profile's costs win (measured on purpose, on a quiet machine) and the learned one
fills in what tuning does not measure: costs by batch height, and the depths chosen.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..logs import get_logger
from ..paths import cache_dir
from .profile import PROFILE_FORMAT, check_profile, current_device, current_versions, model_hash

log = get_logger("councild.tune")

# How often a running daemon writes what it learned (seconds, while its decode clock moves):
# a crash or a kill -9 then loses at most this much; a write is a few hundred bytes.
SAVE_EVERY_S = 60.0


def learned_path(model_path: str | Path) -> Path:
    return cache_dir() / f"learned-{model_hash(model_path)}.json"


def save_learned(table: dict, model_path: str | Path, path: Path | None = None) -> Path:
    """Write ``table`` (Governor.learned()) with the profile header, atomically: a reader
    never sees half a file, and a failed write leaves the last one."""
    p = path or learned_path(model_path)
    doc = {"format": PROFILE_FORMAT, "kind": "learned", "written_at": time.time(),
           "versions": current_versions(), "device": current_device(),
           "model": {"path": str(Path(model_path).expanduser().resolve()), "hash": model_hash(model_path)},
           **table}  # fmt: skip
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, p)
    return p


def load_learned(model_path: str | Path, path: Path | None = None) -> dict | None:
    """The learned profile for this model on this stack and device, or None (logged why)."""
    try:
        p = path or learned_path(model_path)
    except OSError as exc:  # the cache is optional: an unusable one never stops a start
        log.warning("learned.unavailable", error=f"{type(exc).__name__}: {exc}")
        return None
    if not p.exists():
        log.info("learned.absent", path=str(p), reason="no learned profile: this model's first run on this machine")
        return None
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        log.warning("learned.refused", path=str(p), reason=f"unreadable: {exc}")
        return None
    reason = check_profile(doc, model_path, need_serial=False)
    if reason is not None:
        log.warning("learned.refused", path=str(p), reason=reason, message="the governor starts from its priors")
        return None
    log.info("learned.loaded", path=str(p), age_s=round(time.time() - float(doc.get("written_at") or 0), 1),
             depths=doc.get("depths"), cost_s=doc.get("cost_s"), batch_cost_s=doc.get("batch_cost_s"),
             lost=doc.get("lost") or {}, rows=doc.get("rows"))
    return doc


def merged(tuned: dict | None, learned: dict | None) -> dict | None:
    """The governor's profile from both: the tuned costs and acceptance where tuning measured
    them, the learned ones elsewhere; costs by height, the chosen depths, the probes'
    verdicts (``lost``) and the row limit (``rows``) from the learned (either absent from a
    file written before it was kept)."""
    if not learned:
        return tuned
    out = {"cost_s": learned.get("cost_s") or {}, "acceptance": learned.get("acceptance") or [],
           "batch_cost_s": learned.get("batch_cost_s") or {}, "depths": learned.get("depths") or {},
           "lost": learned.get("lost") or {}}  # fmt: skip
    if "rows" in learned:
        out["rows"] = learned["rows"]
    for key in ("cost_s", "acceptance", "batch_cost_s"):
        if (tuned or {}).get(key):
            out[key] = tuned[key]
    return out


class LearnedSaver:
    """Writes the governor's learned table now and then, and at the stop. A failed write is
    logged and never stops the daemon (the cache folder is optional)."""

    def __init__(self, learned, model_path: str | Path, clock=time.monotonic):
        self._learned, self._model_path, self._clock = learned, model_path, clock
        self._next = clock() + SAVE_EVERY_S
        self._saved_decode_s = 0.0

    def maybe_save(self, decode_s: float) -> None:
        if self._clock() >= self._next and decode_s > self._saved_decode_s:
            self.save(decode_s)

    def save(self, decode_s: float) -> None:
        self._next = self._clock() + SAVE_EVERY_S
        if decode_s <= 0.0:
            return  # nothing decoded: nothing learned, and a file from an earlier run stays
        try:
            p = save_learned(self._learned(), self._model_path)
        except OSError as exc:
            log.warning("learned.not_saved", error=f"{type(exc).__name__}: {exc}")
            return
        self._saved_decode_s = decode_s
        log.info("learned.saved", path=str(p), decode_s=round(decode_s, 3))
