"""Governor benchmark: the governor (auto) against every fixed depth, under real contention.

One daemon per arm serves the bundled model (only one is ever generating): "auto" runs the
governor untouched; arm "dk" is pinned to depth k (``client.governor("pin_depth", k)``).
Separate daemons keep the fixed arms' measurements out of the governor's cost model (it
learns only from its own traffic), and give every arm the same duty cycle: each daemon
decodes for one sample in six and idles otherwise (a first version ran all fixed arms on one
daemon, always warm, while the auto daemon idled ~40 s between its samples and paid for it
in stretched cycles at the start of each burst: ``--shared-fixed`` keeps that layout).

Contention is real: helper processes (bench/contention.py) that burn CPU and hold touched
memory are started and stopped on a schedule of regimes:

    quiet  nothing beside the daemon
    busy   two busy-looping processes (this machine has 2 cores)
    mixed  one busy loop, a second one switched on/off every --toggle-s, and 1 GiB held
    councilN  council load: N concurrent streams (N clients, each its own seat,
           each sending --requests requests one after another); a sample's tokens/s is all
           streams' tokens over the sample's wall time. council1 is one stream.

Under council load the daemon batches streams that run together at depth 0 (the worker
starts a request in the batch when others are active, whatever the pinned depth; the
governor forces depth 0 for a stream that was speculating when others joined), so a fixed
depth k > 0 differs from d0 only in the stream that started alone. The auto arm's
batched cycles per regime are read from its trace ("batched_cycles").

Interleaved: for each round, for each regime (its helpers started once), for each arm, one
sample = a fixed generation workload (--requests requests of --max-tokens tokens,
temperature 0, speculation "exact") timed by wall clock. Arm order alternates ABAB / BABA
between rounds. Reported: median tokens/s per regime and arm, with min-max and IQR, and
overall (all samples' tokens over their time). The auto daemon writes a governor trace; each
auto sample's cycles are read back from it (depth histogram), and its ``governor.decision``
log events are counted by kind, to explain what the governor did.

    python bench/governor_bench.py --rounds 5            # ~10-15 min on 2 cores
    python bench/governor_bench.py --rounds 1 --requests 1 --max-tokens 16   # smoke run

Before the daemons start, ``councild tune`` measures the model once into the workdir's cache
dir (COUNCILD_CACHE_DIR, for tune and for every daemon), as a deployed daemon would have run
it: the governor starts from that profile (its best depth, its cost ratios). ``--no-tune``
gives the daemons an empty cache dir instead (runs 1-6: no profile, priors only). The result
JSON records whether a profile was used, its contents, and what the auto daemon made of it.

Goal (first 5%, then tightened to 3%): auto within 3% of the best fixed depth in each regime
(--goal-ratio), and ahead of every fixed depth overall. The table says whether it was met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]


from contention import burn, hold  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client  # noqa: E402
from protocol.readiness import wait_until_answering  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef walk(path):\n",
    "def quicksort(items):\n",
]
REGIMES = ("quiet", "busy", "mixed")
COUNCIL = ("council1", "council2", "council4", "council8")


def council_streams(regime: str) -> int:
    """councilN -> N; 1 for the contention regimes (one stream)."""
    return int(regime[len("council"):]) if regime.startswith("council") else 1


# ---------------------------------------------------------------- daemons


class Daemon:
    def __init__(self, name: str, workdir: Path, model: Path, config: str, cache_dir: Path):
        self.name = name
        run = workdir / name
        run.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.endpoint = f"ipc://{run / 'councild.sock'}"
        self.log_path = run / "daemon.log"
        self.trace_path = run / "governor.trace.jsonl"
        cfg = run / "councild.toml"
        cfg.write_text(f'governor_trace = "{self.trace_path}"\n' + config)
        cmd = [sys.executable, "-m", "daemon.cli", "serve", "--model", str(model), "--endpoint", self.endpoint,
               "--log-format", "json", "--config", str(cfg)]
        env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(run), COUNCILD_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        wait_until_answering(self.endpoint, self.proc, timeout_s=timeout_s, log_path=self.log_path,
                             name=f"{self.name} daemon")

    def events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def run_tune(model: Path, cache_dir: Path, config: str, workdir: Path) -> dict:
    """``councild tune`` for the model into ``cache_dir`` (the daemons' COUNCILD_CACHE_DIR),
    with the daemons' [speculation] settings; returns the profile and how it was made."""
    cfg = workdir / "tune.toml"
    cfg.write_text(config)
    env = dict(os.environ, COUNCILD_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "daemon.cli", "tune", "--model", str(model), "--config", str(cfg)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    secs = round(time.perf_counter() - t0, 1)
    (workdir / "tune.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"councild tune failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    paths = sorted(cache_dir.glob("profile-*.json"))
    if len(paths) != 1:
        raise RuntimeError(f"councild tune left {len(paths)} profiles in {cache_dir}")
    print(proc.stdout, end="", flush=True)
    return {"used": True, "path": str(paths[0]), "tune_s": secs, "tune_command": " ".join(cmd[1:]),
            "contents": json.loads(paths[0].read_text())}


def profile_seen_by(daemon: "Daemon") -> dict:
    """What a daemon's log says about the profile (profile.loaded / absent / refused) and
    the governor's start decision."""
    out: dict = {}
    for e in daemon.events():
        ev = e.get("event")
        if ev in ("profile.loaded", "profile.absent", "profile.refused") and "profile_event" not in out:
            out["profile_event"] = {k: e.get(k) for k in ("event", "path", "reason", "cost_s", "acceptance") if k in e}
        if ev == "governor.decision" and e.get("decision") == "start_depth" and "start" not in out:
            out["start"] = {k: e.get(k) for k in ("depth", "depth_from", "depth_to", "sentence", "scores", "sources")}
    return out


# ---------------------------------------------------------------- contention schedule


class Regime:
    """Start a regime's helpers on enter, stop (and reap) them all on exit."""

    def __init__(self, name: str, toggle_s: float, hold_mb: int):
        self.name, self.toggle_s, self.hold_mb = name, toggle_s, hold_mb
        self.helpers = []
        self._stop = threading.Event()
        self._toggler: threading.Thread | None = None

    def __enter__(self) -> "Regime":
        try:
            if self.name == "busy":
                self.helpers += [burn(), burn()]
            elif self.name == "mixed":
                self.helpers.append(hold(self.hold_mb))
                self.helpers.append(burn())
                flapping = burn()
                self.helpers.append(flapping)
                self._toggler = threading.Thread(target=self._toggle, args=(flapping.proc.pid,), daemon=True)
                self._toggler.start()
            elif self.name != "quiet" and not (self.name.startswith("council") and self.name[7:].isdigit()):
                raise ValueError(f"unknown regime {self.name!r}")
        except BaseException:
            self.__exit__()
            raise
        time.sleep(0.5)  # let the helpers get going
        return self

    def _toggle(self, pid: int) -> None:
        on = True
        while not self._stop.wait(self.toggle_s):
            on = not on
            try:
                os.kill(pid, signal.SIGCONT if on else signal.SIGSTOP)
            except ProcessLookupError:
                return
        try:
            os.kill(pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        except ProcessLookupError:
            pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._toggler is not None:
            self._toggler.join(timeout=5)
        for h in self.helpers:
            try:
                os.kill(h.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            h.proc.terminate()
            h.stop()
        self.helpers.clear()


# ---------------------------------------------------------------- one sample


def _stream(endpoint: str, seat: str, prompts: list[str], max_tokens: int, totals: list, errors: list) -> None:
    try:
        with Client(endpoint, seat=seat, timeout_s=300) as c:
            for p in prompts:
                done = c.complete(p, max_tokens=max_tokens, speculation="exact")
                sp = done.speculation
                totals.append((done.usage.completion_tokens, sp.cycles if sp else 0, sp.drafted if sp else 0,
                               sp.accepted if sp else 0))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 (reported by the caller)
        errors.append(repr(exc))


def sample(client: Client, arm: str, requests: int, max_tokens: int, offset: int, streams: int = 1,
           endpoint: str | None = None) -> dict:
    if arm != "auto":
        reply = client.governor("pin_depth", int(arm[1:]))
        if not reply.ok or reply.state["depth"] != int(arm[1:]):
            raise RuntimeError(f"could not pin {arm}: {reply}")
    before = client.status().detail["governor"]
    t0_mono = time.monotonic()
    t0 = time.perf_counter()
    totals: list = []
    if streams == 1:
        for i in range(requests):
            done = client.complete(PROMPTS[(offset + i) % len(PROMPTS)], max_tokens=max_tokens, speculation="exact")
            sp = done.speculation
            totals.append((done.usage.completion_tokens, sp.cycles if sp else 0, sp.drafted if sp else 0,
                           sp.accepted if sp else 0))  # fmt: skip
    else:
        errors: list = []
        threads = [threading.Thread(target=_stream, args=(
            endpoint, f"council{j}", [PROMPTS[(offset + j + i) % len(PROMPTS)] for i in range(requests)],
            max_tokens, totals, errors)) for j in range(streams)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"council streams failed: {errors}")
    wall = time.perf_counter() - t0
    tokens = sum(x[0] for x in totals)
    cycles, drafted, accepted = (sum(x[i] for x in totals) for i in (1, 2, 3))
    after = client.status().detail["governor"]
    return {
        "arm": arm, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "t0": t0_mono, "t1": time.monotonic(),
        "cycles": cycles, "drafted": drafted, "accepted": accepted,
        "depth_before": before.get("depth"), "depth_after": after.get("depth"),
        "scores_after": [d.get("score") for d in after.get("cost_model", {}).get("depths", [])],
        "loadavg": os.getloadavg()[0], "streams": streams,
    }  # fmt: skip


# ---------------------------------------------------------------- analysis


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _trace_text(path: Path) -> str:
    if path.suffix == ".gz":
        import gzip

        return gzip.decompress(path.read_bytes()).decode()
    return path.read_text()


def _find_traces(result: dict, out_json: Path, workdir: str | None) -> dict[str, Path]:
    """The auto and fixed daemons' traces: in the run's workdir, else the gzipped copies
    committed beside the JSON (<stem>_traces/{auto,fixed}.trace.jsonl.gz)."""
    found = {}
    for name in (*result["meta"]["arms"], "fixed"):
        for cand in (Path(workdir or result["meta"]["workdir"]) / name / "governor.trace.jsonl",
                     out_json.parent / f"{out_json.stem}_traces" / f"{name}.trace.jsonl.gz"):  # fmt: skip
            if cand.exists():
                found[name] = cand
                break
    return found


def _trace_cycles(path: Path) -> list[tuple[float, int, float, int]]:
    """(t, depth, cycle_s, emitted) of every decode cycle in a governor trace."""
    out = []
    if not path.exists():
        return out
    for line in _trace_text(path).splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "cycle":
            c = rec["cycle"]
            out.append((rec["t"], int(c.get("depth", 0)), float(c.get("cycle_s", 0.0)), int(c.get("emitted", 1))))
    return out


def cycle_stats(samples: list[dict], traces: dict[str, Path], arms: list[str], regimes: list[str]) -> dict:
    """Per regime and arm, from the daemons' traces: median and p90 cycle time, tokens per
    cycle, and tokens / (cycles x median cycle time), a throughput that ignores the cycles
    stretched by preemption (the other processes on the box), i.e. what the depth is worth
    when the daemon does get the CPU."""
    cycles = {name: _trace_cycles(p) for name, p in traces.items()}
    out: dict = {r: {} for r in regimes}
    for r in regimes:
        for a in arms:
            cs = cycles.get(a) or cycles.get("fixed", [])
            sel = [c for s in samples if s["regime"] == r and s["arm"] == a and not s["warmup"]
                   for c in cs if s["t0"] <= c[0] <= s["t1"]]  # fmt: skip
            if not sel:
                continue
            ts = [c[2] for c in sel]
            toks = sum(c[3] for c in sel)
            med = statistics.median(ts)
            out[r][a] = {"cycles": len(sel), "median_cycle_ms": round(med * 1e3, 2),
                         "p90_cycle_ms": round(_q(ts, 0.9) * 1e3, 2), "tokens_per_cycle": round(toks / len(sel), 3),
                         "robust_tok_s": round(toks / len(sel) / med, 1),
                         "preempted_share": round(sum(t for t in ts if t > 2 * med) / sum(ts), 3)}  # fmt: skip
    return out


def _bootstrap_ratio(by_arm: dict[str, list[float]], fixed: list[str], n: int = 2000, seed: int = 0) -> list[float]:
    """90% bootstrap interval of median(auto) / max over fixed arms of median(arm): how much
    of a miss (or a win) the noise alone could make. Note the max over 5 noisy medians is
    biased upward, so even an arm as good as the best one lands below 1.0 on average."""
    import random

    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        def med(xs):
            return statistics.median(rng.choice(xs) for _ in xs)

        best = max(med(by_arm[a]) for a in fixed)
        ratios.append(med(by_arm["auto"]) / best)
    return [round(_q(ratios, 0.05), 3), round(_q(ratios, 0.95), 3)]


def summarize(samples: list[dict], arms: list[str], regimes: list[str], goal_ratio: float = 0.97) -> dict:
    per: dict = {}
    for r in regimes:
        per[r] = {}
        for a in arms:
            xs = [s["tok_s"] for s in samples if s["regime"] == r and s["arm"] == a and not s["warmup"]]
            if xs:
                per[r][a] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
                             "iqr": _q(xs, 0.75) - _q(xs, 0.25), "n": len(xs)}  # fmt: skip
    overall = {}
    for a in arms:
        ss = [s for s in samples if s["arm"] == a and not s["warmup"]]
        if ss:
            overall[a] = {"tok_s": sum(s["tokens"] for s in ss) / sum(s["wall_s"] for s in ss),
                          "mean_of_regime_medians": statistics.mean(per[r][a]["median"] for r in regimes if a in per[r])}
    fixed = [a for a in arms if a != "auto"]
    goal = {}
    if "auto" in arms and fixed:
        for r in regimes:
            best = max(fixed, key=lambda a: per[r][a]["median"])
            ratio = per[r]["auto"]["median"] / per[r][best]["median"]
            by_arm = {a: [s["tok_s"] for s in samples if s["regime"] == r and s["arm"] == a and not s["warmup"]]
                      for a in arms}  # fmt: skip
            goal[r] = {"best_fixed": best, "auto_vs_best": ratio, "met": ratio >= goal_ratio,
                       "ci90": _bootstrap_ratio(by_arm, fixed)}  # fmt: skip
        best_o = max(fixed, key=lambda a: overall[a]["tok_s"])
        ratio = overall["auto"]["tok_s"] / overall[best_o]["tok_s"]
        goal["overall"] = {"best_fixed": best_o, "auto_vs_best": ratio, "met": ratio > 1.0}
    return {"per_regime": per, "overall": overall, "goal": goal}


def estimator_check(samples: list[dict], fixed_traces: list[Path], regimes: list[str], margin: float = 0.10,
                    probe_s: float = 2.0, trials: int = 2000, seed: int = 1) -> dict:
    """How often would the governor's comparison pick the worse of two neighbouring depths?
    Cycles are drawn (iid, so this is optimistic: real contention is also correlated in time)
    from the fixed daemon's recorded cycles of each depth in each regime: the better depth's
    estimate from 40 recent cycles, the worse one's from a probe_s probe. 'Better' is by
    tokens per cycle / median cycle time. Estimators: the cost model's EWMA (alpha 0.1,
    bias-corrected start) and the median of the same cycles."""
    import random

    cyc = [c for p in fixed_traces for c in _trace_cycles(p)]
    rng = random.Random(seed)

    def ewma(xs: list[float], alpha: float = 0.1) -> float:
        v, n = 0.0, 0
        for x in xs:
            n += 1
            v += max(alpha, 1.0 / n) * (x - v)
        return v

    out = {}
    for r in regimes:
        pools = {}
        for k in range(5):
            pools[k] = [c for s in samples if s["regime"] == r and s["arm"] == f"d{k}" and not s["warmup"]
                        for c in cyc if s["t0"] <= c[0] <= s["t1"]]  # fmt: skip
        if any(not v for v in pools.values()):
            continue
        truth = {k: (sum(c[3] for c in v) / len(v)) / statistics.median(c[2] for c in v) for k, v in pools.items()}
        res = {}
        for name, agg in (("ewma_0.1", ewma), ("median", statistics.median)):
            wrong = 0
            for _ in range(trials):
                a = rng.randrange(4)
                good, bad = (a, a + 1) if truth[a] >= truth[a + 1] else (a + 1, a)
                n_bad = max(4, int(probe_s / statistics.median(c[2] for c in pools[bad])))
                g = [rng.choice(pools[good]) for _ in range(40)]
                b = [rng.choice(pools[bad]) for _ in range(n_bad)]
                sg = (sum(c[3] for c in g) / len(g)) / agg([c[2] for c in g])
                sb = (sum(c[3] for c in b) / len(b)) / agg([c[2] for c in b])
                wrong += sb >= (1 + margin) * sg
            res[name] = round(wrong / trials, 3)
        out[r] = {"robust_score": {k: round(v, 1) for k, v in truth.items()}, "p_wrong_move": res}
    return out


def probe_stats(samples: list[dict], trace: Path) -> dict:
    """Replay the auto daemon's trace through the policy (governor.replay gives the same
    decisions with the trace's monotonic times) and measure how much of the auto arm's
    sample time went to probes, and how many probes began in a burst's first second."""
    from governor.replay import replay

    if not trace.exists():
        return {}
    rows = replay(_trace_text(trace).splitlines())
    probes, start = [], None
    for r in rows:
        kinds = [d["decision"] for d in r["decisions"]]
        if "probe" in kinds:
            start = r["t"]
        if "probe_end" in kinds and start is not None:
            probes.append((start, r["t"]))
            start = None
    auto = [s for s in samples if s["arm"] == "auto" and not s["warmup"]]
    total = sum(s["t1"] - s["t0"] for s in auto)
    inside = sum(max(0.0, min(b, s["t1"]) - max(a, s["t0"])) for s in auto for a, b in probes)
    early = sum(1 for s in auto for a, _ in probes if s["t0"] <= a <= s["t0"] + 1.0)
    gaps = [b["t0"] - a["t1"] for a, b in zip(auto, auto[1:])]
    return {"probes": len(probes), "auto_sample_s": round(total, 1), "probing_s": round(inside, 1),
            "probing_share": round(inside / total, 3) if total else None, "probes_in_first_second": early,
            "depth_moves": sum(1 for r in rows for d in r["decisions"] if d["decision"] == "depth"),
            "median_gap_between_auto_samples_s": round(statistics.median(gaps), 1) if gaps else None}  # fmt: skip


def _batched_times(path: Path) -> list[float]:
    """Times of the batched steps (several streams in one forward) in a governor trace."""
    out = []
    if not path.exists():
        return out
    for line in _trace_text(path).splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "cycle" and int(rec["cycle"].get("batch", 1)) > 1:
            out.append(rec["t"])
    return out


def auto_diagnostics(samples: list[dict], daemon: Daemon, regimes: list[str]) -> dict:
    cycles = [c for c in _trace_cycles(daemon.trace_path)]
    batched = _batched_times(daemon.trace_path)
    batched_set = set(batched)
    depth_hist: dict[str, Counter] = {r: Counter() for r in regimes}
    for s in samples:
        if s["arm"] != "auto":
            continue
        hist = Counter("batch" if c[0] in batched_set else c[1] for c in cycles if s["t0"] <= c[0] <= s["t1"])
        s["auto_cycles_by_depth"] = dict(sorted(hist.items(), key=str))
        if not s["warmup"]:
            depth_hist[s["regime"]].update(hist)
    decisions = [e for e in daemon.events() if e.get("event") == "governor.decision"]
    kinds = Counter(e.get("decision") for e in decisions)
    moves = [
        {k: e.get(k) for k in ("timestamp", "decision", "sentence", "depth_from", "depth_to", "scores", "pressure")}
        for e in decisions if e.get("decision") in ("depth", "probe", "probe_end", "evict_head", "load_head")
    ]  # fmt: skip
    return {
        "cycles_by_depth": {r: dict(sorted(h.items(), key=str)) for r, h in depth_hist.items()},
        "decision_counts": dict(kinds),
        "moves": moves,
    }


def markdown(result: dict) -> str:
    s, meta = result["summary"], result["meta"]
    arms, regimes = meta["arms"], meta["regimes"]
    prof = meta.get("profile") or {}
    start = (result.get("auto") or {}).get("start") or {}
    lines = [
        f"## governor bench: {meta['model']}, {meta['machine']}",
        "",
        ("Tuned profile (`councild tune`, " + f"{prof.get('tune_s')} s): cycle ms "
         + ", ".join(f"d{k} {1000 * v:.2f}" for k, v in sorted(prof["contents"]["cost_s"].items(), key=lambda kv: int(kv[0])))
         + "; acceptance " + " ".join(f"{a:.3f}" for a in prof["contents"].get("acceptance", []))
         + (f". Auto daemon's start: depth {start.get('depth')} ({start.get('sentence')})." if start else ".")
         if prof.get("used") else "No tuned profile (`--no-tune`, or a run before the bench tuned): the governor "
                                  "started from its priors."),
        "",
        f"{meta['rounds']} rounds (+{meta['warmup_rounds']} warm-up), per sample {meta['requests']} requests x "
        f"{meta['max_tokens']} tokens, temperature 0, exact; arms interleaved "
        f"{'rotated each round (latin)' if meta.get('order') == 'latin' else 'ABAB/BABA'}; tokens/s median "
        "(min-max, IQR) per regime; overall = all samples' tokens / their time.",
        "",
        "| arm | " + " | ".join(regimes) + " | overall |",
        "|---|" + "---|" * (len(regimes) + 1),
    ]
    for a in arms:
        cells = []
        for r in regimes:
            p = s["per_regime"][r].get(a)
            cells.append("-" if p is None else f"{p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f}, {p['iqr']:.1f})")
        o = s["overall"].get(a)
        cells.append("-" if o is None else f"{o['tok_s']:.1f}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    if s["goal"]:
        lines += ["", "| goal | best fixed | auto / best | 90% bootstrap | met |", "|---|---|---|---|---|"]
        for r in [*regimes, "overall"]:
            g = s["goal"][r]
            want = "> 1.00" if r == "overall" else f">= {meta.get('goal_ratio', 0.95):.2f}"
            ci = g.get("ci90")
            lines.append(f"| {r} (want {want}) | {g['best_fixed']} | {g['auto_vs_best']:.3f} | "
                         f"{'-' if not ci else f'{ci[0]:.2f}-{ci[1]:.2f}'} | {'yes' if g['met'] else 'NO'} |")
    cs = result.get("cycle_stats")
    if cs:
        lines += ["", "From the daemons' traces (measured samples): median cycle ms / tokens per cycle / "
                  "robust tok/s = tokens per cycle / median cycle time (preemption filtered out)", "",
                  "| arm | " + " | ".join(regimes) + " |", "|---|" + "---|" * len(regimes)]
        for a in arms:
            cells = []
            for r in regimes:
                c = cs.get(r, {}).get(a)
                cells.append("-" if c is None else
                             f"{c['median_cycle_ms']:.1f} / {c['tokens_per_cycle']:.2f} / {c['robust_tok_s']:.0f}")
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
    ec = result.get("estimator_check")
    if ec:
        lines += ["", "Would the cost model pick the worse of two neighbouring depths (10% margin, 2 s probe, "
                  "cycles drawn from the fixed arms' recorded cycles)? P(wrong move): "
                  + "; ".join(f"{r}: EWMA {v['p_wrong_move']['ewma_0.1']:.2f}, median {v['p_wrong_move']['median']:.2f}"
                              for r, v in ec.items())]
    d = result.get("auto")
    if d:
        ps = d.get("probe_stats") or {}
        if ps:
            lines += ["", f"Auto arm probing (trace replayed): {ps['probes']} probes, {ps['probing_s']} s of "
                      f"{ps['auto_sample_s']} s measured ({ps['probing_share']:.0%}); {ps['probes_in_first_second']} "
                      f"began in a sample's first second (median idle gap between auto samples "
                      f"{ps['median_gap_between_auto_samples_s']} s); {ps['depth_moves']} depth moves."]
        lines += ["", "Auto arm, decode cycles by depth (from the governor trace): "
                  + "; ".join(f"{r}: {h}" for r, h in d["cycles_by_depth"].items()),
                  "", f"governor.decision events (info) by kind: {d['decision_counts']}"]
    return "\n".join(lines) + "\n"


def _keep_traces(out_json: Path, traces: dict[str, Path]) -> None:
    """Gzipped copies of the traces beside the JSON, so --reanalyze and
    ``councild governor replay`` work after the temp dir is gone."""
    import gzip

    d = out_json.parent / f"{out_json.stem}_traces"
    d.mkdir(exist_ok=True)
    for name, p in traces.items():
        if p.exists():
            (d / f"{name}.trace.jsonl.gz").write_bytes(gzip.compress(p.read_bytes(), mtime=0))


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED_MODEL), help="model folder (default: the bundled tiny-qwen35)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (>= 3 for a median; default 5)")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="unmeasured rounds first (default 1)")
    ap.add_argument("--regimes", default=",".join(REGIMES + COUNCIL),
                    help="comma list of quiet, busy, mixed, councilN (N concurrent streams; default council1,2,4,8)")
    ap.add_argument("--goal-ratio", type=float, default=0.97,
                    help="auto / best fixed depth wanted in every regime (0.97; the first goal was 0.95)")
    ap.add_argument("--depths", default="0,1,2,3,4", help="fixed depths to compare (default 0,1,2,3,4)")
    ap.add_argument("--requests", type=int, default=3, help="requests per sample (default 3)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--toggle-s", type=float, default=1.0, help="mixed regime: on/off period of the flapping burner")
    ap.add_argument("--hold-mb", type=int, default=1024, help="mixed regime: memory held, MiB (default 1024)")
    ap.add_argument("--governor-toml", default=None,
                    help="extra TOML lines for the auto daemon's [governor] table (to try a config change)")
    ap.add_argument("--out", default=str(HERE / "results" / "governor_cpu.json"), help="JSON results path")
    ap.add_argument("--order", choices=["abab", "latin"], default="abab",
                    help="arm order per round: abab = forward/reversed (every committed run so far; puts auto "
                         "at a regime's first or last slot), latin = rotated each round so every arm visits "
                         "every slot (use with rounds a multiple of the arm count)")
    ap.add_argument("--no-tune", action="store_true",
                    help="do not run `councild tune` first: the daemons get an empty cache dir and no profile "
                         "(how runs 1-6 ran)")
    ap.add_argument("--shared-fixed", action="store_true",
                    help="serve all fixed arms from one daemon (the first version's layout) instead of one per arm")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--workdir", default=None, help="daemon sockets/logs/traces (default: a temp dir, kept)")
    ap.add_argument("--reanalyze", default=None, metavar="JSON",
                    help="recompute the summary and table of an earlier run's JSON (rewrites it; no daemons)")
    a = ap.parse_args(argv)
    if a.reanalyze:
        result = json.loads(Path(a.reanalyze).read_text())
        meta = result["meta"]
        result["summary"] = summarize(result["samples"], meta["arms"], meta["regimes"], meta.get("goal_ratio", 0.95))
        traces = _find_traces(result, Path(a.reanalyze), a.workdir)
        if "auto" in traces and "auto" in result:
            result["auto"]["probe_stats"] = probe_stats(result["samples"], traces["auto"])
        fixed_traces = [p for n, p in traces.items() if n != "auto"]
        if "auto" in traces and fixed_traces:
            result["cycle_stats"] = cycle_stats(result["samples"], traces, meta["arms"], meta["regimes"])
            result["estimator_check"] = estimator_check(result["samples"], fixed_traces, meta["regimes"])
        Path(a.reanalyze).write_text(json.dumps(result, indent=1, default=str) + "\n")
        table = markdown(result)
        print(table)
        if a.md:
            Path(a.md).write_text(table)
        return 0
    regimes = [r for r in a.regimes.split(",") if r]
    arms = ["auto"] + [f"d{int(k)}" for k in a.depths.split(",") if k != ""]
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="governor-bench-"))
    gov_table = "[governor]\n" + (a.governor_toml.replace("\\n", "\n") + "\n" if a.governor_toml else "")
    base = 'log_level = "info"\n[speculation]\nmode = "exact"\ndepth = 1\n'
    command = " ".join(["python", "bench/governor_bench.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"# {command}\n# workdir {workdir}", flush=True)

    # SIGTERM unwinds like Ctrl-C, so the helpers and daemons are always reaped (finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    daemons: dict[str, Daemon] = {}
    clients: dict[str, Client] = {}
    samples: list[dict] = []
    t_start = time.time()
    workdir.mkdir(parents=True, exist_ok=True)
    cache_dir = workdir / "cache"
    if cache_dir.exists():  # a profile left by an earlier run in this workdir must not leak in
        for old in cache_dir.glob("profile-*.json"):
            old.unlink()
    cache_dir.mkdir(exist_ok=True)
    profile = {"used": False, "cache_dir": str(cache_dir)}
    if not a.no_tune:
        profile = {**run_tune(Path(a.model), cache_dir, base, workdir), "cache_dir": str(cache_dir)}
    try:
        daemons["auto"] = Daemon("auto", workdir, Path(a.model), base + gov_table, cache_dir)
        for arm in arms[1:]:
            name = "fixed" if a.shared_fixed else arm
            if name not in daemons:
                daemons[name] = Daemon(name, workdir, Path(a.model), base + "[governor]\n", cache_dir)
        for arm in arms:
            d = daemons["auto" if arm == "auto" else "fixed" if a.shared_fixed else arm]
            clients[arm] = Client(d.endpoint, seat="bench", timeout_s=120)
        total_rounds = a.warmup_rounds + a.rounds
        for rnd in range(total_rounds):
            warm = rnd < a.warmup_rounds
            if a.order == "latin":  # every arm visits every slot once per len(arms) rounds
                order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            else:
                order = arms if rnd % 2 == 0 else arms[::-1]
            for regime in regimes:
                with Regime(regime, a.toggle_s, a.hold_mb):
                    for i, arm in enumerate(order):
                        c = clients[arm]
                        d = daemons["auto" if arm == "auto" else "fixed" if a.shared_fixed else arm]
                        s = sample(c, arm, a.requests, a.max_tokens, offset=rnd + i,
                                   streams=council_streams(regime), endpoint=d.endpoint)
                        s.update(round=rnd, regime=regime, warmup=warm)
                        samples.append(s)
                        print(f"round {rnd}{' (warm-up)' if warm else ''} {regime:5s} {arm:4s} "
                              f"{s['tok_s']:6.1f} tok/s  depth {s['depth_before']}->{s['depth_after']}  "
                              f"load {s['loadavg']:.2f}", flush=True)
    finally:
        for c in clients.values():
            c.close()
        codes = {n: d.stop() for n, d in daemons.items()}
    auto = daemons["auto"]
    traces = {n: d.trace_path for n, d in daemons.items()}
    summary = summarize(samples, arms, regimes, a.goal_ratio)
    result = {
        "meta": {
            "command": command, "model": Path(a.model).name, "rounds": a.rounds, "warmup_rounds": a.warmup_rounds,
            "regimes": regimes, "arms": arms, "requests": a.requests, "max_tokens": a.max_tokens,
            "toggle_s": a.toggle_s, "hold_mb": a.hold_mb, "governor_toml": a.governor_toml,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
            "wall_s": round(time.time() - t_start, 1), "daemon_exit": codes, "shared_fixed": a.shared_fixed, "order": a.order, "workdir": str(workdir),
            "profile": profile, "commit": _git_commit(), "goal_ratio": a.goal_ratio,
        },
        "summary": summary,
        "auto": {**auto_diagnostics(samples, auto, regimes), "probe_stats": probe_stats(samples, auto.trace_path),
                 **profile_seen_by(auto)},
        "cycle_stats": cycle_stats(samples, traces, arms, regimes),
        "estimator_check": estimator_check(samples, [p for n, p in traces.items() if n != "auto"], regimes),
        "samples": samples,
    }  # fmt: skip
    table = markdown(result)
    print(table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    _keep_traces(out, traces)
    if a.md:
        Path(a.md).write_text(table)
    print(f"wrote {out}" + (f" and {a.md}" if a.md else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
