"""How a failed or cancelled request marks its spans (one place for router, worker, client)."""

from __future__ import annotations

import grpc
from opentelemetry.trace import Status, StatusCode

from kvfleet.telemetry import names as n

_FINISH_OF_CODE = {grpc.StatusCode.CANCELLED: n.FINISH_CANCELLED,
                   grpc.StatusCode.DEADLINE_EXCEEDED: n.FINISH_DEADLINE}
# gRPC server spans: codes the caller caused (INVALID_ARGUMENT, NOT_FOUND, …) leave the status
# unset, as the RPC semantic conventions say; a cancelled request is marked ERROR all the same,
# so that it stands out in a trace backend.
_SERVER_ERRORS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                  grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
                  grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}


def finish_reason_of_code(code: grpc.StatusCode) -> str:
    """The ``gen_ai.response.finish_reasons`` value of a request that ended with ``code``."""
    return _FINISH_OF_CODE.get(code, n.FINISH_ERROR)


def set_failure(span, code: grpc.StatusCode, message: str, finish_reason: str,
                server: bool = False) -> None:
    """Mark ``span`` with the gRPC status it ended with, its finish reason and error type."""
    span.set_attributes({n.RPC_GRPC_STATUS_CODE: code.value[0], n.ERROR_TYPE: code.name,
                         n.GEN_AI_RESPONSE_FINISH_REASONS: [finish_reason]})
    if not server or code in _SERVER_ERRORS:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
