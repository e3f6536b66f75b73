"""`councild`: the daemon and the tools around it, one subcommand each.

The subcommands that only talk to a running daemon (generate, status, governor override)
import no mlx, so they start fast and work from any council process's environment.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import time

import msgspec

from .exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from .frameworks import hide_unused_frameworks

# The wire protocol's bound on a pinned depth (GovernorCommand.depth); the daemon refuses
# one above its governor.max_depth with the reason.
MAX_DEPTH = 16

DESCRIPTION = """\
councild hosts one local model for a council of agent processes over ZeroMQ.

Start the daemon with `councild serve` (it serves the bundled model unless --model or the
config names another), then talk to it with `councild generate "prompt"` or any program
using the `protocol` package. `councild status` shows what it is doing.
"""

EPILOG = """\
configuration: defaults < TOML file (--config) < COUNCILD_* environment < flags.
endpoint: by default ipc://$XDG_RUNTIME_DIR/councild/councild.sock (Linux) or a per-user
folder in the temp dir (macOS); the folder is created 0700. Override with --endpoint or
COUNCILD_ENDPOINT; clients read the same variable.
exit codes: 0 ok, 1 a gate or request failed, 2 bad usage, 70 internal error or the model
failed to load, 75 another daemon serves the endpoint, 78 bad configuration.
"""


SERVE_DESCRIPTION = """\
Load the model, bind the endpoint and serve until SIGTERM.

