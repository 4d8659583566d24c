"""KvEventRelay: the daemon's KV events of one namespace, for vLLM's take_events (docs/integrations.md, "KV events").

vLLM's scheduler publishes what its connector's take_events() returns beside its own KV cache events (BlockStored /
BlockRemoved with a medium). flexkvd's blocks are the node's, not one engine's: every engine of the namespace can load
any of them, so an engine relays the daemon's view of its namespace - every block stored in or removed from DRAM
("CPU") or SSD ("SSD") - as events of its own. A background thread reads the daemon's KV event stream
(flexkvd.subscribe_kv_events), keeps this namespace's events and hands them over on take().
"""
from __future__ import annotations

import logging
import threading
from typing import List, NamedTuple, Optional, Tuple

import flexkvd
from flexkvd import _lib
from flexkvd.geometry import ComponentKind
from flexkvd.keys import BlockKey, namespace_hash

from ._vllm_groups import GroupMap

log = logging.getLogger("flexkvd.integrations.vllm")

MEDIUM = {"dram": "CPU", "ssd": "SSD"}


class RelayEvent(NamedTuple):
    """One vLLM KV cache event. kind: "stored" | "removed"; hashes: the block keys as 16 bytes each (lo then hi,
    little-endian: the daemon's ZMQ mapping); parent: the first block's parent key (stored, component 0; None for a
    prompt's first block and for window and state entries); group: vLLM's KV cache group index."""

    kind: str
    hashes: Tuple[bytes, ...]
    parent: Optional[bytes]
    medium: str
    group: int
    spec_kind: Optional[str]
    sliding_window: Optional[int]
    block_size: int


def key_bytes(key: BlockKey) -> bytes:
    return key.lo.to_bytes(8, "little") + key.hi.to_bytes(8, "little")


class KvEventRelay:
    """Relays the daemon's KV events of `namespace` (a snapshot of its blocks first, then every change).

    Bounded: at most max_events wait for take(); past that they are dropped (counted in `dropped`) and the relay
    subscribes again, whose snapshot announces every block held again. A daemon that is away is subscribed to again
    every retry_s. Not relayed: a dropped domain's blocks (the daemon drops only domains no engine is attached to)
    and blocks removed while the daemon was down (a restarted daemon's snapshot re-announces what it kept).
    Thread safety: take() and close() may be called from any thread.
    """

    def __init__(self, socket: Optional[str], namespace: str, groups: GroupMap, max_events: int = 1 << 17,
                 retry_s: float = 1.0) -> None:
        if not _lib.has_kv_events:
            raise flexkvd.Unimplemented("kv_connector_extra_config.kv_events needs a libflexkv with KV event "
                                        "subscriptions (flexkv_kv_subscribe); update libflexkv or leave kv_events off")
        self.namespace = namespace
        self._names = {namespace, f"#{namespace_hash(namespace):016x}"}  # an SSD block of a namespace not seen yet
        self._socket = socket
        self._groups = groups
        g = groups.geometry
        self._kinds = {}
        for slot in groups.slots:
            if slot.kind == ComponentKind.FULL:
                self._kinds[slot.component] = (slot.group, "mla_attention" if g.is_mla else "full_attention", None)
            elif slot.kind == ComponentKind.SLIDING_WINDOW:
                self._kinds[slot.component] = (slot.group, "sliding_window",
                                               g.components[slot.component - 1].window_tokens)
            else:
                self._kinds[slot.component] = (slot.group, "mamba", None)
        self._max = max_events
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._events: List[RelayEvent] = []
        self._queued = 0
        self.dropped = 0
        self.batches = 0
        self._sub: Optional[flexkvd.KvEventSubscription] = None
        self._stop = threading.Event()
        self._taken = threading.Event()  # set by take(): the engine reads events again
        self._thread = threading.Thread(target=self._run, name="flexkvd-kv-events", daemon=True)
        self._thread.start()

    def take(self) -> List[RelayEvent]:
        """The events since the last call, in the daemon's order."""
        with self._lock:
            events, self._events, self._queued = self._events, [], 0
        self._taken.set()
        return events

    def close(self) -> None:
        """Ends the subscription and the thread (idempotent)."""
        self._stop.set()
        with self._lock:
            sub = self._sub
        if sub is not None:
            sub.cancel()
        self._thread.join(timeout=10)

    # ---- the thread ----

    def _run(self) -> None:
        # After an overflow the relay subscribes again only once the engine took events since, and never sooner than
        # a pause that doubles with each overflow in a row (up to a minute): a snapshot larger than max_events, or an
        # engine that does not call take_events, must not make it fetch snapshot after snapshot.
        overflow_pause = 0.0
        while not self._stop.is_set():
            if overflow_pause > 0:
                self._taken.clear()
                self._stop.wait(overflow_pause)
                while not self._stop.is_set() and not self._taken.wait(0.5):
                    pass
            try:
                sub = flexkvd.subscribe_kv_events(self._socket)
            except flexkvd.Error as err:
                log.debug("flexkvd KV events: subscribe failed (%s); again in %.1f s", err, self._retry_s)
                self._stop.wait(self._retry_s)
                continue
            with self._lock:
                self._sub = sub
            try:
                if self._stop.is_set():
                    return
                for batch in sub:
                    self.batches += 1
                    if not self._add(batch.events):
                        # fell behind take(): subscribe again (later), for a fresh snapshot
                        overflow_pause = min(60.0, max(self._retry_s, 2 * overflow_pause))
                        break
                    if batch.snapshot_end or not batch.snapshot:
                        overflow_pause = 0.0  # a snapshot that fitted: the relay keeps up again
            except flexkvd.Error as err:
                if not self._stop.is_set():
                    log.info("flexkvd KV event stream ended (%s); subscribing again", err)
                    self._stop.wait(self._retry_s if isinstance(err, flexkvd.Unavailable) else 0)
            finally:
                with self._lock:
                    self._sub = None
                sub.close()

    def _add(self, events: List[flexkvd.KvEvent]) -> bool:
        out: List[RelayEvent] = []
        prev_key: Optional[BlockKey] = None
        for e in events:
            if e.model_namespace not in self._names or e.kind not in ("stored", "removed"):
                continue
            group, spec_kind, window = self._kinds.get(e.component, (e.component, None, None))
            medium = MEDIUM.get(e.tier, e.tier.upper())
            last = out[-1] if out else None
            stored = e.kind == "stored"
            parent = None
            if stored and e.component == 0 and (e.parent.lo or e.parent.hi):
                parent = key_bytes(e.parent)
            if last is not None and last.kind == e.kind and last.medium == medium and last.group == group and \
                    (not stored or e.component != 0 or (prev_key is not None and e.parent == prev_key)):
                out[-1] = last._replace(hashes=last.hashes + (key_bytes(e.key),))  # one run: one event
            else:
                out.append(RelayEvent(e.kind, (key_bytes(e.key),), parent, medium, group,
                                      spec_kind if stored else None, window if stored else None,
                                      self._groups.geometry.tokens_per_block))
            prev_key = e.key
        if not out:
            return True
        with self._lock:
            if self._queued + len(out) > self._max:
                self.dropped += self._queued + len(out)
                self._events, self._queued = [], 0
                log.warning("flexkvd KV events: %d waited for take_events (limit %d); dropped, subscribing again "
                            "for a fresh snapshot", self.dropped, self._max)
                return False
            self._events.extend(out)
            self._queued += len(out)
        return True
