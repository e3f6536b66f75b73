"""The exceptions a councild client raises, grouped by what a caller does about them."""

from __future__ import annotations

from .. import messages as m


class CouncilError(Exception):
    """An Error the daemon sent (``code`` is the wire code), or a local failure with the
    same shape. Subclasses group the codes by what a caller does about them."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None, request_id: str | None = None):
        text = f"{code}: {message}"
        if request_id is not None:
            text += f" [request {request_id}]"
        if retry_after_s is not None:
            text += f" (retry after {retry_after_s:g} s)"
        super().__init__(text)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.request_id = request_id


class InvalidRequest(CouncilError, ValueError):
    """The request is wrong and retrying it unchanged will fail again. Also a ValueError: a
    request the client refuses before sending (a lone surrogate in a string, a bound broken)
    is a bad argument to the call."""


class Overloaded(CouncilError):
    """The daemon cannot take the work now (``overloaded``, ``shutting_down``); try later,
    after ``retry_after_s`` when it is given."""


class RequestAborted(CouncilError):
    """The request was accepted but ended without a Done (deadline, slow consumer, client gone)."""


class DaemonError(CouncilError):
    """A bug or failure inside the daemon (``internal``), or a code this client does not know."""


class DaemonUnavailable(CouncilError):
    """Nothing was heard from the daemon within ``timeout_s``. Not a wire code: ``code`` is
    ``"unavailable"`` and ``endpoint`` names where the client looked."""

    def __init__(self, endpoint: str, message: str, request_id: str | None = None):
        super().__init__("unavailable", message, request_id=request_id)
        self.endpoint = endpoint


FAMILIES: dict[str, type[CouncilError]] = {
    "bad_frame": InvalidRequest,
    "frame_too_large": InvalidRequest,
    "unsupported_version": InvalidRequest,
    "unknown_type": InvalidRequest,
    "invalid_request": InvalidRequest,
    "duplicate_request": InvalidRequest,
    "not_found": InvalidRequest,
    "prompt_too_long": InvalidRequest,
    "overloaded": Overloaded,
    "shutting_down": Overloaded,
    "deadline_exceeded": RequestAborted,
    "slow_consumer": RequestAborted,
    "client_gone": RequestAborted,
    "internal": DaemonError,
}


def error_from_wire(err: m.Error) -> CouncilError:
    """The exception for an Error message, of the subclass of its code's family."""
    cls = FAMILIES.get(err.code, DaemonError)
    return cls(err.code, err.message, err.retry_after_s, err.request_id)