signals: SIGTERM/SIGINT drains in-flight work (up to drain_deadline_s) and exits 0; a
second one exits at once. SIGHUP re-reads the config file and applies the [scheduler]
table, heartbeat_timeout_s and drain_deadline_s; a bad file is rejected (logged as
config.reload_rejected) and the running settings kept.
systemd: READY=1 once the model is loaded and the socket bound, WATCHDOG=1 while the step
loop runs, STOPPING=1 when the drain starts ($NOTIFY_SOCKET; nothing without it).
logs: stderr, one JSON object per line, or a console format when stderr is a terminal;
event names are listed in docs/OPERATIONS.md.
"""


PREPARE_DESCRIPTION = """\
Run once what a machine's first start would pay for, then exit: load the model, and run
every start-up check and probe to its end (the compiled step's self-checks, the kernel
choice, the exactness probes, the chunk-split probe, the cost probes, the warm-up) as
`warm_in_background = false` does. Their verdicts and measurements are kept in the cache
folder (and MLX-on-CUDA's compiled kernels in its own), keyed by the model, the code, the
versions and the device; a later `councild serve` with the same settings finds them, so its
first council round runs at the speed of the later ones instead of sharing the engine with
the probes. Installers run it after installing; run it again after an upgrade or a new
model. It binds a private socket of its own, not the daemon's endpoint, and leaves the prefix
cache's disk tier alone, but it loads the model: on a machine without room for two copies,
run it while the service is stopped.
Exit 0 when done; the codes of `serve` otherwise (docs/OPERATIONS.md).
"""


def _depth(text: str) -> int:
    try:
        depth = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= depth <= MAX_DEPTH:
        raise argparse.ArgumentTypeError(f"{depth} is not a depth from 0 to {MAX_DEPTH}")
    return depth


def _add_endpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", help="daemon endpoint (default: $COUNCILD_ENDPOINT or the per-user ipc socket)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="councild", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon in the foreground (what launchd/systemd start)",
                           description=SERVE_DESCRIPTION,
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--config", help="TOML config file (see docs/OPERATIONS.md for the keys)")
    serve.add_argument("--model", help="model folder (HF or mlx format) or a pulled Hub repo id org/name[@revision]; "
                                       "default: the bundled tiny-qwen35")
    _add_endpoint(serve)
    serve.add_argument("--log-format", choices=["auto", "json", "console"], help="default: json unless stderr is a terminal")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--speculation", choices=["off", "exact", "fast"], help="default speculation mode for requests that do not say")
    serve.add_argument("--insecure-tcp", action="store_true", help="allow a tcp:// endpoint without CURVE (logs a warning)")
    serve.add_argument("--distributed", action="store_true",
                       help="serve tensor-parallel across an mx.distributed group (config: [distributed] enabled): "
                            "start every rank with this, under `mlx.launch` or with MLX_RANK and MLX_HOSTFILE set; "
                            "rank 0 binds the endpoint and leads, the others follow it in lockstep; a model whose "
                            "heads the group size does not divide is refused (exit 78); a rank that dies makes the "
                            "others exit 70 within distributed.peer_timeout_s (docs/OPERATIONS.md, Several machines)")

    prep = sub.add_parser("prepare", help="pay a first start's checks now (installers run it): later starts find them",
                          description=PREPARE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    prep.add_argument("--config", help="the TOML config file the service will start with")
    prep.add_argument("--model", help="model folder or pulled Hub repo id (default: the config's, else the bundled one)")
    prep.add_argument("--log-format", choices=["auto", "json", "console"], help="default: json unless stderr is a terminal")
    prep.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    prep.set_defaults(endpoint=None, speculation=None, insecure_tcp=False, distributed=False)

    gen = sub.add_parser("generate", help="send one prompt to a running daemon and stream the answer",
                         description="Stream a completion from a running daemon to stdout; usage and timings go to stderr.")
    gen.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    _add_endpoint(gen)
    gen.add_argument("--seat", default="cli", help="seat name to speak as (default: cli)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--template-kwarg", action="append", metavar="KEY=VALUE",
                     help="chat template variable (with --chat; repeatable), e.g. enable_thinking=false; "
                          "the thinking text, where the template marks it, goes to stderr")
    gen.add_argument("--priority", choices=["interactive", "normal", "background"])
    gen.add_argument("--speculation", choices=["off", "exact", "fast"])
    gen.add_argument("--deadline-ms", type=int)
    gen.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon to say anything")

    st = sub.add_parser("status", help="show what a running daemon is doing",
                        description="Model, MTP head, speculation depth, memory (MB), memory pressure and the "
                                    "governor's state, requests in flight, throughput and uptime, then one row "
                                    "per seat (active, queued, tokens). Exit 1 when no daemon answers.")
    _add_endpoint(st)
    st.add_argument("--json", action="store_true", help="print the raw StatusReply as JSON")
    st.add_argument("--timeout", type=float, default=5.0)

    groups: dict[str, argparse._SubParsersAction] = {}
    for name, text in GROUPS.items():
        groups[name] = sub.add_parser(name, help=text, description=text).add_subparsers(
            dest=name, metavar=name.upper() if name != "governor" else "ACTION")
    gov_sub = groups["governor"]
    for action, text in (("pin", "pin the speculation depth (0..governor.max_depth; 0 = off)"),
                         ("evict", "evict the MTP head now"),
                         ("load", "load the MTP head now"), ("auto", "hand control back to the governor")):
        p = gov_sub.add_parser(action, help=text, description=text)
        if action == "pin":
            p.add_argument("depth", type=_depth, help="0 turns speculation off; at most governor.max_depth")
        _add_endpoint(p)
    # Every delegated subcommand is listed from the one table that dispatches it, so help
    # cannot drift from what runs (each parses its own arguments: `councild X --help`).
    for path, (_, text) in DELEGATED.items():
        parent = groups[path[0]] if len(path) == 2 else sub
        parent.add_parser(path[-1], help=text, add_help=False)
    return parser


def cmd_serve(args) -> int:
    from .config import ConfigError, load_config
    from .logs import configure_logging, get_logger
    from .paths import cache_dir, ensure_runtime_dir, resolve_model
    from .exits import EXIT_CONFIG
    from .socket_side.endpoint import StartupError, startup_fs_error
    from protocol.paths import default_endpoint

    overrides = {k: v for k, v in {
        "model": args.model, "endpoint": args.endpoint, "log_format": args.log_format,
        "log_level": args.log_level, "insecure_tcp": args.insecure_tcp or None,
    }.items() if v is not None}
    if args.speculation:
        overrides["speculation"] = {"mode": args.speculation}
    prepare = args.command == "prepare"
    if prepare:  # every part before "ready"; no service manager to tell
        overrides["warm_in_background"] = False
        # The prefix cache's disk tier belongs to the serving daemon (no lock across processes).
        overrides["prefix_cache"] = {"disk": False}
        for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            os.environ.pop(var, None)
    if getattr(args, "distributed", False):
        overrides["distributed"] = {"enabled": True}
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        # The event OPERATIONS.md promises for every failed start, in the format the flags
        # ask for (the file's own log settings are what failed to load).
        configure_logging(args.log_format or "auto", args.log_level or "info")
        get_logger("councild").error("daemon.startup_failed", error=str(exc), exit_code=EXIT_CONFIG)
        _print_err(f"councild: {exc}")
        return EXIT_CONFIG
    if prepare:  # a socket of its own, never the daemon's endpoint
        private = tempfile.mkdtemp(prefix="councild-prepare-")
        cfg = msgspec.structs.replace(cfg, endpoint=f"ipc://{private}/prepare.sock")
    configure_logging(cfg.log_format, cfg.log_level)
    # A watchdog SIGABRT or a hang then leaves every thread's stack in the log.
    faulthandler.enable()
    log = get_logger("councild")
    from .models.refs import ModelRefError

    try:
        try:
            endpoint = cfg.endpoint or (ensure_runtime_dir() and default_endpoint())
        except OSError as exc:
            raise startup_fs_error(f"cannot create the runtime folder {exc.filename or ''}".rstrip(), exc) from None
        try:
            model = resolve_model(cfg.model)
        except ModelRefError as exc:  # a repo id that was never pulled: fix the config, no retry
            raise StartupError(str(exc), EXIT_CONFIG) from None
        group = None
        if cfg.distributed.enabled:
            from .distributed.group import GroupRefused, open_group

            try:
                group = open_group(cfg.distributed.backend)
            except GroupRefused as exc:
                raise StartupError(str(exc), exc.exit_code) from None
            import structlog

            structlog.contextvars.bind_contextvars(rank=group.rank())
        if group is not None and group.rank() != 0:  # no endpoint here: follow rank 0
            from .distributed.follower import run_follower

            code = run_follower(cfg, model, group)
        else:
            t0 = time.monotonic()
            # Before the serving imports (~1-4 s: mlx-lm, transformers): the CUDA modules'
            # workers compile while they run (engine/jit/prebuild.py).
            from .engine_thread.prebuild_start import start_kernel_prebuild

            prebuild = start_kernel_prebuild(cfg, model)
            from .socket_side.server import Server

            code = Server(cfg, model, endpoint, cli_overrides=overrides, group=group,
                          exit_when_ready=prepare, prebuild=prebuild).run(args.config)
            if prepare and code == EXIT_OK:
                print(f"councild: prepared {model} in {time.monotonic() - t0:.1f} s; the verdicts are in "
                      f"{cache_dir() / 'probe-verdicts'}", flush=True)
    except StartupError as exc:
        log.error("daemon.startup_failed", error=str(exc), exit_code=exc.exit_code)
        _print_err(f"councild: {exc}")
        code = exc.exit_code
    if prepare:
        shutil.rmtree(private, ignore_errors=True)  # its socket's folder and lock file
    # Leave without interpreter teardown, once the server has closed its sockets, removed
    # its socket file and logged daemon.stop: with mlx loaded on the engine thread (and its
    # compiled-function cache alive), finalization can abort ("terminate called without an
    # active exception", SIGABRT), which a service manager would read as a crash and restart.
    # The kernel releases the instance lock; nothing else is left to clean up.
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a full disk under the log must not change the exit code
        pass
    os._exit(code)


def _print_err(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _template_kwarg(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE read as JSON where it is (true, 3, 0.5), else as a string."""
    key, _, raw = text.partition("=")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value if isinstance(value, (str, bool, int, float)) else raw


def cmd_generate(args) -> int:
    from protocol.client import Client, CouncilError, DaemonUnavailable

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop, priority=args.priority, speculation=args.speculation,
                  deadline_ms=args.deadline_ms)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": prompt}]
        if args.template_kwarg:
            kwargs["chat_template_kwargs"] = dict(_template_kwarg(kv) for kv in args.template_kwarg)
    else:
        kwargs["prompt"] = prompt
    try:
        with Client(args.endpoint, seat=args.seat, timeout_s=args.timeout) as client:
            stream = client.generate(**kwargs)
            for chunk in stream:
                sys.stdout.write(chunk)
                sys.stdout.flush()
            done = stream.done
    except (CouncilError, DaemonUnavailable) as exc:
        print(f"\ncouncild: {exc}", file=sys.stderr)
        return 1
    if done.reasoning:
        print(f"\n[thinking]\n{done.reasoning}", file=sys.stderr)
    t = done.timings
    print(f"\n[{done.finish_reason}] {done.usage.completion_tokens} tokens, {t.tokens_per_s:.1f} tok/s, "
          f"ttft {t.ttft_s * 1000:.0f} ms", file=sys.stderr)
    return 0


