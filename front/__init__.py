"""councild's HTTP front: an OpenAI-compatible API and Prometheus /metrics.

A separate process (`councild http`) that is a client of the daemon's ZeroMQ protocol
(protocol.AsyncClient, one connection per seat), so the daemon stays the single owner of the
model and every HTTP request is an ordinary request with a seat, a priority and one terminal
message. It reads the daemon's state through the same Status message `councild status`
uses. It imports protocol/ only: never the engine, never mlx.
"""
