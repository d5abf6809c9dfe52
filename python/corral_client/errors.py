"""Exceptions of the corral client: one per gRPC status code family, each carrying the
server's message (`str(e)`) and the code (`e.code`, a grpc.StatusCode)."""

import grpc


class CorralError(Exception):
    """Base of every error the client raises."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidJob(CorralError):
    """The request is invalid or cannot be carried out as asked (INVALID_ARGUMENT,
    FAILED_PRECONDITION): a bad job spec, a job that can never fit, an unknown option."""


class NotFound(CorralError):
    """No such job, node or token (NOT_FOUND)."""


class AlreadyExists(CorralError):
    """ALREADY_EXISTS."""


class PermissionDenied(CorralError):
    """The caller may not do this, e.g. a tenant touching another tenant's job (PERMISSION_DENIED)."""


class Unauthenticated(PermissionDenied):
    """No valid credentials: a missing, unknown, expired or revoked token (UNAUTHENTICATED)."""


class ResourceExhausted(CorralError):
    """A limit was reached, e.g. a tenant's pending jobs (RESOURCE_EXHAUSTED)."""


class Unavailable(CorralError):
    """No coordinator could answer in time (UNAVAILABLE), e.g. during an election."""


class TlsRefused(Unavailable):
    """A server failed the client's TLS checks: its certificate is not the cluster CA's, not
    valid for its address, or not a coordinator's (the role it carries). Nothing was sent to
    it, the token included; the message says which check failed, in one line."""


class DeadlineExceeded(Unavailable, TimeoutError):
    """The call, or `wait(timeout=...)`, did not finish in time (DEADLINE_EXCEEDED)."""


class Cancelled(CorralError):
    """The call was cancelled (CANCELLED)."""


class Aborted(CorralError):
    """ABORTED."""


class RevisionTooOld(CorralError):
    """A watch resumed from a revision the coordinators no longer remember (OUT_OF_RANGE):
    list the jobs again and watch from now on."""


class ServerError(CorralError):
    """The server failed or does not know the call (UNKNOWN, INTERNAL, UNIMPLEMENTED, DATA_LOSS)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidJob,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidJob,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.OUT_OF_RANGE: RevisionTooOld,
    grpc.StatusCode.UNKNOWN: ServerError,
    grpc.StatusCode.INTERNAL: ServerError,
    grpc.StatusCode.UNIMPLEMENTED: ServerError,
    grpc.StatusCode.DATA_LOSS: ServerError,
}


def error_for(code, message):
    """The exception for a gRPC status."""
    return _BY_CODE.get(code, CorralError)(message or str(code), code)


def from_rpc_error(e):
    """The exception for a grpc.RpcError."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return error_for(code, details)
