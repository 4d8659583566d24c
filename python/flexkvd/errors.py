"""Errors of the flexkvd package: one exception class per status code of libflexkv (gRPC's numbering).

Every failure of a libflexkv call, and every data-plane request that ended with an error, raises a subclass of
`Error` carrying the code and the daemon's (or the client library's) message unchanged.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Dict, Optional, Type

if TYPE_CHECKING:  # pragma: no cover
    from .client import OpResult


class StatusCode(enum.IntEnum):
    """flexkv::StatusCode (client/include/flexkv/status.h): numerically identical to grpc::StatusCode."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Error(Exception):
    """A libflexkv or flexkvd failure.

    Attributes:
      code: the StatusCode.
      message: the message as the daemon or the client library wrote it, without the code's name
        (e.g. "geometry.num_layers is 0; expected 1..1024").
      result: for a data-plane request that ended with an error, its OpResult (a Store that stored part of its
        blocks says how many in result.done_blocks); None otherwise.
    """

    code: StatusCode = StatusCode.UNKNOWN

    def __init__(self, message: str, code: Optional[int] = None, result: Optional["OpResult"] = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = _to_code(code)
        self.message = message
        self.result = result

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def __reduce__(self) -> Any:  # keeps code and result across pickling (multiprocessing)
        return (_rebuild, (type(self), self.message, int(self.code), self.result))


def _rebuild(cls: Type[Error], message: str, code: int, result: Any) -> Error:
    return cls(message, code, result)


def _to_code(code: int) -> StatusCode:
    try:
        return StatusCode(code)
    except ValueError:
        return StatusCode.UNKNOWN


# Each subclass also derives from the builtin exception a Python caller would catch for that kind of failure.
class Cancelled(Error):
    code = StatusCode.CANCELLED


class Unknown(Error):
    code = StatusCode.UNKNOWN


class InvalidArgument(Error, ValueError):
    code = StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(Error, TimeoutError):
    """Not done in time. From Ticket.wait: the request is still in flight and the ticket stays valid."""

    code = StatusCode.DEADLINE_EXCEEDED


class NotFound(Error, LookupError):
    code = StatusCode.NOT_FOUND


class AlreadyExists(Error):
    code = StatusCode.ALREADY_EXISTS


class PermissionDenied(Error, PermissionError):
    code = StatusCode.PERMISSION_DENIED


class ResourceExhausted(Error):
    code = StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(Error):
    code = StatusCode.FAILED_PRECONDITION


class Aborted(Error):
    code = StatusCode.ABORTED


class OutOfRange(Error, IndexError):
    code = StatusCode.OUT_OF_RANGE


class Unimplemented(Error, NotImplementedError):
    code = StatusCode.UNIMPLEMENTED


class Internal(Error):
    code = StatusCode.INTERNAL


class Unavailable(Error, ConnectionError):
    """The daemon is not reachable, is draining, or closed this session (attach again)."""

    code = StatusCode.UNAVAILABLE


class DataLoss(Error):
    code = StatusCode.DATA_LOSS


class Unauthenticated(Error):
    code = StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[StatusCode, Type[Error]] = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists, PermissionDenied,
                ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented, Internal, Unavailable,
                DataLoss, Unauthenticated)
}


def error_for(code: int, message: str, result: Optional["OpResult"] = None) -> Error:
    """The exception for a status code: the subclass of Error that names it (Error itself for an unknown code)."""
    status = _to_code(code)
    cls = _BY_CODE.get(status, Error)
    return cls(message, code, result)
