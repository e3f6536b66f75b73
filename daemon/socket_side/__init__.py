"""The socket side: the ROUTER socket's loop (server.py), sending to clients and cutting slow
ones (client_delivery.py), binding and CURVE (endpoint.py, keys.py), the status reply
(status_reply.py) and the service manager's notifications (notify.py). It imports the engine
thread and request text below it, never the reverse (tests/daemon/test_layering.py)."""