def _mb(nbytes) -> str:
    return "?" if nbytes is None else f"{nbytes / 1e6:.1f} MB"


def _uptime(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f} s"
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    return (f"{days}d " if days else "") + f"{hours}h {minutes:02d}m {s:02d}s"


def _shared_forwards(what: str, d: dict, unit: str, key: str, not_exact: str) -> list[str]:
    """One of the prefill row's parts: a way of sharing forwards, on (its counts) or off."""
    if not d:
        return []
    if not d.get("enabled"):
        return [f"{what}: off"]
    return [f"{what}: on ({d.get('forwards', 0)} forwards, {d.get(key, 0)} {unit}"
            f"{'' if d.get('exact_rows') else '; ' + not_exact})"]


def _prefill_row(pacing: dict, together: dict, mixed: dict) -> str:
    """How the engine step prefills beside decoding streams (OPERATIONS.md, The engine step)."""
    parts = []
    if pacing:
        if not pacing.get("bound"):
            parts.append("paced: off (whole chunks)")
        else:
            quiet = pacing.get("quiet_ms")
            parts.append(f"paced within {pacing['bound']:g}x a quiet iteration"
                         + (f" ({quiet:.1f} ms)" if quiet is not None else "")
                         + (f", last piece {pacing['last_piece']} tokens" if pacing.get("last_piece") else "")
                         + f", {pacing.get('paced_iterations', 0)} paced iterations")
    parts += _shared_forwards("prompts together", together, "pieces", "rows", "exact rows alone")
    parts += _shared_forwards("pieces in decode forwards", mixed, "tokens", "tokens", "not beside exact rows")
    return "; ".join(parts)


