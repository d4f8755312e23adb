"""Gateway errors -> HTTP statuses and each API's own error JSON, in one place.

Every failure of an HTTP request is a :class:`splitspec.errors.ServiceError` (raised by the HTTP
layer's own validation or by the generation path Generate shares) or something unexpected; both
go through :func:`http_error`, which logs them as the gRPC interceptor does
(``transport.interceptors.status_of``: unexpected ones with a traceback and an incident id, and the
client gets only the incident id).
"""

from __future__ import annotations

import re

from splitspec.errors import ServiceError
from splitspec.transport.interceptors import status_of

# gRPC status name -> HTTP status.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "INTERNAL": 500,
    "UNKNOWN": 500,
    "DATA_LOSS": 500,
}

OPENAI_TYPE = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
    405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled",
    501: "invalid_request_error", 503: "service_unavailable", 504: "timeout", 500: "server_error",
}
ANTHROPIC_TYPE = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 499: "api_error",
    501: "invalid_request_error", 503: "overloaded_error", 504: "api_error", 500: "api_error",
}

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class PayloadTooLarge(ServiceError):
    """A request body over the gateway's --max-request-bytes (HTTP 413)."""

    code = "RESOURCE_EXHAUSTED"
    http_status = 413


class ModelNotFound(ServiceError):
    code = "NOT_FOUND"
    http_status = 404


class HttpError:
    """What an HTTP request that failed answers: status, message, and the field it names (or None)."""

    def __init__(self, status: int, message: str, param: str | None, code: str) -> None:
        self.status, self.message, self.param, self.code = status, message, param, code

    def openai(self) -> dict:
        error_code = {404: "model_not_found" if self.code == "NOT_FOUND" else None, 429: "rate_limit_exceeded", 401: "invalid_api_key"}
        return {"error": {"message": self.message, "type": OPENAI_TYPE.get(self.status, "server_error"), "param": self.param,
                          "code": error_code.get(self.status)}}

    def anthropic(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPE.get(self.status, "api_error"), "message": self.message}}


def http_error(exc: BaseException, method: str, rid: str) -> HttpError:
    """The HTTP answer to ``exc``, logged once (see the module's docstring)."""
    code, message = status_of(exc, "gateway", method, rid)  # logs; hides unexpected errors behind an incident id
    name = code.name
    status = getattr(exc, "http_status", None) or HTTP_STATUS.get(name, 500)
    match = _FIELD.match(message) if isinstance(exc, ServiceError) else None
    return HttpError(status, message, match.group(1) if match else None, name)
