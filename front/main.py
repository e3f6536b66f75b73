"""`councild http`: run the OpenAI-compatible HTTP front (and /metrics) in the foreground."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import HttpConfigError, load_http_config

EXIT_CONFIG = 78

DESCRIPTION = """\
Serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models),
/health and Prometheus /metrics for a running councild. A separate process: it talks to the
daemon over the ZeroMQ protocol like any council process, one connection per seat.
Binds 127.0.0.1 by default; any other address needs http.api_keys in the config.
Needs the `http` extra: pip install 'councild[http]'.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild http", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="the councild TOML file; its [http] table and `endpoint` are read")
    ap.add_argument("--host", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, help="port (default 8400)")
    ap.add_argument("--endpoint", help="daemon endpoint (default: the config's, else $COUNCILD_ENDPOINT or the per-user socket)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    try:
        cfg, endpoint = load_http_config(args.config, {"host": args.host, "port": args.port})
    except HttpConfigError as exc:
        print(f"councild http: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        import uvicorn

        from .app import build_app
    except ImportError as exc:
        print(f"councild http: {exc.name} is missing; install the http extra: pip install 'councild[http]'", file=sys.stderr)
        return EXIT_CONFIG
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = build_app(cfg, args.endpoint or endpoint)
    logging.getLogger("councild.http").info("http.start host=%s port=%s endpoint=%s seats_by_key=%d", cfg.host, cfg.port,
                                            args.endpoint or endpoint or "default", len(cfg.api_keys))
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level, access_log=False, lifespan="on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