def _decoding(d: dict) -> str:
    """The decode path (one row; batches where the daemon says), and what exact
    temperature-0 requests get on this backend."""
    exact = {"speculate": "exact requests speculate (verify is bit-identical to serial here)",
             "serial": "exact greedy requests decode serially (verify rounds unlike serial here)",
             "guarded": "exact requests speculate with the near-tie guard (verify rounds unlike serial here)"}
    kernels = (d.get("kernels") or {}).get("name", "mlx")
    batches = f" (batches: {d['batch_decode_path']})" if d.get("batch_decode_path") else ""
    recurrence = str(d.get("recurrence", ""))
    fused = (", fused GatedDeltaNet conv and recurrence" if recurrence == "fused"
             else ", fused GatedDeltaNet recurrence" if recurrence.startswith("fused") else "")
    fused += ", merged projections" if str(d.get("linears", "")).startswith("merged") else ""
    return (f"{d.get('decode_path') or '?'}{batches}, {kernels} kernels{fused}; "
            + exact.get(d.get("exact_decode"), f"exact: {d.get('exact_decode')}"))


def _clients(d: dict) -> str:
    if "clients" not in d:
        return ""
    with_work = f"{d['clients_with_work']} with work in flight, " if "clients_with_work" in d else ""
    return f"; clients: {with_work}{d['clients']} heard from within the heartbeat timeout"


