"""Ticket: one submitted data-plane request of a flexkvd.Client (flexkv::Ticket), and its OpResult.

Split from client.py (the Client that issues tickets); a Ticket uses only its client's handle (_handle).
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Optional, Union

from . import _lib, _native
from ._convert import c_uint, wait_seconds
from .errors import DeadlineExceeded, Error, StatusCode, error_for

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

# Longest single blocking call a Ticket wait makes into libflexkv: bounds how late Ctrl-C is seen by a main thread
# blocked in Ticket.wait.
_WAIT_SLICE_S = 0.05
# How long a wait that finds its ticket's result taken (NotFound) gives the thread that took it to record it.
_SETTLE_S = 1.0


@dataclasses.dataclass(frozen=True)
class OpResult:
    """The end of one data-plane request (flexkv::OpResult).

    matched_blocks: Match: leading blocks cached. Store: leading blocks already cached (skipped).
    done_blocks: Load: blocks copied (past first_block). Store: blocks newly stored.
    match_handle: Match with pin: pass to Client.load / Client.release (0 when nothing matched).
    status_code / message: OK and "" for a request that was done; otherwise why (part of) it was not, as the
      daemon said (Ticket.wait raises then, with this result on the exception).
    bytes: Prefetch: bytes pulled from peers. Load: bytes copied, every component's (0 from an older flexkvd).
    source: Prefetch: the node the blocks came from, or why none were pulled ("" when no peer had them).
    """

    status_code: StatusCode
    matched_blocks: int
    done_blocks: int
    match_handle: int
    message: str = ""
    bytes: int = 0
    source: str = ""

    @property
    def ok(self) -> bool:
        return self.status_code == StatusCode.OK

    @classmethod
    def _from_c(cls, r: _lib.OpResultStruct) -> "OpResult":
        status = _STATUS_CODES.get(r.status_code, StatusCode.UNKNOWN)  # a dict, not StatusCode(): the hot path
        message = r.message.decode("utf-8", "replace") if status else ""
        source = r.source.decode("utf-8", "replace") if r.source else ""
        return cls(status, r.matched_blocks, r.done_blocks, r.match_handle, message, r.bytes, source)


_STATUS_CODES = {int(c): c for c in StatusCode}


class Ticket:
    """One submitted request. Every request ends exactly once; its outcome is kept, so wait() may be called again
    (and from any thread) and gives the same result or raises the same error.

    id counts from 1 within the session that issued the ticket; generation names that session (libflexkv gives
    every attach in the process a new one). Once that session has ended (detach, close, a re-attach, the daemon
    restarted), waiting on a ticket that had not ended raises FailedPrecondition: a ticket never gives another
    request's result."""

    __slots__ = ("_client", "_c", "id", "generation", "op", "_lock", "_outcome")

    def __init__(self, client: "Client", c_ticket: Optional[_lib.TicketStruct], op: str, id: int = 0,
                 generation: int = 0) -> None:
        """c_ticket: the flexkv_ticket as ctypes filled it; None when the fast path gave id and generation."""
        self._client = client
        self._c = c_ticket
        self.id = int(c_ticket.id) if c_ticket is not None else id
        self.generation = int(c_ticket.generation) if c_ticket is not None else generation
        self.op = op  # "match" | "prefetch" | "load" | "store" | "release"
        self._lock = threading.Lock()
        self._outcome: Union[None, OpResult, Error] = None

    def _c_ticket(self) -> _lib.TicketStruct:
        if self._c is None:
            self._c = _lib.TicketStruct(self.id, self.generation)
        return self._c

    def __repr__(self) -> str:
        state = "pending" if self._outcome is None else "ended"
        return f"<flexkvd.Ticket {self.op} #{self.id} of session generation {self.generation} {state}>"

    def _settle(self, result: OpResult) -> OpResult:
        with self._lock:
            if self._outcome is None:
                self._outcome = result if result.ok else error_for(result.status_code, result.message, result)
        return self._result()

    def _result(self) -> OpResult:
        outcome = self._outcome
        if isinstance(outcome, Error):
            raise outcome
        assert outcome is not None
        return outcome

    def _context(self) -> str:
        return f"{self.op} request (ticket {self.id})"

    def _taken_elsewhere(self, err: Error) -> OpResult:
        """libflexkv answered NotFound: another thread's wait on this Ticket took the result and records it in a
        moment; returns it (or raises it). Raises `err` if nobody records it (that thread died in between)."""
        deadline = time.monotonic() + _SETTLE_S
        while self._outcome is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        if self._outcome is None:
            raise err
        return self._result()

    def wait(self, timeout: Optional[float] = None) -> OpResult:
        """Waits until the request ends and returns its OpResult; the GIL is released while waiting.

        timeout: seconds (None: as long as it takes; 0 or less: just look; more than a year: a year).
        Raises the request's error (a subclass of flexkvd.Error, whose .result is the OpResult) when it ended with
        one; DeadlineExceeded (also a TimeoutError) when it has not ended in time: it is still in flight and this
        ticket stays valid; Unavailable when the daemon went away (attach again); FailedPrecondition when its
        session has ended (detach, close, or a re-attach), also while this wait runs.
        """
        if self._outcome is not None:
            return self._result()
        seconds = wait_seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        ext = _native.ext
        out = _lib.OpResultStruct() if ext is None else None
        while True:
            slice_s = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            ptr = self._client._handle.acquire()
            try:
                if self._outcome is not None:  # another thread took the result
                    return self._result()
                if ext is not None:  # the same flexkv_wait, without ctypes around it (GIL released there too)
                    got = ext.wait(ptr, self.id, self.generation, int(slice_s * 1e6))
                    if not isinstance(got, int):
                        return self._settle(got)
                    rc = got
                else:
                    rc = _lib.lib.flexkv_wait(ptr, self._c_ticket(), int(slice_s * 1e6), ctypes.byref(out))
                    if rc == 0:
                        return self._settle(OpResult._from_c(out))
                err = None if rc == StatusCode.DEADLINE_EXCEEDED else _lib.error_from_last(rc, self._context())
            finally:
                self._client._handle.release()
            if err is not None:
                if rc == StatusCode.NOT_FOUND:
                    return self._taken_elsewhere(err)
                raise err
            if deadline is not None and time.monotonic() >= deadline:
                # Another thread waiting on this ticket may have taken the result during our last slice (libflexkv
                # hands it to one waiter): the request ended, this is no timeout.
                if self._outcome is not None:
                    return self._result()
                raise DeadlineExceeded(f"{self._context()} did not end within {timeout} s; it is still in flight and "
                                       "the ticket stays valid")

    def try_wait(self) -> Optional[OpResult]:
        """The OpResult if the request has ended, else None ("not yet"); never blocks. Raises as wait() for a request
        that ended with an error; FailedPrecondition when its session has ended or the client is not attached;
        Unavailable when the daemon went away (so a polling loop does not poll forever)."""
        if self._outcome is not None:
            return self._result()
        ext = _native.ext
        ptr = self._client._handle.acquire()
        try:
            if self._outcome is not None:
                return self._result()
            if ext is not None:
                got = ext.try_wait(ptr, self.id, self.generation)
                if not isinstance(got, int):
                    return self._settle(got)
                rc = got
            else:
                out = _lib.OpResultStruct()
                rc = _lib.lib.flexkv_try_wait(ptr, self._c_ticket(), ctypes.byref(out))
                if rc == 0:
                    return self._settle(OpResult._from_c(out))
            # DEADLINE_EXCEEDED: not ended. Anything else (FAILED_PRECONDITION: its session is gone; UNAVAILABLE: the
            # daemon is) is an error, never "not yet"; NOT_FOUND: another thread's wait took the result.
            err = None if rc == StatusCode.DEADLINE_EXCEEDED else _lib.error_from_last(rc, self._context())
        finally:
            self._client._handle.release()
        if err is not None:
            if rc == StatusCode.NOT_FOUND:
                return self._taken_elsewhere(err)
            raise err
        if self._outcome is not None:  # another thread's wait took the result meanwhile
            return self._result()
        return None

    def done(self) -> bool:
        """True once the request has ended (successfully or not); never blocks, never raises the request's own
        error. Raises what try_wait raises when the end cannot be known any more (FailedPrecondition: its session
        has ended; Unavailable), rather than answer False forever."""
        try:
            return self.try_wait() is not None
        except Error:
            if self._outcome is not None:
                return True
            raise

    def wait_launched(self, timeout: Optional[float] = None) -> None:
        """For a load with an event set (Client.load(..., event_set=...)): waits until the daemon has enqueued every
        layer's copies and recorded every layer's event (or the load ended OK); the GIL is released while waiting.
        Only after this returns may the engine make its streams wait on the set's events (LayerEventSet.wait).

        Raises the load's own error when it ended with one (nothing may then wait on the events for it),
        DeadlineExceeded (ticket still valid) when it has not launched by `timeout` seconds.
        """
        seconds = wait_seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            if self._outcome is not None:
                if isinstance(self._outcome, BaseException):
                    raise self._outcome
                return
            slice_s = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            ptr = self._client._handle.acquire()
            try:
                rc = _lib.lib.flexkv_wait_launched(ptr, self._c_ticket(), int(slice_s * 1e6))
                err = None if rc in (0, StatusCode.DEADLINE_EXCEEDED) else _lib.error_from_last(rc, self._context())
            finally:
                self._client._handle.release()
            if rc == 0:
                return
            if err is not None:
                raise err
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"{self._context()}: not launched within {timeout} s; it is still in flight "
                                       "and the ticket stays valid")

    def wait_layers(self, layers: int, timeout: Optional[float] = None) -> int:
        """For a layer-wise load: waits until at least `layers` layers have landed in the engine's KV buffers (or
        the request ended) and returns how many have; the GIL is released while waiting.

        Raises DeadlineExceeded (ticket still valid) when fewer have landed by `timeout` seconds. Once the request
        has ended this returns `layers`; wait() tells whether it succeeded.
        """
        layers = c_uint(layers, "layers")
        seconds = wait_seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        landed = ctypes.c_uint32(0)
        while True:
            if self._outcome is not None:
                return layers
            slice_s = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            ptr = self._client._handle.acquire()
            try:
                rc = _lib.lib.flexkv_wait_layers(ptr, self._c_ticket(), layers, int(slice_s * 1e6),
                                                 ctypes.byref(landed))
                err = None if rc in (0, StatusCode.DEADLINE_EXCEEDED) else _lib.error_from_last(rc, self._context())
            finally:
                self._client._handle.release()
            if rc == 0:
                return int(landed.value)
            if err is not None:
                raise err
            if deadline is not None and time.monotonic() >= deadline:
                if self._outcome is not None:  # another thread's wait() took the end meanwhile
                    return layers
                raise DeadlineExceeded(f"{self._context()}: fewer than {layers} layers landed within {timeout} s; it "
                                       "is still in flight and the ticket stays valid")
