"""The HTTP errors of the front's routes: HTTPError (OpenAI's error shape, with Retry-After),
and councild's errors and an unreachable daemon mapped to it. Anthropic's routes reshape it
(front/anthropic_api.py)."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from protocol.client import CouncilError, DaemonUnavailable

from .daemon_link import DaemonUnreachable, anthropic_error_body

# councild error code -> HTTP status (and OpenAI's error code where it has one of its own).
HTTP_STATUS = {
    "invalid_request": 400, "bad_frame": 400, "frame_too_large": 400, "unsupported_version": 400,
    "unknown_type": 400, "duplicate_request": 400, "prompt_too_long": 400, "not_found": 404,
    "overloaded": 429, "shutting_down": 503, "deadline_exceeded": 504,
    "slow_consumer": 500, "client_gone": 500, "internal": 500,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
              429: "rate_limit_error", 500: "server_error", 503: "service_unavailable", 504: "timeout"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_council(exc: CouncilError) -> HTTPError:
    if isinstance(exc, DaemonUnavailable):
        return HTTPError(503, f"councild is not answering: {exc.message}", code="daemon_unavailable", retry_after=2.0)
    status = HTTP_STATUS.get(exc.code, 500)
    code = "context_length_exceeded" if exc.code == "prompt_too_long" else exc.code
    retry = exc.retry_after_s if exc.retry_after_s is not None else (2.0 if status in (429, 503) else None)
    return HTTPError(status, exc.message, code=code, retry_after=retry)


def from_unreachable(exc: DaemonUnreachable) -> HTTPError:
    return HTTPError(503, exc.message, code="daemon_unavailable", retry_after=exc.retry_after)


def speaks_anthropic(path: str) -> bool:
    """Whether a request path is one of Anthropic's routes (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def shaped_response(path: str, err: HTTPError) -> JSONResponse:
    """``err`` in the error shape of the API that ``path`` belongs to (with Retry-After)."""
    resp = err.response()
    if not speaks_anthropic(path):
        return resp
    headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(anthropic_error_body(err.status, err.message), status_code=err.status, headers=headers)
