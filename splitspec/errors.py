"""Domain errors raised by engines and services; each service's interceptor maps them to gRPC codes.

Messages name the offending field and the allowed range: they are shown to clients verbatim.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class; ``code`` is the name of the gRPC status code it maps to."""

    code = "INTERNAL"


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    code = "NOT_FOUND"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class Aborted(ServiceError):
    code = "ABORTED"


class ResourceExhausted(ServiceError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


class UpstreamError(ServiceError):
    """A worker's failure passed on to the gateway's client with the worker's own status code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
