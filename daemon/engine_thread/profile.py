"""The tuned profile the daemon starts its governor from: where it lives, whether it fits
this stack and model, and the part the governor reads. Written by `councild tune`
(daemon/measure/tune.py); read by the running daemon, which imports nothing of the
measurement wing.

A profile records the mlx, mlx-lm and councild versions, the device, and the model's path
and content hash; ``load_profile`` refuses (returns None and logs why) a profile made with
other versions, on another device, or for another model, since a cost measured under
another stack says nothing about this one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

PROFILE_FORMAT = 1
_CHUNK = 1 << 16


def model_hash(model_path: str | Path) -> str:
    """Content hash of a model folder, cheap even at 50 GB: config.json, and per weight file
    its name, size, and first and last 64 KiB (the safetensors header and the tail)."""
    folder = Path(model_path).expanduser().resolve()
    h = hashlib.sha256()
    cfg = folder / "config.json"
    h.update(cfg.read_bytes() if cfg.exists() else b"")
    for f in sorted(list(folder.glob("*.safetensors")) + list(folder.glob("*.npz"))):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_CHUNK))
            if size > _CHUNK:
                fh.seek(max(_CHUNK, size - _CHUNK))
                h.update(fh.read(_CHUNK))
    return h.hexdigest()[:16]


def current_versions() -> dict:
    import mlx.core as mx
    import mlx_lm

    from daemon import __version__

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "councild": __version__}


def current_device() -> str:
    import mlx.core as mx

    dev = str(mx.default_device())
    try:
        name = mx.device_info().get("device_name")
        if name:
            dev += f" {name}"
    except Exception:  # noqa: BLE001
        pass
    return dev


def default_profile_path(model_path: str | Path) -> Path:
    from daemon.paths import cache_dir

    return cache_dir() / f"profile-{model_hash(model_path)}.json"


def check_profile(profile: dict, model_path: str | Path, versions: dict | None = None,
                  device: str | None = None, need_serial: bool = True) -> str | None:
    """None when the profile fits this stack and model, else the reason it does not. A tuned
    profile must carry the serial cost; a learned one (learned_profile.py) need not, since a
    council may never have decoded one stream alone."""
    if profile.get("format") != PROFILE_FORMAT:
        return f"profile format {profile.get('format')!r}, expected {PROFILE_FORMAT}"
    versions = versions or current_versions()
    for k, v in versions.items():
        got = (profile.get("versions") or {}).get(k)
        if got != v:
            return f"made with {k} {got}, running {v}"
    device = device or current_device()
    if profile.get("device") != device:
        return f"made on device {profile.get('device')!r}, running on {device!r}"
    want = model_hash(model_path)
    got = (profile.get("model") or {}).get("hash")
    if got != want:
        return f"made for model hash {got} ({(profile.get('model') or {}).get('path')}), this model is {want}"
    if need_serial and (not isinstance(profile.get("cost_s"), dict) or "0" not in profile["cost_s"]):
        return "profile has no serial cost"
    return None


def load_profile(model_path: str | Path, path: str | Path | None = None, *, versions: dict | None = None,
                 device: str | None = None) -> dict | None:
    """The tuned profile for this model on this stack, or None (with a logged reason)."""
    from daemon.logs import get_logger

    log = get_logger("councild.tune")
    try:
        p = Path(path) if path is not None else default_profile_path(model_path)
    except OSError as exc:  # the cache is optional: an unusable one never stops a start
        log.warning("cache.unavailable", path=exc.filename, error=f"{type(exc).__name__}: {exc.strerror or exc}",
                    message="no tuned profile can be read; the governor starts from its priors")
        return None
    if not p.exists():
        log.info("profile.absent", path=str(p), reason="no tuned profile; the governor starts from its priors")
        return None
    try:
        profile = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        log.warning("profile.refused", path=str(p), reason=f"unreadable: {exc}")
        return None
    reason = check_profile(profile, model_path, versions, device)
    if reason is not None:
        log.warning("profile.refused", path=str(p), reason=reason, message="run `councild tune` again")
        return None
    log.info("profile.loaded", path=str(p), cost_s=profile["cost_s"], acceptance=profile.get("acceptance"))
    return profile


def governor_profile(profile: dict | None) -> dict | None:
    """Just the keys the governor's cost model reads ({"cost_s", "acceptance"}, and
    "batch_cost_s", seconds per row of a batched cycle by height then depth, when a profile
    carries it: `councild tune` does not measure it yet, since a batched speculative cycle is
    the worker's to build; the cost model takes it as a prior per bucket of heights)."""
    if not profile:
        return None
    out = {"cost_s": profile.get("cost_s", {}), "acceptance": profile.get("acceptance", [])}
    if profile.get("batch_cost_s"):
        out["batch_cost_s"] = profile["batch_cost_s"]
    return out


def sampling_entry(profile: dict | None, temperature: float, top_p: float = 1.0, top_k: int = 0) -> dict | None:
    """The profile's measurements for a request's sampling settings: the greedy entry at
    temperature 0, else the entry tuned at exactly these settings (the generation_config's),
    else None (nothing measured there: the governor's depth alone applies)."""
    entries = (profile or {}).get("sampling") or {}
    for entry in entries.values():
        params = entry.get("params")
        if temperature == 0.0 and params is None:
            return entry
        if params is not None and temperature > 0 and (params["temperature"], params["top_p"], params["top_k"]) == (
                temperature, top_p, top_k):
            return entry
    return None


def best_depth(entry: dict) -> int:
    """argmax over the measured depths of E(k) / cost(k) (ties to the shallower)."""
    cost = {int(k): float(v) for k, v in (entry.get("cost_s") or {}).items() if float(v) > 0}
    acc = entry.get("acceptance") or []
    best, best_score = 0, None
    for k in sorted(cost):
        e, run = 1.0, 1.0
        for a in acc[:k]:
            run *= a
            e += run
        score = e / cost[k]
        if best_score is None or score > best_score:
            best, best_score = k, score
    return best
