"""Errors a client can cause, each mapped once to a gRPC status code at the service edge.

Internal invariants use ``assert``; anything caused by input raises one of these.
"""

from __future__ import annotations

from typing import Optional

import grpc


class KvfleetError(Exception):
    """Base class: an error with the gRPC status code it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "", *, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field  # the request field at fault (e.g. "sampling.top_p"), when one is


class InvalidArgument(KvfleetError):
    """A malformed field; the message names it."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class PromptTooLarge(InvalidArgument):
    """The prompt exceeds the router's byte limit (HTTP: 413; gRPC: INVALID_ARGUMENT)."""


class OutOfRange(KvfleetError):
    """Prompt + max_tokens beyond the model's context length."""

    code = grpc.StatusCode.OUT_OF_RANGE


class NotFound(KvfleetError):
    """Unknown model or adapter."""

    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(KvfleetError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhausted(KvfleetError):
    """The waiting queue is full, or the request can never fit the replica's KV capacity."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class AlreadyExists(KvfleetError):
    """A request with this ``request_id`` is still live (for the same tenant, or on the replica)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(KvfleetError):
    """No live replica can serve the request."""

    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(KvfleetError):
    """An authenticated tenant asked for an operation its key does not allow."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(KvfleetError):
    """The operation does not apply in the component's configuration."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceeded(KvfleetError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class StatusError(KvfleetError):
    """A status known only at run time, e.g. one a worker ended a call with and the router
    relays: ``code`` (:class:`grpc.StatusCode`) and ``details`` (the message)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message a server answers for ``exc``.

    A :class:`KvfleetError` keeps its code and message; anything else is INTERNAL with the
    exception type only (no internals leak to clients).
    """
    if isinstance(exc, KvfleetError):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"
