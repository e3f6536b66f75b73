"""The engine: one loaded model and the code that runs it, imported by the daemon and never importing it.

Its wings, bottom to top (each imports only those below it; tests/daemon/test_layering.py
holds the order): kernels/ (the arithmetic of a forward), caches/ (where a request's state
is kept), model/ (a loaded checkpoint and its forwards), prefill/ (a prompt into the caches),
decoders/ (tokens out). pieces.py and types.py are the floor every wing may use."""
