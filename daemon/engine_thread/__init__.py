"""The engine thread: the step loop (worker.py) and its parts (startup.py and the engine it
loads, loaded_engine.py; commands.py, decode_paths.py, prefix_cache_use.py,
status_snapshot.py), the scheduler and its seats' counters (scheduler.py, seat_stats.py,
stats.py), the governor's side (governance.py, head_slot.py, profile.py), and start-up's
probes and warm-up (kernel_choice.py, probe_verdicts.py, warmup.py; prebuild_start.py, which
the CLI calls before its serving imports).
It imports request text and the engine (daemon/engine/) below it, never the socket side."""
