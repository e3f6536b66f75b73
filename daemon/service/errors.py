"""The one exception `councild service` raises: a refusal with a message and an exit status."""

from __future__ import annotations

from ..exits import EXIT_FAILED

# Exit statuses (daemon/exits.py): 1 a service-manager command failed or `status` found
# nothing installed; 2 bad flags; 69 --now without systemctl/launchctl; 78 --now without the
# config file.


class ServiceError(Exception):
    """A refusal with a message for the user and the exit status to leave with."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code