def _height_depths(table: list[dict]) -> str:
    """The governor's depth per bucket of batch heights: "1: 1, 2: 2, 3-4: 0, 5-8: 0 (not
    measured)"; a height not measured yet drafts at the nearest measured height's depth, or
    height 1's while none is."""
    return ", ".join(f"{r['heights']}: {r['depth']}" + (" (not measured)" if r.get("chosen") is None else "")
                     for r in table)  # fmt: skip


def _rows(rows: dict) -> str:
    """How many requests decode at once: "5 of 8 (auto; 5 active, 2 waiting): <why>"."""
    mode = f"of {rows['ceiling']} (auto" if rows.get("mode") == "auto" else "(pinned"
    return (f"{rows.get('limit')} {mode}; {rows.get('active', 0)} active, {rows.get('waiting', 0)} waiting)"
            + (f": {rows['why']}" if rows.get("why") else ""))


def format_status(reply) -> str:
    """The `councild status` table: one row per fact, then one row per seat."""
    d = reply.detail or {}
    gov = d.get("governor") or {}
    head = "resident, %s" % _mb(d.get("head_bytes", 0)) if d.get("head_resident") else "not resident"
    head_gov = gov.get("head") or {}
    if not d.get("head_resident") and head_gov.get("head_available") is False:
        head = "absent (the model has no MTP head: serial only)"
    elif head_gov.get("head_loading"):
        head += " (loading)"
    depth = str(d.get("depth", 0))
    if gov.get("override") == "pin_depth" and gov.get("pin_depth") is not None:
        depth += f" (pinned to {gov['pin_depth']} by an operator)"
    elif gov.get("override") not in (None, "auto"):
        depth += f" (override: {gov['override']})"
    rows = [
        ("server", f"{reply.server}, pid {d.get('pid', '?')}"),
        ("model", f"{reply.model} ({d.get('model_type', '?')})"),
        ("uptime", _uptime(reply.uptime_s)),
        ("endpoint", d.get("endpoint", "?")),
        ("MTP head", head),
        ("depth", depth),
        *([("depth by batch height", _height_depths(gov["depth_by_height"]))] if gov.get("depth_by_height") else []),
        *([("decoding", _decoding(d))] if "decode_path" in d else []),
        *([("rows at once", _rows(d["rows"]))] if d.get("rows") else []),
        ("in flight", f"{reply.active} active, {reply.queued} queued" + _clients(d)),
        ("throughput", f"{d.get('recent_tokens_per_s', 0):.1f} tok/s (last 10 s), {d.get('tokens_total', 0)} tokens total"),
    ]
    if (d.get("warming") or {}).get("pending"):  # start-up checks still to run (OPERATIONS.md, Start-up)
        rows.append(("warming", ", ".join(d["warming"]["pending"]) + " (serving meanwhile on the safe paths)"))
    prefilling = [a for a in d.get("active_requests") or [] if a.get("prefill")]
    if prefilling:
        rows.append(("prefilling", ", ".join(f"{a['seat']}/{a['request_id']} {a['prefill']['done']}/"
                                             f"{a['prefill']['total']} tokens" for a in prefilling)))
    step = d.get("step") or {}
    if step.get("steps"):  # the engine step (OPERATIONS.md): budget and how the last one spent it
        last = step.get("last") or {}
        queue = step.get("prefill_queue") or []
        rows.append(("step", f"budget {step.get('budget')} tokens; last: {last.get('decode_tokens', 0)} decode + "
                             f"{last.get('prefill_tokens', 0)} prefill; prefill queue {len(queue)} "
                             f"({sum(q.get('left', 0) for q in queue)} tokens left)"))
        pacing, together, mixed = step.get("pacing") or {}, step.get("together") or {}, step.get("mixed") or {}
        if pacing or together or mixed:
            rows.append(("prefill", _prefill_row(pacing, together, mixed)))
    pc = d.get("prefix_cache")
    if pc:
        rows.append(("prefix cache", f"{pc['entries']} snapshots, {_mb(pc['bytes'])} of {_mb(pc['max_bytes'])}, "
                                     f"{pc['hits']} hits / {pc['misses']} misses, {pc['cached_tokens']} tokens reused"))
        disk = pc.get("disk")
        if disk:
            rows.append(("prefix disk", f"{disk['files']} files, {_mb(disk['bytes'])} of {_mb(disk['max_bytes'])}, "
                                        f"{disk['hits']} hits, {disk['corrupt']} corrupt, {disk['path']}"))
    mem = d.get("memory")
    if mem:
        rows.append(("memory", ", ".join(f"{k.removesuffix('_bytes')} {_mb(v)}" for k, v in mem.items())))
    group = d.get("group")
    if group:  # tensor parallel (daemon/distributed/): one row per rank
        rows.append(("group", f"{group['size']} ranks, {group['backend']} backend, {group['exchanges']} exchanges"))
        for r in group.get("ranks", []):
            m = r["memory"]
            rows.append((f"rank {r['rank']}", f"{r['host']} pid {r['pid']}: active {_mb(m['active_bytes'])}, "
                                               f"cache {_mb(m['cache_bytes'])}, pressure {m['pressure']}"
                                               + (f", {_mb(m['available_bytes'])} available"
                                                  if m.get("available_bytes") is not None else "")))
    if gov:
        pressure = gov.get("pressure") or "unknown"
        if gov.get("available_bytes") is not None:
            pressure += f", {_mb(gov['available_bytes'])} available"
        if gov.get("shedding"):
            pressure += ", SHEDDING new requests"
        rows.append(("pressure", pressure))
        facts = [f"{k}={v}" for k, v in gov.items()
                 if k not in ("pressure", "available_bytes", "shedding", "depth") and v is not None
                 and not isinstance(v, (dict, list))]
        if gov.get("last_actions"):
            facts.append("last actions " + ", ".join(map(str, gov["last_actions"])))
        rows.append(("governor", ", ".join(facts) or "running"))
    else:
        rows.append(("governor", "disabled"))
    if d.get("draining"):
        rows.append(("state", "draining (no new work; exits when in-flight requests finish)"))
    elif d.get("state") == "loading":
        lp = d.get("load_progress") or {}
        rows.append(("state", f"loading: {lp.get('percent', 0)}% of the weights read "
                              f"({_mb(lp.get('bytes_loaded'))} of {_mb(lp.get('bytes_total'))}, "
                              f"{lp.get('seconds', 0)} s); requests are refused until it serves"))
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    seats = d.get("seats") or {}
    if seats:
        out.append("")
        out.append(f"{'seat':<16} {'active':>6} {'queued':>6} {'tokens':>8} {'tok/s':>7}")
        for seat, s in sorted(seats.items()):
            rate = s.get("tokens_per_s")
            rate_text = "-" if rate is None else f"{rate:.1f}"
            out.append(f"{seat:<16} {s.get('active', 0):>6} {s.get('queued', 0):>6} {s.get('tokens', 0):>8} {rate_text:>7}")
    return "\n".join(out)


