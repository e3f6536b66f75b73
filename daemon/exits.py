"""Every exit status a `councild` command returns, in one place (sysexits.h where one fits),
so launchd / systemd and people can tell failures apart. docs/OPERATIONS.md lists them; a
test checks the two agree."""

EXIT_OK = 0
EXIT_FAILED = 1  # a gate failed, a request failed, no daemon answered, a service command failed
EXIT_USAGE = 2  # bad flags (argparse's own status)
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: a needed program (systemctl, launchctl) is not on PATH
EXIT_SOFTWARE = 70  # EX_SOFTWARE: internal error, or the model failed to load
EXIT_CANTCREAT = 73  # EX_CANTCREAT: an output file cannot be created (`councild keys`)
EXIT_TEMPFAIL = 75  # EX_TEMPFAIL: another daemon already serves this endpoint, or a full disk at start-up
EXIT_CONFIG = 78  # EX_CONFIG: bad configuration; restarting will not help

ALL = {name: value for name, value in globals().items() if name.startswith("EXIT_")}
