"""The daemon's KV event stream (docs/kv_events.md): a snapshot of every block per tier, then every block stored in or
removed from a tier (DRAM, SSD), numbered per daemon instance. Over libflexkv's C ABI (flexkv_kv_*).

    with flexkvd.subscribe_kv_events(socket) as sub:
        for batch in sub:               # blocks for each batch; ends by raising the stream's end
            if batch.instance_id != last:  # the daemon restarted: rebuild the view from the snapshot
                ...
            for e in batch.events:
                print(e.kind, e.tier, e.key.hex(), e.parent.hex())

The stream ends with ResourceExhausted (fell behind the daemon's event buffer: subscribe again, the new stream starts
with a snapshot), Unavailable (the daemon stopped) or Cancelled (cancel()).
"""
from __future__ import annotations

import ctypes
from typing import Iterator, List, NamedTuple, Optional

from . import _lib
from .errors import Unimplemented
from .keys import BlockKey

KINDS = ("stored", "removed", "cleared")
TIERS = ("dram", "ssd")


class KvEvent(NamedTuple):
    seq: int               # 0 in a snapshot
    kind: str              # "stored" | "removed" | "cleared"
    tier: str              # "dram" | "ssd"
    key: BlockKey
    parent: BlockKey       # stored: the parent (zero: a prompt's first block)
    model_namespace: str
    tokens_per_block: int
    cause: str
    component: int = 0     # hybrid geometries: the entry's component (0: full attention; vLLM's group_idx)


class KvEventBatch(NamedTuple):
    instance_id: int
    started_unix_ms: int
    snapshot: bool
    snapshot_end: bool
    snapshot_seq: int
    head_seq: int
    position: int          # every event up to this seq delivered (0 on a part that is not a batch's last)
    events: List[KvEvent]


class KvEventSubscription:
    """One subscription (a connection of its own). next_batch() blocks; cancel() may be called from another thread."""

    _CAPACITY = 4096

    def __init__(self, socket: Optional[str] = None, max_batch_events: int = 0, skip_snapshot: bool = False,
                 timeout: float = 5.0) -> None:
        if not _lib.has_kv_events:
            raise Unimplemented("this libflexkv has no KV event subscription (flexkv_kv_subscribe); update it")
        handle = _lib.kv_subscription_p()
        path = socket.encode() if socket else None
        _lib.check(_lib.lib.flexkv_kv_subscribe(path, int(timeout * 1000), max_batch_events,
                                                1 if skip_snapshot else 0, ctypes.byref(handle)), "subscribe")
        self._handle = handle
        self._events = (_lib.KvEventStruct * self._CAPACITY)()

    def next_batch(self) -> KvEventBatch:
        if not self._handle:
            raise ValueError("the subscription is closed")
        batch = _lib.KvBatchStruct()
        rc = _lib.lib.flexkv_kv_next(self._handle, ctypes.byref(batch), self._events, self._CAPACITY)
        if rc != 0:
            raise _lib.error_from_last(rc, "kv events")
        events = []
        for i in range(batch.n_events):
            e = self._events[i]
            events.append(KvEvent(e.seq, KINDS[e.kind] if e.kind < len(KINDS) else str(e.kind),
                                  TIERS[e.tier] if e.tier < len(TIERS) else str(e.tier),
                                  BlockKey(e.key.lo, e.key.hi), BlockKey(e.parent.lo, e.parent.hi),
                                  e.model_namespace.decode("utf-8", "replace"), e.tokens_per_block,
                                  e.cause.decode(), e.component))
        return KvEventBatch(batch.instance_id, batch.started_unix_ms, bool(batch.snapshot), bool(batch.snapshot_end),
                            batch.snapshot_seq, batch.head_seq, batch.position, events)

    def __iter__(self) -> Iterator[KvEventBatch]:
        while True:
            yield self.next_batch()

    def cancel(self) -> None:
        if self._handle:
            _lib.lib.flexkv_kv_cancel(self._handle)

    def close(self) -> None:
        if self._handle:
            _lib.lib.flexkv_kv_close(self._handle)
            self._handle = None

    def __enter__(self) -> "KvEventSubscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def subscribe_kv_events(socket: Optional[str] = None, max_batch_events: int = 0, skip_snapshot: bool = False,
                        timeout: float = 5.0) -> KvEventSubscription:
    """Subscribes to the daemon's KV events (socket None: $FLEXKV_SOCKET or the default)."""
    return KvEventSubscription(socket, max_batch_events, skip_snapshot, timeout)
