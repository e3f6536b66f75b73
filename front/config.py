"""The [http] table of the councild config file, for `councild http`."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from protocol.messages import SeatName

LOOPBACK = ("127.0.0.1", "::1", "localhost")


class HttpConfigError(Exception):
    """A configuration `councild http` refuses to start with (exit code 78)."""


class HttpConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8400
    # API key -> seat. Required for any host other than loopback; with keys, every /v1
    # request must carry `Authorization: Bearer <key>` and speaks as the key's seat.
    api_keys: dict[str, SeatName] = {}
    # The seat of requests without a key (loopback, no keys configured) that do not name one
    # with the X-Councild-Seat header.
    default_seat: SeatName = "http"
    # The model id /v1/models reports and responses carry; default: the daemon's model name.
    model_name: str | None = None
    # How long a status read is reused by /health and /metrics (each read is one round trip).
    status_ttl_s: Annotated[float, Meta(ge=0, le=60)] = 0.5
    # The daemon connection's liveness timeout (protocol.AsyncClient timeout_s).
    daemon_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    # The front asks the daemon for its status this often, and calls it unreachable when an
    # answer takes longer than daemon_probe_timeout_s: requests then get 503 + Retry-After
    # within a second or two instead of waiting out daemon_timeout_s. The timeout is above a
    # loaded machine's status round trip (tenths of a second), below a person's patience.
    daemon_probe_interval_s: Annotated[float, Meta(gt=0, le=60)] = 0.5
    daemon_probe_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 1.5
    # How long a request waits for an unreachable daemon to come back before its 503; 0
    # answers at once. Operators who prefer holding requests across a daemon restart (a model
    # load takes seconds to minutes) raise it.
    unreachable_hold_s: Annotated[float, Meta(ge=0, le=3600)] = 0.0
    # max_tokens of a request that gives none (OpenAI's default is "as many as fit"); capped
    # by the daemon's own limit.
    default_max_tokens: Annotated[int, Meta(ge=1)] = 4096
    # The largest request body taken (413 above it). Twice the daemon's default frame limit
    # (max_frame_bytes, 8 MiB): JSON escapes ("\u4e2d") make a body longer than its message.
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 16 << 20


def load_http_config(path: str | os.PathLike | None = None, overrides: dict | None = None) -> tuple[HttpConfig, str | None]:
    """The [http] table (and the daemon's top-level `endpoint`) of the config file, with
    ``overrides`` (flags) on top. Raises HttpConfigError naming the key on a bad value."""
    data: dict = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise HttpConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise HttpConfigError(f"config file {path} is not valid TOML: {exc}") from None
    table = dict(data.get("http", {}))
    table.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        cfg = msgspec.convert(table, HttpConfig)
    except msgspec.ValidationError as exc:
        raise HttpConfigError(f"invalid [http] table{' in ' + str(path) if path else ''}: "
                              f"{str(exc).replace('`$', '`$.http')}") from None
    if cfg.host not in LOOPBACK and not cfg.api_keys:
        raise HttpConfigError(f"http.host = {cfg.host!r} is not a loopback address: set http.api_keys "
                              "(API key -> seat) so that only holders of a key can use the model")
    return cfg, data.get("endpoint")
