"""`councild tune`: measure this machine and write the profile the governor starts from.

For the model (default: the configured one, else the bundled model) it decodes a standard
prompt suite (the fidelity gate's fixed prompts, greedy) serially and at each depth, and
records what the governor's cost model reads: the engine's own per-cycle seconds
(``DecodeStep.cycle_s``, median per depth; depth 0 = one serial step) and the conditional
acceptance per draft position (accepted, given the positions before it were). Depths are
interleaved per prompt, serial first, after a warm-up pass, so drift lands on every depth.

It measures greedy decoding and, when the model's generation_config.json declares sampling
(do_sample with a temperature, top-p, top-k), also at those settings, since councils mostly
sample and acceptance under rejection sampling differs from greedy's. The governor starts
from the greedy measurements; the profile's ``sampling`` entries let the daemon cap a
request's depth at the best depth measured for its own sampling settings.

The profile (JSON) records the mlx, mlx-lm and councild versions, the device, and the
model's path and content hash; the daemon (``daemon.engine_thread.profile.load_profile``) refuses a
profile made with other versions, on another device, or for another model.

Default location: <cache dir>/profile-<model hash>.json (cache dir: $COUNCILD_CACHE_DIR,
else ~/.cache/councild or ~/Library/Caches/councild). `councild tune --show` prints it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from daemon.exits import EXIT_CONFIG
from daemon.measure.progress import Progress
from daemon.engine_thread.profile import (PROFILE_FORMAT, best_depth, check_profile, current_device, current_versions,
                            default_profile_path, model_hash)


def generation_sampling(model_path: str | Path) -> dict | None:
    """The sampling settings the model's generation_config.json declares ({temperature,
    top_p, top_k}), or None when it declares greedy decoding (do_sample false, as
    transformers reads it) or has no such file."""
    try:
        g = json.loads((Path(model_path) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    temperature = float(g.get("temperature") or 1.0)
    if not g.get("do_sample", False) or temperature <= 0:
        return None
    return {"temperature": temperature, "top_p": float(g.get("top_p") or 1.0), "top_k": int(g.get("top_k") or 0)}


def _decode(lm, head, prompt: list[int], depth: int, tokens: int, exact: bool, rollback: str,
            params: dict | None = None, seed: int = 0, guard_margin: float | None = None,
            ) -> tuple[list[float], list[list[bool]], int]:
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.decoders.speculative import speculative_decode
    from daemon.engine.types import SamplingParams

    sampler = Sampler(SamplingParams(**params, seed=seed) if params else SamplingParams())
    gen = serial_decode(lm, prompt, sampler) if depth == 0 else speculative_decode(
        lm, head, prompt, sampler, depth, exact=exact, rollback=rollback, guard_margin=guard_margin)
    cycles, masks, got = [], [], 0
    for step in gen:
        cycles.append(step.cycle_s)
        if step.drafted:
            masks.append(list(step.accepted_mask))
        got += len(step.tokens)
        if got >= tokens:
            break
    gen.close()
    return cycles[1:] or cycles, masks, got  # the first cycle waits on the prefill


def conditional_acceptance(masks: list[list[bool]], depth: int) -> tuple[list[float], list[int]]:
    num, den = [0] * depth, [0] * depth
    for m in masks:
        for i, ok in enumerate(m[:depth]):
            den[i] += 1
            num[i] += bool(ok)
            if not ok:
                break
    return [n / d if d else 0.0 for n, d in zip(num, den)], den


def tune(lm, head, prompts: list[list[int]], depths, tokens: int, exact: bool, rollback: str, progress=None,
         params: dict | None = None, *, guard_margin: float | None) -> dict:
    """Measure cost per depth and acceptance at ``params`` (None: greedy); returns the
    measured part of a profile. ``guard_margin``: exact mode's near-tie guard as the daemon
    runs it (exactness.exact_guard)."""
    depths = [0] + [d for d in depths if d > 0] if head is not None else [0]
    # warm-up: one short pass per depth (compiles kernels, fills caches), discarded
    for k in depths:
        _decode(lm, head, prompts[0], k, min(8, tokens), exact, rollback, params, guard_margin=guard_margin)
        if progress:
            progress.step(f"warm-up depth {k}")
    cycles: dict[int, list[float]] = {k: [] for k in depths}
    tok_s: dict[int, list[float]] = {k: [] for k in depths}
    masks: dict[int, list] = {k: [] for k in depths}
    for i, p in enumerate(prompts):
        order = depths if i % 2 == 0 else list(reversed(depths))
        for k in order:
            t = time.perf_counter()
            c, m, got = _decode(lm, head, p, k, tokens, exact, rollback, params, seed=i, guard_margin=guard_margin)
            tok_s[k].append(got / (time.perf_counter() - t))
            cycles[k] += c
            masks[k] += m
            if progress:
                progress.step(f"prompt {i + 1}/{len(prompts)} depth {k}")
    max_d = max(depths)
    acc, den = conditional_acceptance(masks[max_d], max_d) if max_d else ([], [])
    return {
        "cost_s": {str(k): statistics.median(v) for k, v in cycles.items() if v},
        "acceptance": acc,
        "acceptance_samples": den,
        "acceptance_by_depth": {str(k): conditional_acceptance(masks[k], k)[0] for k in depths if k},
        "cycles": {str(k): len(v) for k, v in cycles.items()},
        "tok_s": {str(k): statistics.median(v) for k, v in tok_s.items() if v},
    }


def format_profile(p: dict) -> str:
    lines = [f"profile for {p['model']['path']} (hash {p['model']['hash']})",
             f"  made {p.get('created')} on {p.get('device')}; " + ", ".join(f"{k} {v}" for k, v in p["versions"].items()),
             f"  mode {p.get('mode')}, rollback {p.get('rollback')}, {p.get('suite', {}).get('prompts')} prompts x "
             f"{p.get('suite', {}).get('tokens')} tokens",
             "  depth | cycle ms | tok/s | E(k) | predicted tok/s"]
    acc = p.get("acceptance") or []
    for k, c in sorted(p["cost_s"].items(), key=lambda kv: int(kv[0])):
        e, run = 1.0, 1.0
        for a in acc[: int(k)]:
            run *= a
            e += run
        lines.append(f"  {int(k):5d} | {1000 * c:8.2f} | {p.get('tok_s', {}).get(k, float('nan')):5.1f} | {e:4.2f} | {e / c:6.1f}")
    lines.append("  conditional acceptance by position: " + (" ".join(f"{a:.3f}" for a in acc) or "-"))
    for name, entry in (p.get("sampling") or {}).items():
        lines.append(f"  {name} {entry.get('params') or 'temperature 0'}: best depth {best_depth(entry)}, acceptance "
                     + (" ".join(f"{a:.3f}" for a in entry.get("acceptance") or []) or "-"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder or pulled Hub repo id org/name (default: config, else the bundled model)")
    ap.add_argument("--config", help="TOML config (mode and max depth)")
    ap.add_argument("--out", help="profile path (default: <cache dir>/profile-<model hash>.json)")
    ap.add_argument("--depths", default=None, help="depths to measure (default 1..governor.max_depth)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per prompt per depth")
    ap.add_argument("--prompts", type=int, default=6, help="how many of the standard prompts")
    ap.add_argument("--rollback", choices=("capture", "snapshot"))
    ap.add_argument("--show", action="store_true", help="print the profile for the model and whether it would load")
    ap.add_argument("--json", action="store_true", help="with --show: print the raw JSON")
    ap.add_argument("--no-sampling", dest="sampling", action="store_false",
                    help="measure greedy only, not also at the generation_config's sampling settings")
    args = ap.parse_args(argv)

    from daemon.paths import resolve_model
    from daemon.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"councild tune: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from daemon.models.refs import ModelRefError

    try:
        model = resolve_model(args.model or cfg.model)  # a folder or a pulled org/name
    except ModelRefError as exc:
        print(f"councild tune: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    path = Path(args.out) if args.out else default_profile_path(model)

    if args.show:
        if not path.exists():
            print(f"councild tune: no profile at {path}; run `councild tune`", file=sys.stderr)
            return 1
        p = json.loads(path.read_text())
        print(json.dumps(p, indent=2) if args.json else format_profile(p))
        reason = check_profile(p, model)
        print(f"{path}: " + ("loads for this model and stack" if reason is None else f"would be refused: {reason}"),
              file=sys.stderr)
        return 0

    import mlx.core as mx

    from daemon.measure.fidelity import load_prompts
    from daemon.engine.model.loading import load_model
    from daemon.engine.model.mtp_head import NoMTPHead, load_mtp_head
    from daemon.engine.decoders.speculative import DEFAULT_ROLLBACK

    from governor import load_config as load_governor_config

    # speculation.max_depth is gone (0db58c7): the governor's max_depth bounds the depth.
    max_depth = load_governor_config(cfg.governor).max_depth
    depths = [int(d) for d in args.depths.split(",")] if args.depths else list(range(1, max_depth + 1))
    # The daemon's rollback unless told otherwise, so the profile measures what it will run.
    rollback = args.rollback or cfg.speculation.rollback or DEFAULT_ROLLBACK
    exact = cfg.speculation.mode != "fast"
    mx.random.seed(0)
    lm = load_model(model, compile_decode=cfg.compile_decode)  # the decode path the daemon will run
    try:
        head = load_mtp_head(lm)
    except NoMTPHead as exc:
        print(f"councild tune: {exc}; measuring serial only", file=sys.stderr)
        head = None
    all_prompts = load_prompts()
    prompts = [lm.encode_prompt(p, None, None) for p in all_prompts[: max(1, args.prompts)]]
    n_depths = 1 + (len([d for d in depths if d > 0]) if head is not None else 0)
    from daemon.engine.decoders.exactness import exact_guard

    # The guard as the daemon runs exact mode: off where the probe proves verify bit-identical.
    guard = exact_guard(lm, rollback, cfg.speculation.guard_margin) if head is not None else None
    # Greedy, and the sampling settings the model's generation_config declares (councils
    # mostly sample, and acceptance under rejection sampling is not greedy's).
    gen = generation_sampling(model) if args.sampling else None
    progress = Progress("tune", n_depths * (1 + len(prompts)) * (2 if gen else 1))
    measured = tune(lm, head, prompts, depths, args.tokens, exact, rollback, progress, guard_margin=guard)
    sampling = {"greedy": {"params": None, **measured}}
    if gen:
        sampling["generation_config"] = {"params": gen, **tune(lm, head, prompts, depths, args.tokens, exact,
                                                               rollback, progress, params=gen, guard_margin=guard)}
    profile = {
        "format": PROFILE_FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": current_versions(),
        "device": current_device(),
        "platform": platform.platform(),
        "model": {"path": str(Path(model).expanduser().resolve()), "hash": model_hash(model)},
        "mode": "exact" if exact else "fast",
        "rollback": rollback,
        "guard_margin": guard,
        "decode_path": lm.decode_path,
        "suite": {"prompts": len(prompts), "tokens": args.tokens, "source": "daemon/measure/fidelity_prompts.json"},
        **measured,  # greedy: what the governor's cost model starts from
        # Per sampling setting (greedy, the generation_config's): the worker caps a
        # request's depth at its setting's best depth (daemon.engine_thread.profile.sampling_entry, best_depth).
        "sampling": sampling,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(path)
    progress.finish(f"{len(sampling)} sampling setting(s) x {n_depths} depth(s), profile {path}")
    print(format_profile(profile))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
