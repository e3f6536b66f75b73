"""The measurement wing: gates (fidelity, perf), benchmarks (serial, spec, compile) and the
measuring half of `councild tune`. It imports the engine; nothing in the running daemon
imports it (the profile the daemon reads lives in ``daemon.engine_thread.profile``)."""
