"""councild's wire protocol: messages, codec and client library.

Importing this package never imports mlx: a council process needs only pyzmq and msgspec.
"""

from .client import (
    AsyncClient,
    AsyncStream,
    Client,
    CouncilError,
    DaemonError,
    DaemonUnavailable,
    InvalidRequest,
    Overloaded,
    RequestAborted,
    Stream,
)
from .codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, UnencodableMessage, decode_client, decode_daemon, encode
from .messages import *  # noqa: F401,F403
from .messages import __all__ as _messages_all
from .paths import default_endpoint, runtime_dir

__all__ = [
    *_messages_all,
    "DEFAULT_MAX_FRAME_BYTES",
    "ProtocolError",
    "UnencodableMessage",
    "decode_client",
    "decode_daemon",
    "encode",
    "default_endpoint",
    "runtime_dir",
    "Client",
    "AsyncClient",
    "Stream",
    "AsyncStream",
    "CouncilError",
    "InvalidRequest",
    "Overloaded",
    "RequestAborted",
    "DaemonError",
    "DaemonUnavailable",
]
