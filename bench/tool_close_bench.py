"""Do forced tool calls and schema answers close? The bundled model, a real daemon and
`councild http`, the official openai and anthropic clients, held-out schemas
(tests/tool_cases.py: none is the demo's weather tool).

    .venv/bin/python bench/tool_close_bench.py                  # defaults: 128 / 160 tokens
    .venv/bin/python bench/tool_close_bench.py --string-max-chars 0   # the daemon with no cap

For every tool: a forced call (OpenAI tool_choice naming it, and Anthropic {"type": "any"}
with it and one other tool), max_tokens 128, temperature 0, one call per turn unless
--parallel (then the grammar lets a call follow a call, and a model that never ends its turn
on its own, as the bundled one, chains calls until max_tokens). A case passes when the answer
is parsed tool calls (finish_reason "tool_calls" / stop_reason "tool_use"), every call's
arguments validate against its tool's schema, no text, within the budget. For every answer
schema: a strict json_schema answer, max_tokens 160, passing when it parses and validates.
The daemon runs with its default configuration unless --string-max-chars is given.
Prints a summary; writes JSON (default bench/results/tool_close_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

import anthropic  # noqa: E402
import openai  # noqa: E402
from e2e_harness import start_daemon  # noqa: E402
from http_harness import start_front  # noqa: E402
from tool_cases import ANSWERS, ASK_ANSWER, ASK_TOOL, TOOLS, anthropic_tool, errors, openai_tool  # noqa: E402

from daemon.paths import BUNDLED_MODEL  # noqa: E402


def openai_call(oai, name: str, budget: int, parallel: bool) -> dict:
    r = oai.chat.completions.create(
        model="any", max_tokens=budget, temperature=0, tools=[openai_tool(name)], parallel_tool_calls=parallel,
        tool_choice={"type": "function", "function": {"name": name}},
        messages=[{"role": "user", "content": ASK_TOOL.format(name=name, description=TOOLS[name][0])}])
    choice = r.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return _judge("openai", name, choice.finish_reason == "tool_calls", choice.message.content, calls,
                  r.usage.completion_tokens, budget, choice.finish_reason)


def anthropic_call(claude, name: str, other: str, budget: int, parallel: bool) -> dict:
    r = claude.messages.create(
        model="any", max_tokens=budget, extra_body={"temperature": 0}, tools=[anthropic_tool(name),
                                                                            anthropic_tool(other)],
        tool_choice={"type": "any", "disable_parallel_tool_use": not parallel},
        messages=[{"role": "user", "content": ASK_TOOL.format(name=name, description=TOOLS[name][0])}])
    text = "".join(b.text for b in r.content if b.type == "text")
    calls = [(b.name, json.dumps(b.input)) for b in r.content if b.type == "tool_use"]
    return _judge("anthropic", name, r.stop_reason == "tool_use", text, calls, r.usage.output_tokens, budget,
                  r.stop_reason)


def _judge(route, name, closed, text, calls, tokens, budget, finish) -> dict:
    problems = []
    if not closed:
        problems.append(f"finish {finish}")
    if text:
        problems.append(f"text {text[:60]!r}")
    if not calls:
        problems.append("no call")
    for called, arguments in calls:
        problems += errors(json.loads(arguments), TOOLS[called][1]) if called in TOOLS else [f"tool {called}"]
    if tokens > budget:
        problems.append(f"{tokens} tokens")
    return {"route": route, "case": name, "ok": not problems, "tokens": tokens, "finish": finish,
            "calls": calls, "problems": problems}


def schema_answer(oai, name: str, budget: int) -> dict:
    schema = ANSWERS[name]
    r = oai.chat.completions.create(
        model="any", max_tokens=budget, temperature=0,
        messages=[{"role": "user", "content": ASK_ANSWER.format(name=name)}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    content = r.choices[0].message.content or ""
    try:
        problems = errors(json.loads(content), schema)
    except ValueError as exc:
        problems = [f"not JSON: {exc}"]
    tokens = r.usage.completion_tokens
    if tokens > budget:
        problems.append(f"{tokens} tokens")
    return {"route": "json_schema", "case": name, "ok": not problems, "tokens": tokens,
            "finish": r.choices[0].finish_reason, "content": content, "problems": problems}


def rate(rows: list[dict]) -> dict:
    ok = sum(r["ok"] for r in rows)
    return {"passed": ok, "cases": len(rows), "rate": round(ok / len(rows), 4) if rows else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call-tokens", type=int, default=128)
    ap.add_argument("--answer-tokens", type=int, default=160)
    ap.add_argument("--string-max-chars", type=int, default=None,
                    help="the daemon's [constraint] string_max_chars (default: its own default)")
    ap.add_argument("--parallel", action="store_true",
                    help="allow parallel calls (default: one call: parallel_tool_calls false, "
                         "disable_parallel_tool_use true)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tool_close_cpu.json"))
    args = ap.parse_args()

    config = "" if args.string_max_chars is None else f"[constraint]\nstring_max_chars = {args.string_max_chars}\n"
    rows: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        d = start_daemon(Path(tmp), BUNDLED_MODEL, config=config or None)
        front = start_front(Path(tmp), d.endpoint, "")
        try:
            oai = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=600)
            claude = anthropic.Anthropic(base_url=front.url, api_key="x", max_retries=0, timeout=600)
            names = list(TOOLS)
            for i, name in enumerate(names):
                rows.append(openai_call(oai, name, args.call_tokens, args.parallel))
                rows.append(anthropic_call(claude, name, names[(i + 1) % len(names)], args.call_tokens,
                                           args.parallel))
            for name in ANSWERS:
                rows.append(schema_answer(oai, name, args.answer_tokens))
        except Exception:
            print(d.log_path.read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            front.stop()
            d.stop()
    calls = [r for r in rows if r["route"] != "json_schema"]
    answers = [r for r in rows if r["route"] == "json_schema"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {
        "command": "bench/tool_close_bench.py " + " ".join(sys.argv[1:]),
        "commit": commit, "machine": platform.platform(), "model": "bundled tiny-qwen35",
        "string_max_chars": args.string_max_chars if args.string_max_chars is not None else "daemon default",
        "parallel_calls": args.parallel, "call_tokens": args.call_tokens, "answer_tokens": args.answer_tokens,
        "forced_calls": rate(calls), "forced_calls_openai": rate([r for r in calls if r["route"] == "openai"]),
        "forced_calls_anthropic": rate([r for r in calls if r["route"] == "anthropic"]),
        "schema_answers": rate(answers), "wall_s": round(time.monotonic() - started, 1), "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"forced calls valid and closed within {args.call_tokens} tokens: {result['forced_calls']}")
    print(f"schema answers valid within {args.answer_tokens} tokens: {result['schema_answers']}")
    for r in rows:
        if not r["ok"]:
            print("  FAIL", r["route"], r["case"], r["tokens"], r["problems"][:3])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