def cmd_status(args) -> int:
    from protocol.client import Client, DaemonUnavailable

    try:
        with Client(args.endpoint, seat="status", timeout_s=args.timeout) as client:
            reply = client.status()
    except DaemonUnavailable as exc:
        print(f"councild: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(msgspec.to_builtins(reply), indent=2))
    else:
        print(format_status(reply))
    return 0


def cmd_governor_override(args) -> int:
    from protocol.client import Client, DaemonUnavailable

    action = {"pin": "pin_depth", "evict": "evict_head", "load": "load_head", "auto": "auto"}[args.governor]
    try:
        with Client(args.endpoint, seat="operator", timeout_s=10.0) as client:
            reply = client.governor(action, depth=getattr(args, "depth", None))
    except DaemonUnavailable as exc:
        print(f"councild: {exc}", file=sys.stderr)
        return 1
    print(reply.message)
    return 0 if reply.ok else 1


# Command groups: `councild GROUP --help` lists what is in each.
GROUPS = {
    "gate": "correctness and performance gates",
    "bench": "benchmarks that print a table and write JSON",
    "governor": "governor tools: replay a trace, or override a running daemon",
}

# Subcommands implemented in their own modules, each with its own argparse and help:
# command path -> (module with main(argv), one line for `councild --help`).
DELEGATED = {
    ("gate", "fidelity"): ("daemon.measure.fidelity",
                           "speculative vs serial, token for token (exit 1 on a divergence in exact mode)"),
    ("gate", "perf"): ("daemon.measure.perf_gate",
                       "interleaved serial vs speculation; exit 1 when the configured depth is slower beyond noise"),
    ("tune",): ("daemon.measure.tune", "measure this machine into the profile the governor starts from"),
    ("bench", "serial"): ("daemon.measure.serial_bench",
                          "daemon over the socket vs in-process vs mlx_lm.generate, interleaved"),
    ("bench", "spec"): ("daemon.measure.spec_bench", "speculation by depth against serial, interleaved"),
    ("bench", "drafting"): ("daemon.measure.drafting_bench",
                            "MTP head vs + prompt lookup vs per-request depth, on quoting and plain prompts"),
    ("bench", "compile"): ("daemon.measure.compile_bench",
                           "compiled vs eager one-token decode (serial and speculation), interleaved"),
    ("bench", "prefill"): ("daemon.measure.prefill_bench",
                           "prefill tok/s by prompt length, token-by-token vs chunked GatedDeltaNet, interleaved"),
    ("top",): ("daemon.top.main", "a live view of a running daemon: seats, batch, head, memory, step, decisions"),
    ("governor", "replay"): ("governor.replay_cli", "run the policy over a trace and print the decision timeline"
                                                    " (--timeline FILE: beside what the daemon did, as a picture)"),
    ("governor", "timeline"): ("governor.timeline",
                               "draw a daemon's JSON log or a governor trace as one picture on a time axis (HTML)"),
    ("service",): ("daemon.service", "install/uninstall/print/status the launchd or systemd service"),
    ("keys",): ("daemon.socket_side.keys", "generate a CURVE key pair for a TCP endpoint"),
    ("model",): ("daemon.models.cli", "pull a model from the Hub (and its MTP head), inspect one, list the cache"),
    ("http",): ("front.main", "OpenAI-compatible HTTP API and /metrics for a running daemon (the http extra)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before any subcommand's imports pull in mlx-lm and, through it, transformers (frameworks.py).
    hide_unused_frameworks()
    for prefix, (module, _) in DELEGATED.items():
        if tuple(argv[: len(prefix)]) == prefix:
            import importlib

            mod = importlib.import_module(module)
            return int(mod.main(argv[len(prefix):]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "prepare"):
        return cmd_serve(args)
    client_commands = {"generate": cmd_generate, "status": cmd_status}
    if args.command == "governor" and args.governor in ("pin", "evict", "load", "auto"):
        return _as_client(cmd_governor_override, args)
    if args.command in client_commands:
        return _as_client(client_commands[args.command], args)
    parser.print_help()
    return EXIT_USAGE


def _as_client(command, args) -> int:
    """Run a command that talks to a daemon; what can go wrong becomes one line and an exit
    code, never a traceback."""
    from protocol.client import CouncilError

    try:
        return command(args)
    except BrokenPipeError:
        # `councild status | head -2`: the reader left. Say nothing more, as cat would.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except ValueError as exc:  # a malformed endpoint (the client checks it before connecting)
        print(f"councild: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CouncilError as exc:
        print(f"councild: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
