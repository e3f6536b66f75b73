"""council_http.py's long-prompt phase: how a long prefill stalls the streams.

One (round, arm): ``--long-streamers`` clients stream chat completions (greedy,
``--long-max-tokens`` out, the end-of-text tokens banned with ``logit_bias`` -100 so that
they keep generating through the prefill: both councild's front and mlx_lm.server honour
it); once each has streamed 5 content chunks, ``--long-quiet-s`` seconds pass (the quiet
window), then one more client sends a ~``--long-tokens``-token user message (salted per
round and arm, so nothing of it is cached; 4 tokens out). Every content chunk's arrival is
timed on the client. Then the streamers are closed, each after its first chunk past the
long request's first token (so a gap that spans the whole prefill is closed and counted).

Definitions, as council_workload.py's long-prefill part (over ZeroMQ) so the ratios compare:
- quiet gaps: the streamers' inter-chunk gaps with both chunks inside [quiet start, send];
- gaps during: the gaps whose interval overlaps [send, the long request's first content].
  council_workload.py counts only gaps with both ends inside that window; a server that
  stops the streams for the whole prefill (one prefill chunk) then has no gap at all, so
  here the gaps across its edges count too. The inside-only figure is kept in the JSON
  (``during_inside_gap_p95_s``, ``ratio_inside``);
- ratio: gap p95 during / gap p95 quiet (council_workload.py's ratio; the goal is
  <= 3x). Also reported: the quiet gap p50, the longest gap during and it over the quiet
  p95 (``max_ratio``), and the long prompt's TTFT (send to first content).
The p95 is over all the streams' gaps in the window pooled, as council_workload.py's. A
server that prefills the whole prompt in one step stalls each stream once: K long gaps among
the many short ones it streamed while the request waited for that step, so past ~K / 0.05
gaps in the window its p95 no longer sees the stall; the max gap column does.
A chunk may carry more than one token (speculation, a front that coalesces); the gap is the
client's wait between chunks, which is what a reader of the stream sees.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from bench.council_workload import SYSTEM_LINE, pct, text_of_tokens
from daemon.measure.bench_io import spread

STREAM_PROMPT = "[{salt}] stream {i}: write a long Python module of council rules, one function after another.\n"
LONG_REPLY_TOKENS = 4
WARM_CHUNKS = 5  # chunks each streamer streams before the quiet window starts (council_workload.py's 5)


def add_options(ap) -> None:
    ap.add_argument("--long-tokens", type=int, default=0,
                    help="long-prompt phase after each arm's workload: prompt tokens (0: no phase)")
    ap.add_argument("--long-streamers", type=int, default=3, help="streams running while the long prompt prefills")
    ap.add_argument("--long-max-tokens", type=int, default=3000,
                    help="the streamers' max_tokens (they are closed once the long prompt's first token is in)")
    ap.add_argument("--long-quiet-s", type=float, default=3.0, help="quiet window before the long prompt is sent")


def stop_token_bias(model: str, tok) -> dict[str, int]:
    """logit_bias -100 for the special tokens and the model's eos ids: greedy never ends early."""
    ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for name in ("generation_config.json", "config.json"):
        path = Path(model) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return {str(i): -100 for i in sorted(ids)}


async def long_prompt_phase(client, model: str, extra: dict, args, tok, salt: str) -> dict:
    bias = stop_token_bias(args.model, tok)
    k = args.long_streamers
    arrivals: list[list[float]] = [[] for _ in range(k)]
    texts: list[list[str]] = [[] for _ in range(k)]
    finish: list[str | None] = [None] * k
    t_first: list[float] = []  # the long request's first content, once known
    all_warm = asyncio.Event()

    def check_warm() -> None:
        if all(len(a) >= WARM_CHUNKS or f for a, f in zip(arrivals, finish)):
            all_warm.set()

    async def streamer(i: int) -> None:
        stream = None
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": STREAM_PROMPT.format(salt=salt, i=i)}],
                max_tokens=args.long_max_tokens, temperature=0.0, stream=True, logit_bias=bias, extra_body=extra,
                extra_headers={"X-Councild-Seat": f"stream{i}"})
            async for ev in stream:
                now = time.perf_counter()
                for c in ev.choices:
                    if c.delta and c.delta.content:
                        arrivals[i].append(now)
                        texts[i].append(c.delta.content)
                    if c.finish_reason:
                        finish[i] = c.finish_reason
                check_warm()
                if t_first and arrivals[i] and arrivals[i][-1] > t_first[0]:
                    break  # the gap across the prefill's end is closed
        finally:
            finish[i] = finish[i] or "closed"
            check_warm()
            if stream is not None:
                await stream.close()

    tasks = [asyncio.create_task(streamer(i)) for i in range(k)]
    try:
        await asyncio.wait_for(all_warm.wait(), timeout=600)
        quiet_from = time.perf_counter()
        await asyncio.sleep(args.long_quiet_s)
        streaming_at_send = sum(f is None for f in finish)
        content = f"[{salt} long]\n" + text_of_tokens(tok, SYSTEM_LINE, args.long_tokens)
        usage = None
        t_send = time.perf_counter()
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=LONG_REPLY_TOKENS,
            temperature=0.0, stream=True, logit_bias=bias, stream_options={"include_usage": True},
            extra_body=extra, extra_headers={"X-Councild-Seat": "long"})
        async for ev in stream:
            if ev.usage is not None:
                usage = ev.usage
            if not t_first and any((c.delta and c.delta.content) or c.finish_reason for c in ev.choices):
                t_first.append(time.perf_counter())
        if not t_first:  # no content at all: its end stands for its first token
            t_first.append(time.perf_counter())
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    t1 = t_first[0]

    quiet, during, inside = [], [], []
    for a in arrivals:
        for x, b in zip(a, a[1:]):
            if quiet_from <= x and b <= t_send:
                quiet.append(b - x)
            if b > t_send and x < t1:
                during.append(b - x)
                if x >= t_send and b <= t1:
                    inside.append(b - x)
    q50, q95, d95, i95 = pct(quiet, 0.5), pct(quiet, 0.95), pct(during, 0.95), pct(inside, 0.95)
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"ttft_s": t1 - t_send, "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": (getattr(details, "cached_tokens", 0) or 0) if details else None,
            "quiet_gap_p50_s": q50, "quiet_gap_p95_s": q95, "during_gap_p95_s": d95,
            "during_max_gap_s": max(during) if during else None,
            "ratio": d95 / q95 if q95 and d95 else None,
            "max_ratio": max(during) / q95 if q95 and during else None,
            "during_inside_gap_p95_s": i95, "ratio_inside": i95 / q95 if q95 and i95 else None,
            "quiet_gaps": len(quiet), "during_gaps": len(during), "during_inside_gaps": len(inside),
            "streamers": k, "streaming_at_send": streaming_at_send,
            "going_past_first_token": sum(bool(a) and a[-1] > t1 for a in arrivals),
            "streamer_chunks": [len(a) for a in arrivals],
            "streamer_tokens": [len(tok.encode("".join(t)).ids) for t in texts],  # re-tokenized: about
            "streamer_finish": finish}


