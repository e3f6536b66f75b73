"""A council through the OpenAI API, as agents use it: councild's modes against mlx_lm.server.

Workload (one arm, one round): ``--seats`` seats share a system prompt of ``--system-tokens``
tokens; each seat runs ``--turns`` turns one after another, all seats at once; a turn sends
the chat so far (system, the seat's earlier user messages and the replies it got) plus a new
user message of ~``--message-tokens`` tokens to ``/v1/chat/completions``, streaming, greedy,
``--max-tokens`` out, with the official ``openai`` client. Each (round, arm) salts the system
prompt, so every arm starts cold and reuses only what its own workload built, and moves the
system prompt's length by up to 10% and each message's by up to 25% (fixed by the salt; every
arm of a round gets the same lengths), so later rounds do not repeat round 0's token counts
(``--same-lengths``: the lengths of runs before 2026-12-07e).

Arms (one councild daemon + its HTTP front; mlx_lm.server beside them), rotated each round:
- ``default``: no speculation field (the daemon's configured mode, exact unless configured);
- ``fast`` / ``off``: ``speculation`` in the request body;
- ``mlx_lm.server``: ``python -m mlx_lm server --model MODEL``, the same requests.
Reported per arm: aggregate tok/s (completion tokens over the workload's wall time), TTFT
p50/p95 (send to the first content), each seat's share of the tokens, cached prompt tokens
where the server reports them; for councild the governor's depth table and the batch's
speculation counters from status after each arm. Medians and ranges over the rounds, and
per-round ratios against mlx_lm.server.

Long prompt (``--long-tokens N``, off by default; bench/long_prompt_phase.py): after
each arm's workload, in the same (round, arm) slot, ``--long-streamers`` clients stream long
greedy completions (end-of-text banned through ``logit_bias``) and, after a quiet window, one
more sends a ~N-token prompt salted per round and arm. Reported per arm: the streams'
inter-chunk gap p50/p95 in the quiet window, their gap p95 over the gaps that overlap the long
prompt's [send, first token] window, the ratio during p95 / quiet p95 (council_workload.py's
ratio; the goal is <= 3x), the longest gap (a server that prefills in one step stalls each
stream once, which a pooled p95 can miss) and the long prompt's TTFT; medians and ranges over
the rounds and paired ratios against mlx_lm.server. The module's docstring has the details.

    .venv/bin/python bench/council_http.py --rounds 3 --json bench/results/council_http_cpu.json \\
        --markdown bench/results/council_http_cpu.md
    .venv/bin/python bench/council_http.py --seats 2 --turns 1 --system-tokens 200 --max-tokens 16 \\
        --rounds 1 --arms default,mlx_lm.server --long-tokens 600 --json /tmp/lp.json --markdown /tmp/lp.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import long_prompt_phase as lp  # noqa: E402
from bench.council_workload import SYSTEM_LINE, pct, text_of_tokens  # noqa: E402  (one workload text)
from bench.http_servers import start_councild_http, start_mlx_lm_server, stop  # noqa: E402
from daemon.measure.bench_io import spread, write_results  # noqa: E402

USER_LINE = "seat {s} turn {t}: consider clause {i} of the motion.\n"


def varied(n: int, salt: str, spread_fraction: float, same: bool) -> int:
    """n moved by up to +-spread_fraction, fixed by salt (a round, arm, seat, turn): each round's
    prompts end at lengths of their own, as real ones do. With the same lengths every round,
    the later rounds repeat round 0's token counts and a per-count first-use cost (on CUDA:
    bench/probes/prefill_length_first_use.py) is paid in round 0 only."""
    if same or n < 4:
        return n
    span = max(1, int(n * spread_fraction))
    return n - span + zlib.crc32(salt.encode()) % (2 * span + 1)


async def workload(client, model: str, extra: dict, args, tok, salt: str) -> dict:
    system = f"[{salt}]\n" + text_of_tokens(tok, SYSTEM_LINE, varied(args.system_tokens, salt, 0.1, args.same_lengths))
    records: list[dict] = []

    async def seat(s: int) -> None:
        chat = [{"role": "system", "content": system}]
        for t in range(args.turns):
            n = varied(args.message_tokens, f"{salt} seat {s} turn {t}", 0.25, args.same_lengths)
            chat.append({"role": "user", "content": text_of_tokens(tok, USER_LINE, n, s=s, t=t)})
            t0 = time.perf_counter()
            first = None
            text, usage = [], None
            stream = await client.chat.completions.create(
                model=model, messages=chat, max_tokens=args.max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra,
                extra_headers={"X-Councild-Seat": f"seat{s}"})
            async for ev in stream:
                if ev.usage is not None:
                    usage = ev.usage
                for c in ev.choices:
                    if c.delta and c.delta.content:
                        first = first or time.perf_counter()
                        text.append(c.delta.content)
            end = time.perf_counter()
            chat.append({"role": "assistant", "content": "".join(text)})
            details = getattr(usage, "prompt_tokens_details", None) if usage else None
            records.append({"seat": s, "turn": t, "ttft_s": (first or end) - t0,
                            "completion_tokens": usage.completion_tokens if usage else len(text),
                            "prompt_tokens": usage.prompt_tokens if usage else 0,
                            "cached_tokens": (getattr(details, "cached_tokens", 0) or 0) if details else 0})

    t0 = time.perf_counter()
    await asyncio.gather(*(seat(s) for s in range(args.seats)))
    wall = time.perf_counter() - t0
    total = sum(r["completion_tokens"] for r in records)
    ttft = [r["ttft_s"] for r in records]
    later = [r["ttft_s"] for r in records if r["turn"] > 0]
    shares = {f"seat{s}": sum(r["completion_tokens"] for r in records if r["seat"] == s) / max(1, total)
              for s in range(args.seats)}
    return {"wall_s": wall, "tokens": total, "tok_s": total / wall, "ttft_p50": pct(ttft, 0.5),
            "ttft_p95": pct(ttft, 0.95), "ttft_later_p50": pct(later, 0.5),
            "cached_tokens": sum(r["cached_tokens"] for r in records),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records), "shares": shares, "requests": records}


def councild_status(endpoint: str) -> dict:
    from protocol.client import Client

    with Client(endpoint, seat="bench-status", timeout_s=30) as c:
        detail = c.status().detail
    step = detail.get("step") or {}
    # The pacer's fit and the shared forwards' counts: how prompts were prefilled beside the
    # decoding rows (an H100's council of 8 in fast mode prefilled ~300-token tails in 24-54
    # forwards each, bench/results/h100_2026-12-08).
    return {"rows": detail.get("rows", {}), "governor": detail.get("governor", {}), "speculation": detail.get("speculation", {}),
            "batch": detail.get("batch", {}), "batch_cycles": step.get("batch_cycles"),
            "prefill": {k: step.get(k) for k in ("pacing", "together", "mixed")},
            "stats": {k: v for k, v in detail.get("stats", {}).items() if k in ("drafted", "accepted")}}


async def bench(args, arms: dict, endpoint: dict[str, str], tok) -> dict:
    from openai import AsyncOpenAI

    clients = {name: AsyncOpenAI(base_url=url, api_key="unused", timeout=900, max_retries=0)
               for name, (url, _model, _extra) in arms.items()}
    names = list(arms)
    samples: dict[str, list[dict]] = {a: [] for a in names}
    # Round 0 is each arm's first workload after start-up (councild's first arm pays what the
    # daemon compiles on first use); kept apart as the cold-start figure.
    samples["first_round"] = []
    try:
        for r in range(args.rounds + 1):  # round 0 warms every path (compilation, first shapes)
            order = names[r % len(names):] + names[: r % len(names)]
            for arm in order:
                _url, model, extra = arms[arm]
                res = await workload(clients[arm], model, extra, args, tok, salt=f"round {r} arm {arm}")
                rows = ""
                if arm != "mlx_lm.server":
                    res["councild"] = councild_status(endpoint[arm])
                    rw = res["councild"]["rows"]
                    rows = f", rows at once {rw.get('limit')} ({rw.get('mode')}: {rw.get('why')})" if rw else ""
                print(f"round {r}/{args.rounds} {arm}: {res['tok_s']:.1f} tok/s, TTFT p50 "
                      f"{res['ttft_p50'] * 1e3:.0f} ms" + (" (warm-up)" if r == 0 else "") + rows,
                      file=sys.stderr, flush=True)
                if args.long_tokens:
                    res["long_prompt"] = await lp.long_prompt_phase(clients[arm], model, extra, args, tok,
                                                                    salt=f"round {r} arm {arm}")
                    print(f"round {r}/{args.rounds} {arm}: " + lp.line(res["long_prompt"]), file=sys.stderr, flush=True)
                if r:
                    samples[arm].append(res)
                else:
                    first = {k: res[k] for k in ("tok_s", "ttft_p50", "ttft_p95", "long_prompt") if k in res}
                    samples["first_round"].append({"arm": arm, **first})
    finally:
        for c in clients.values():
            await c.close()
    return samples


def report(args, samples: dict) -> tuple[dict, str]:
    out = {"benchmark": "council_http", "model": args.model, "seats": args.seats, "turns": args.turns,
           "system_tokens": args.system_tokens, "message_tokens": args.message_tokens, "max_tokens": args.max_tokens,
           "rounds": args.rounds, "long_tokens": args.long_tokens, "long_streamers": args.long_streamers,
           "long_max_tokens": args.long_max_tokens, "long_quiet_s": args.long_quiet_s,
           "machine": platform.platform(), "cpus": os.cpu_count(),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "arms": {}, "vs_mlx_lm_server": {}}
    lines = ["| arm | aggregate tok/s (min-max) | TTFT p50 ms (min-max) | TTFT p95 ms | cached / prompt tokens | "
             "seat shares |", "|---|---|---|---|---|---|"]
    out["first_round"] = samples.pop("first_round", [])
    for arm, rows in samples.items():
        s = {k: spread([r[k] for r in rows]) for k in ("tok_s", "ttft_p50", "ttft_p95")}
        s["cached_tokens"] = sum(r["cached_tokens"] for r in rows)
        s["prompt_tokens"] = sum(r["prompt_tokens"] for r in rows)
        s["shares"] = [r["shares"] for r in rows]
        s["councild"] = [r.get("councild") for r in rows]
        out["arms"][arm] = s
        shares = rows[-1]["shares"]
        lines.append(f"| {arm} | {s['tok_s']['median']:.1f} ({s['tok_s']['min']:.1f}-{s['tok_s']['max']:.1f}) | "
                     f"{s['ttft_p50']['median'] * 1e3:.0f} ({s['ttft_p50']['min'] * 1e3:.0f}-"
                     f"{s['ttft_p50']['max'] * 1e3:.0f}) | {s['ttft_p95']['median'] * 1e3:.0f} | "
                     f"{s['cached_tokens']} / {s['prompt_tokens']} | "
                     + " ".join(f"{v:.2f}" for v in shares.values()) + " |")
    if "mlx_lm.server" in samples:
        lines += ["", "| arm vs mlx_lm.server (paired by round) | aggregate tok/s ratio (min-max) | TTFT p50 ratio |",
                  "|---|---|---|"]
        base = samples["mlx_lm.server"]
        for arm, rows in samples.items():
            if arm == "mlx_lm.server":
                continue
            tok = spread([a["tok_s"] / b["tok_s"] for a, b in zip(rows, base)])
            ttft = spread([a["ttft_p50"] / b["ttft_p50"] for a, b in zip(rows, base)])
            out["vs_mlx_lm_server"][arm] = {"tok_s_ratio": tok, "ttft_p50_ratio": ttft}
            lines.append(f"| {arm} | {tok['median']:.2f} ({tok['min']:.2f}-{tok['max']:.2f}) | "
                         f"{ttft['median']:.2f} ({ttft['min']:.2f}-{ttft['max']:.2f}) |")
    if args.long_tokens:
        out["long_prompt"], out["long_prompt_vs_mlx_lm_server"], long_lines = lp.report(args, samples)
        lines += long_lines
    lines += ["", "| first round after start-up (round 0, in the order run) | tok/s | TTFT p50 ms | TTFT p95 ms |",
              "|---|---|---|---|"]
    lines += [f"| {f['arm']} | {f['tok_s']:.1f} | {f['ttft_p50'] * 1e3:.0f} | {f['ttft_p95'] * 1e3:.0f} |"
              for f in out["first_round"]]
    return out, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "daemon/assets/tiny-qwen35"))
    ap.add_argument("--seats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--message-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="default,fast,off,mlx_lm.server",
                    help="comma-separated: default, fast, off, exact, mlx_lm.server")
    ap.add_argument("--config-extra", default="", help="TOML appended to the daemon's config")
    ap.add_argument("--same-lengths", action="store_true",
                    help="every round's prompts the same lengths (before 2026-12-07e: the system prompt and "
                         "each message vary by up to 10%% / 25%% per round and arm, fixed by the salt)")
    ap.add_argument("--max-active", default="",
                    help='comma-separated scheduler.max_active values ("auto" or ints): one councild daemon each, '
                         'its arms named "ARM max_active=V" and rotated with the others (default: one daemon at '
                         '"auto", the daemon\'s own default since 2026-12-05 (before, this benchmark pinned '
                         "max(4, seats)), arms named as given)")
    ap.add_argument("--json", default="bench/out/council_http.json")
    ap.add_argument("--markdown")
    lp.add_options(ap)
    ap.add_argument("--logs", type=Path, help="copy the servers' logs (daemon, front, mlx_lm.server) here at the end")
    ap.add_argument("--cache-dir", type=Path,
                    help="the daemons' cache folder (probe verdicts, prefix snapshots), kept between runs: a second "
                         "run's round 0 is then a restart's first round, as launchd or systemd gives it "
                         "(default: a fresh folder per run, a first start on a new machine)")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    tmp = Path(tempfile.mkdtemp(prefix="council-http-"))
    env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(tmp / "run"), COUNCILD_CACHE_DIR=str(tmp / "cache"))
    procs: list[subprocess.Popen] = []
    try:
        wanted = args.arms.split(",")
        arms: dict = {}
        endpoint: dict[str, str] = {}
        values = [v if v == "auto" else int(v) for v in args.max_active.split(",") if v] or ["auto"]
        for v in values if any(a != "mlx_lm.server" for a in wanted) else []:
            home = tmp if not args.max_active else tmp / f"councild-{v}"
            home.mkdir(exist_ok=True)
            cache = args.cache_dir / (f"max_active-{v}" if args.max_active else "councild") if args.cache_dir else home / "cache"
            denv = dict(env, COUNCILD_RUNTIME_DIR=str(home / "run"), COUNCILD_CACHE_DIR=str(cache))
            started, ep, port = start_councild_http(args.model, home, denv, v, args.config_extra)
            procs += started
            for a in wanted:
                if a != "mlx_lm.server":
                    name = f"{a} max_active={v}" if args.max_active else a
                    arms[name] = (f"http://127.0.0.1:{port}/v1", "councild", {} if a == "default" else {"speculation": a})
                    endpoint[name] = ep
        if "mlx_lm.server" in wanted:
            mlx, mport = start_mlx_lm_server(args.model, tmp, env)
            procs.append(mlx)
            arms["mlx_lm.server"] = (f"http://127.0.0.1:{mport}/v1", args.model, {})
        samples = asyncio.run(bench(args, arms, endpoint, tok))
    finally:
        stop(procs)
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in tmp.rglob("*.log"):  # a daemon per max_active value keeps its logs in its own folder
                shutil.copy(log, args.logs / (log.name if log.parent == tmp else f"{log.parent.name}-{log.name}"))
    out, table = report(args, samples)
    print(table)
    write_results(out, f"`{out['command']}`\n\n{table}", args.json, args.markdown)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
