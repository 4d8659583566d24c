"""Handle: owns a client's flexkv_client* and frees it (flexkv_close) once closed and no call uses it any more."""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, Sequence

from . import _lib
from .errors import FailedPrecondition


class Handle:
    """Owns the flexkv_client*. Each call holds it (acquire/release) while it uses the pointer; close() marks it
    closed (later acquires raise FailedPrecondition) and the pointer is freed (flexkv_close) once no call holds it
    and, when close() was given `keep_until`, those objects are gone."""

    __slots__ = ("ptr", "_lock", "_users", "_closed", "_kept", "__weakref__")

    def __init__(self, ptr: int) -> None:
        self.ptr: Optional[int] = ptr
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False
        self._kept = 0  # objects of close(keep_until=...) still alive

    def acquire(self) -> int:
        with self._lock:
            if self._closed:
                raise FailedPrecondition("this flexkvd.Client is closed")
            self._users += 1
            return self.ptr  # type: ignore[return-value]

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            ptr = self._take_if_unused()
        if ptr is not None:
            _close_pointer(ptr)

    def close(self, keep_until: Sequence[Any] = ()) -> Optional[int]:
        """Marks the handle closed and returns the pointer for a last call (None when already closed); the pointer is
        freed once no call holds it and every object of `keep_until` is gone."""
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            for obj in keep_until:
                self._kept += 1
                fin = weakref.finalize(obj, self._let_go)
                fin.atexit = False  # at exit the process's end closes the session anyway
            self._users += 1  # the caller's last call; it releases
            return self.ptr

    def _let_go(self) -> None:
        with self._lock:
            self._kept -= 1
            ptr = self._take_if_unused()
        if ptr is not None:
            _close_pointer(ptr)

    def _take_if_unused(self) -> Optional[int]:
        if self._closed and not self._users and not self._kept and self.ptr is not None:
            ptr, self.ptr = self.ptr, None
            return ptr
        return None


def _close_pointer(ptr: int) -> None:
    _lib.lib.flexkv_close(ptr)