def line(res: dict) -> str:
    """One progress line for stderr."""
    def ms(v):
        return f"{v * 1e3:.0f}" if v is not None else "-"
    return (f"long prompt {res['prompt_tokens']} tokens: TTFT {res['ttft_s']:.2f} s, gap quiet p50/p95 "
            f"{ms(res['quiet_gap_p50_s'])}/{ms(res['quiet_gap_p95_s'])} ms, during p95 {ms(res['during_gap_p95_s'])}"
            f" ms ({res['ratio'] or 0:.1f}x), max {ms(res['during_max_gap_s'])} ms ({res['max_ratio'] or 0:.1f}x), "
            f"{res['going_past_first_token']}/{res['streamers']} streams going past its first token")


KEYS = ("quiet_gap_p50_s", "quiet_gap_p95_s", "during_gap_p95_s", "during_max_gap_s", "ratio", "max_ratio",
        "ratio_inside",
        "during_inside_gap_p95_s", "ttft_s")


def report(args, samples: dict) -> tuple[dict, dict, list[str]]:
    """Per arm: spreads over the rounds; paired ratios against mlx_lm.server; the markdown."""
    per_arm, vs = {}, {}

    def sp(values):
        values = [v for v in values if v is not None]
        return spread(values) if values else None

    def cell(s, scale=1.0, fmt=".0f"):
        return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}})" if s else "-"

    lines = ["", f"Long prompt (~{args.long_tokens} tokens, {LONG_REPLY_TOKENS} out) while {args.long_streamers} "
             f"streams run (gaps between their content chunks; during = overlapping [send, first token]; "
             f"ratio = during p95 / quiet p95, goal <= 3x):", "",
             "| arm | gap p50 quiet ms | gap p95 quiet ms | gap p95 during ms (min-max) | ratio p95 during / p95 quiet "
             "(min-max) | max gap during ms | max gap / p95 quiet | long prompt TTFT s (min-max) | streams going past "
             "its first token |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, rows in samples.items():
        longs = [r["long_prompt"] for r in rows if r.get("long_prompt")]
        if not longs:
            continue
        s = {k: sp([x[k] for x in longs]) for k in KEYS}
        s["going_past_first_token"] = [x["going_past_first_token"] for x in longs]
        s["rounds"] = longs
        per_arm[arm] = s
        lines.append(f"| {arm} | {cell(s['quiet_gap_p50_s'], 1e3)} | {cell(s['quiet_gap_p95_s'], 1e3)} | "
                     f"{cell(s['during_gap_p95_s'], 1e3)} | {cell(s['ratio'], fmt='.1f')} | "
                     f"{cell(s['during_max_gap_s'], 1e3)} | {cell(s['max_ratio'], fmt='.1f')} | "
                     f"{cell(s['ttft_s'], fmt='.2f')} | "
                     + " ".join(f"{n}/{args.long_streamers}" for n in s["going_past_first_token"]) + " |")
    base = [r.get("long_prompt") for r in samples.get("mlx_lm.server", [])]
    if any(base) and len(per_arm) > 1:
        lines += ["", "| arm vs mlx_lm.server, long prompt (paired by round) | gap ratio / its gap ratio | "
                  "gap p95 during / its | max gap during / its | long prompt TTFT / its |", "|---|---|---|---|---|"]
        for arm, rows in samples.items():
            if arm == "mlx_lm.server" or arm not in per_arm:
                continue
            pairs = [(a.get("long_prompt"), b) for a, b in zip(rows, base) if a.get("long_prompt") and b]
            vs[arm] = {key: sp([a[k] / b[k] for a, b in pairs if a[k] and b[k]])
                       for key, k in (("gap_ratio_ratio", "ratio"), ("during_gap_p95_ratio", "during_gap_p95_s"),
                                      ("during_max_gap_ratio", "during_max_gap_s"), ("ttft_ratio", "ttft_s"))}
            lines.append(f"| {arm} | " + " | ".join(cell(vs[arm][key], fmt=".2f") for key in
                                                     ("gap_ratio_ratio", "during_gap_p95_ratio", "during_max_gap_ratio",
                                                      "ttft_ratio")) + " |")
    return per_arm, vs, lines
