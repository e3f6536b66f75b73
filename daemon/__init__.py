"""councild: the daemon process (CLI, config, server loop, scheduler, engine)."""

__version__ = "0.1.0"
