"""DaemonLink: one process's session with flexkvd for the vLLM connector, reattached with backoff after the daemon
went away (killed, restarted, drained), so that a lost daemon costs cache hits and never a hang or a failed request.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional

import flexkvd

log = logging.getLogger("flexkvd.integrations.vllm")

# Errors that mean "this session is gone": the daemon went away (Unavailable), or the session ended under us
# (FailedPrecondition: detached, or lost and dropped by libflexkv). Anything else is one request's failure.
SESSION_LOST = (flexkvd.Unavailable, flexkvd.FailedPrecondition)


def session_lost(err: BaseException) -> bool:
    """True when `err` says the session is gone, not that one request failed: a request's own error (a draining
    daemon's Unavailable, lapsed pins' FailedPrecondition) carries its OpResult."""
    return isinstance(err, SESSION_LOST) and getattr(err, "result", None) is None


@dataclasses.dataclass
class LinkOptions:
    """How a DaemonLink reaches the daemon. socket None: $FLEXKV_SOCKET, else libflexkv's default socket."""

    socket: Optional[str] = None
    connect_timeout_s: float = 0.05  # per attempt: the scheduler's step must not stall on a dead daemon
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0


class DaemonLink:
    """A reconnecting session: client() returns an attached flexkvd.Client, or None while the daemon is not
    reachable (then the caller treats every lookup as a miss). After lost(), the next client() call at or after the
    backoff deadline connects and attaches anew, and calls on_attach(client) (register KV buffers there); a failed
    attempt doubles the backoff up to backoff_max_s, a success resets it.

    Thread safety: every method may be called from any thread; one attempt runs at a time. Ownership: the link owns
    its client; close() closes it (the caller drops its KV views first, or the host KV mapping lingers until they go).
    """

    def __init__(self, name: str, namespace: str, geometry: flexkvd.Geometry, options: LinkOptions,
                 dp_rank: int = 0, tp_rank: int = 0,
                 on_attach: Optional[Callable[[flexkvd.Client], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.namespace = namespace
        self.geometry = geometry
        self.options = options
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank
        self.on_attach = on_attach
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Optional[flexkvd.Client] = None
        self._retry_at = 0.0
        self._stalled_until = 0.0
        self._backoff = options.backoff_initial_s
        self.attaches = 0  # successful attaches (1 + reconnects)
        self.failures = 0  # failed attempts and lost sessions
        self.last_error = ""
        self._closed = False

    def client(self, raise_errors: bool = False) -> Optional[flexkvd.Client]:
        """The attached client; None while the daemon is not reachable (no attempt before the backoff ends).
        raise_errors: an attempt that fails for another reason than an unreachable daemon (a geometry the daemon
        refuses, KV buffers on_attach cannot register) raises that error instead of waiting for the backoff: for a
        first attach, whose mistakes are the caller's to see."""
        with self._lock:
            if self._client is not None or self._closed:
                return None if self._client is not None and self._clock() < self._stalled_until else self._client
            if self._clock() < self._retry_at:
                return None
            client = None
            try:
                client = flexkvd.connect(self.options.socket, timeout=self.options.connect_timeout_s)
                client.attach(self.name, self.namespace, self.geometry, dp_rank=self.dp_rank, tp_rank=self.tp_rank)
                if self.on_attach is not None:
                    self.on_attach(client)
            except flexkvd.Error as err:
                if client is not None:
                    client.close()
                self._fail_locked(err)
                if raise_errors and not isinstance(err, flexkvd.Unavailable):
                    raise
                return None
            except BaseException:  # a caller's bug in on_attach (TypeError...): no half-made session is kept
                if client is not None:
                    client.close()
                raise
            self._client = client
            self._backoff = self.options.backoff_initial_s
            self.attaches += 1
            if self.attaches > 1:
                log.info("flexkvd session '%s' attached again (attach %d)", self.name, self.attaches)
            return client

    def lost(self, err: BaseException) -> None:
        """Drops the session after `err` said it is gone; the next attempt waits for the backoff."""
        with self._lock:
            client, self._client = self._client, None
            if client is not None:
                client.close()
            self._fail_locked(err)

    def _fail_locked(self, err: BaseException) -> None:
        self.failures += 1
        self.last_error = str(err)
        if self.failures == 1 or self._backoff >= self.options.backoff_max_s:
            log.warning("flexkvd session '%s' unavailable (%s); retrying in %.1f s", self.name, err, self._backoff)
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, self.options.backoff_max_s)

    def stalled(self, err: BaseException) -> None:
        """A request did not end in time (a stopped or overloaded daemon): the session is kept, but client() answers
        None for the backoff's length, so that the next requests do not wait in turn (each would cost the timeout on
        the engine's step); a later stall doubles the pause."""
        with self._lock:
            self.failures += 1
            self.last_error = str(err)
            log.warning("flexkvd session '%s' did not answer in time (%s); not asked for %.1f s", self.name, err,
                        self._backoff)
            self._stalled_until = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, self.options.backoff_max_s)

    def retry_now(self) -> None:
        """Forgets the backoff and any stall: the next client() call tries at once (tests, operators)."""
        with self._lock:
            self._retry_at = 0.0
            self._stalled_until = 0.0

    @property
    def attached(self) -> bool:
        return self._client is not None

    def current(self) -> Optional[flexkvd.Client]:
        """The attached client even while stalled (to release what an earlier request holds); no attempt."""
        return self._client

    def close(self) -> None:
        """Ends the session (idempotent); client() returns None afterwards."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> "DaemonLink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
