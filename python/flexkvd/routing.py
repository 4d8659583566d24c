"""Prefix-aware routing: which node holds which block keys in which tier, and where a prompt is cached longest.

The Python twin of flexkv/routing.h (docs/routing.md). A router keeps one RoutingIndex for its cluster, feeds it
each node's KV events (stored / removed per tier, a clear when a node restarts or its stream is rebuilt from a
snapshot: docs/kv_events.md), and for a request computes the prompt's block keys with flexkvd's key function
(flexkvd.block_keys: the same namespace and block size the engines use) and asks prefix_lengths(); route() does
both and picks a node with choose_prefix_aware().

    index = RoutingIndex()
    a, b = index.add_node("node-a"), index.add_node("node-b")
    index.stored(a, Tier.DRAM, keys_of_what_a_stored)
    router = PrefixRouter(index, namespace="llama3-8b|bf16|tp1", tokens_per_block=16)
    node, prefixes = router.route(prompt_token_ids, loads=[queued_on_a, queued_on_b])

Needs no daemon. Thread safety: a RoutingIndex may be used from several threads (one lock inside).
"""
from __future__ import annotations

import enum
import math
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unavailable, Unimplemented
from .keys import BlockKey, BlockKeys, block_keys, namespace_hash

__all__ = ["Tier", "NodePrefix", "RoutingIndex", "choose_prefix_aware", "PrefixRouter", "KvEventFeed",
           "ClusterMembershipFeed"]

MAX_NODES = 64


class Tier(enum.IntEnum):
    """A tier a node's daemon reports blocks in (flexkv::CacheTier)."""

    DRAM = 0
    SSD = 1


@dataclass(frozen=True)
class NodePrefix:
    """How much of a prompt one node holds: leading blocks in any tier, and in DRAM alone; and whether the node is
    live (RoutingIndex.is_live): choose_prefix_aware never chooses one that is not."""

    node: int
    blocks: int
    dram_blocks: int
    live: bool = True


KeyLike = Union[BlockKey, Tuple[int, int]]


class RoutingIndex:
    """Key -> (bit mask of nodes holding it in DRAM, the same on SSD). Updates are idempotent: storing a key twice
    holds it once, removing a key not held changes nothing, so a snapshot replayed over a partial view is harmless.

    Each node is also live or not: a request sent to a dead node fails (it does not cost a miss), so routers must
    not choose one. A node is live until set_live(node, False); with a ttl (set_live(node, True, ttl_s)) only until
    the ttl runs out unless renewed (KvEventFeed renews it with every batch of the node's event stream, and sets it
    False when the stream ends); and, once set_members() named the cluster's members, only while it is one of them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: List[str] = []
        self._keys: Dict[Tuple[int, int], List[int]] = {}
        self._counts: List[List[int]] = []
        self._live_until: List[float] = []  # time.monotonic() until which the node counts as live
        self._members: Optional[frozenset] = None  # the cluster's members by name; None: not known

    # ---- nodes ----

    def add_node(self, name: str) -> int:
        """Adds a node; returns its number (0, 1, ... in order). AlreadyExists for a name given before,
        ResourceExhausted past 64 nodes, InvalidArgument for an empty name."""
        if not name:
            raise InvalidArgument("routing index: a node needs a non-empty name")
        with self._lock:
            if name in self._names:
                raise AlreadyExists(f"routing index: node {name!r} was added already")
            if len(self._names) >= MAX_NODES:
                raise ResourceExhausted(f"routing index: {MAX_NODES} nodes at most; cannot add {name!r}")
            self._names.append(name)
            self._counts.append([0, 0])
            self._live_until.append(math.inf)
            return len(self._names) - 1

    def find_node(self, name: str) -> int:
        with self._lock:
            try:
                return self._names.index(name)
            except ValueError:
                raise NotFound(f"routing index: no node {name!r}") from None

    def node_name(self, node: int) -> str:
        with self._lock:
            return self._names[node] if 0 <= node < len(self._names) else ""

    @property
    def node_count(self) -> int:
        with self._lock:
            return len(self._names)

    # ---- liveness ----

    def set_live(self, node: int, live: bool, ttl_s: Optional[float] = None) -> None:
        """Marks the node live (for ttl_s seconds from now, or until told otherwise when None) or dead. Its keys
        stay: a node that comes back with the same cache is routed to at once. InvalidArgument for a node never
        added."""
        with self._lock:
            self._bit(node)
            if not live:
                self._live_until[node] = -math.inf
            else:
                self._live_until[node] = math.inf if ttl_s is None else time.monotonic() + max(ttl_s, 0.0)

    def set_members(self, names: Optional[Iterable[str]]) -> None:
        """The cluster's current members by node name (a daemon's status().cluster.members): a node of this index
        that is not among them is not live (its lease ended: it died or was cut off). None: membership is not
        known, every node counts."""
        with self._lock:
            self._members = None if names is None else frozenset(names)

    def is_live(self, node: int) -> bool:
        with self._lock:
            return self._live_locked(node, time.monotonic())

    def live_nodes(self) -> List[int]:
        with self._lock:
            now = time.monotonic()
            return [n for n in range(len(self._names)) if self._live_locked(n, now)]

    def _live_locked(self, node: int, now: float) -> bool:
        if not 0 <= node < len(self._names):
            return False
        if self._members is not None and self._names[node] not in self._members:
            return False
        return now < self._live_until[node]

    # ---- updates ----

    def stored(self, node: int, tier: Tier, keys: Iterable[KeyLike]) -> None:
        """The node now holds `keys` in `tier`."""
        t = int(Tier(tier))
        with self._lock:
            bit = self._bit(node)
            added = 0
            for key in keys:
                masks = self._keys.setdefault((key[0], key[1]), [0, 0])
                if not masks[t] & bit:
                    masks[t] |= bit
                    added += 1
            self._counts[node][t] += added

    def removed(self, node: int, tier: Tier, keys: Iterable[KeyLike]) -> None:
        """The node no longer holds `keys` in `tier` (evicted, dropped, or moved: the new tier reports stored)."""
        t = int(Tier(tier))
        with self._lock:
            bit = self._bit(node)
            removed = 0
            for key in keys:
                k = (key[0], key[1])
                masks = self._keys.get(k)
                if masks is None or not masks[t] & bit:
                    continue
                masks[t] &= ~bit
                removed += 1
                if not masks[0] and not masks[1]:
                    del self._keys[k]
            self._counts[node][t] -= removed

    def clear_node(self, node: int) -> None:
        """The node holds nothing (restarted empty, cleared, or about to be rebuilt from a snapshot)."""
        with self._lock:
            self._drop_node_locked(self._bit(node))
            self._counts[node] = [0, 0]

    def _drop_node_locked(self, bit: int) -> None:
        """Takes the node of `bit` out of every key's masks and drops keys no node holds. Caller holds the lock."""
        keep = ~bit
        for k in list(self._keys):
            masks = self._keys[k]
            masks[0] &= keep
            masks[1] &= keep
            if not masks[0] and not masks[1]:
                del self._keys[k]

    def replace_node(self, node: int, dram: Iterable[KeyLike], ssd: Iterable[KeyLike] = ()) -> None:
        """The node now holds exactly `dram` in DRAM and `ssd` on SSD, nothing else (a stream's snapshot), in one
        update under the lock: a concurrent prefix_lengths() sees the node's old view or its new one, never a part
        of each. InvalidArgument for a node never added (nothing changes)."""
        dram_keys = [(k[0], k[1]) for k in dram]
        ssd_keys = [(k[0], k[1]) for k in ssd]
        with self._lock:
            bit = self._bit(node)
            self._drop_node_locked(bit)
            counts = [0, 0]
            for t, keys in ((0, dram_keys), (1, ssd_keys)):
                for k in keys:
                    masks = self._keys.setdefault(k, [0, 0])
                    if not masks[t] & bit:
                        masks[t] |= bit
                        counts[t] += 1
            self._counts[node] = counts

    # ---- lookups ----

    def prefix_lengths(self, keys: Sequence[KeyLike]) -> List[NodePrefix]:
        """For every node, in node order: the leading blocks of `keys` it holds (any tier, and DRAM alone), and
        whether it is live."""
        with self._lock:
            now = time.monotonic()
            n = len(self._names)
            blocks = [0] * n
            dram_blocks = [0] * n
            alive = dram = (1 << n) - 1
            i = 0
            for i, key in enumerate(keys):
                if not alive:
                    break
                masks = self._keys.get((key[0], key[1]))
                here = (masks[0] | masks[1]) if masks else 0
                here_dram = masks[0] if masks else 0
                for node in _bits(alive & ~here):
                    blocks[node] = i
                for node in _bits(dram & ~here_dram):
                    dram_blocks[node] = i
                alive &= here
                dram &= here_dram
            else:
                whole = len(keys)
                for node in _bits(alive):
                    blocks[node] = whole
                for node in _bits(dram):
                    dram_blocks[node] = whole
            return [NodePrefix(node, blocks[node], dram_blocks[node], self._live_locked(node, now))
                    for node in range(n)]

    def key_count(self, node: int, tier: Tier) -> int:
        with self._lock:
            return self._counts[node][int(Tier(tier))] if 0 <= node < len(self._counts) else 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def _bit(self, node: int) -> int:
        if not 0 <= node < len(self._names):
            raise InvalidArgument(f"routing index: node {node} was never added; expected 0..{len(self._names) - 1} "
                                  "(add_node)")
        return 1 << node


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def choose_prefix_aware(prefixes: Sequence[NodePrefix], loads: Sequence[float], max_load_ratio: float = 2.0) -> int:
    """The node with the longest cached prefix among the live ones not overloaded (load above max_load_ratio x
    (least live load + 1)); ties to the least loaded, then the lowest number (flexkv::ChoosePrefixAware). A node
    that is not live (NodePrefix.live) is never chosen: a request sent there fails. `loads`: one value per node, any
    measure of outstanding work the router keeps. InvalidArgument when the sizes differ or are 0, Unavailable when
    no node is live."""
    if not prefixes or len(prefixes) != len(loads):
        raise InvalidArgument(f"choose_prefix_aware: {len(prefixes)} prefixes and {len(loads)} loads; expected one of "
                              "each per node, at least one")
    live = [i for i, p in enumerate(prefixes) if p.live]
    if not live:
        raise Unavailable(f"choose_prefix_aware: none of the {len(prefixes)} nodes is live (their event streams ended "
                          "or went quiet, or they left the cluster); expected at least one")
    least = min(loads[i] for i in live)
    limit = max(max_load_ratio, 1.0) * (least + 1.0)
    best: Optional[int] = None
    for i in live:
        p = prefixes[i]
        if loads[i] > limit and loads[i] != least:  # the least loaded live node always qualifies
            continue
        if best is None or p.blocks > prefixes[best].blocks or (p.blocks == prefixes[best].blocks
                                                                and loads[i] < loads[best]):
            best = i
    assert best is not None  # the least loaded live node is never over the limit
    return prefixes[best].node


class PrefixRouter:
    """Routes prompts by their cached prefix: keys from token ids (the engines' namespace and block size), the
    index's prefix lengths, choose_prefix_aware."""

    def __init__(self, index: RoutingIndex, namespace: Union[str, bytes], tokens_per_block: int,
                 max_load_ratio: float = 2.0) -> None:
        self.index = index
        self.namespace = namespace
        self.tokens_per_block = tokens_per_block
        self.max_load_ratio = max_load_ratio

    def keys(self, token_ids: Sequence[int]) -> BlockKeys:
        return block_keys(self.namespace, token_ids, self.tokens_per_block)

    def route(self, token_ids: Sequence[int], loads: Sequence[float]) -> Tuple[int, List[NodePrefix]]:
        """(the chosen node, every node's prefix) for a prompt."""
        prefixes = self.index.prefix_lengths(self.keys(token_ids))
        return choose_prefix_aware(prefixes, loads, self.max_load_ratio), prefixes


def _domain_names(namespace: str) -> Tuple[str, ...]:
    """The names a daemon's events may give `namespace`'s domain: its name, and "#" + its hash while the daemon knows
    its SSD blocks only by the hash. With a libflexkv too old to hash (no flexkv_namespace_hash), the name alone, with
    a warning: such SSD blocks are then missed until the namespace is attached."""
    try:
        return (namespace, f"#{namespace_hash(namespace):016x}")
    except Unimplemented as e:
        import warnings
        warnings.warn(f"KvEventFeed: {e}; SSD blocks reported under the namespace's hash are missed", RuntimeWarning)
        return (namespace,)


class KvEventFeed:
    """Keeps one node's part of a RoutingIndex equal to what its daemon holds, from the daemon's KV event stream
    (flexkvd.subscribe_kv_events, docs/kv_events.md), in a thread of its own.

    Each subscription starts with a snapshot; once it is complete the node's view is replaced by it (replace_node: in
    one update), then every event is applied as it comes. When the stream ends (the daemon stopped or
    restarted, or this feed fell behind its event buffer) the feed subscribes again after a backoff (doubling from
    backoff_initial_s to backoff_max_s) and starts over from a new snapshot; while the daemon is away the node keeps
    its last view (a router then sends requests there at worst for nothing: a miss, never a wrong byte). namespace:
    only events of that cache domain count (None: all), also those of its SSD blocks the daemon names by the
    namespace's hash before the namespace is attached after a restart. A `cleared` event (an admin dropped a domain)
    makes the feed subscribe again at once: the new snapshot replaces the node's view. Thread safety: the index is
    thread-safe; the properties may be read from any thread. close() ends the thread.

    Liveness: the feed also keeps the node's liveness in the index (RoutingIndex.set_live), which choose_prefix_aware
    obeys: not live until the first batch of the stream arrives, live for stale_after_s after each batch (an idle
    stream sends one every second), not live at once when the stream ends (the daemon was killed, stopped or
    restarted: a request sent there would fail). A daemon that hangs (its stream goes quiet) is not live
    stale_after_s later.
    """

    def __init__(self, index: RoutingIndex, node: int, socket: Optional[str], namespace: Optional[str] = None,
                 backoff_initial_s: float = 0.2, backoff_max_s: float = 5.0, stale_after_s: float = 3.0) -> None:
        self.index = index
        self.node = node
        self.stale_after_s = stale_after_s
        index.set_live(node, False)  # until its daemon is heard from
        self.socket = socket
        self.namespace = namespace
        self._names = () if namespace is None else _domain_names(namespace)
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.instance_id = 0       # of the daemon whose snapshot was applied last
        self.position = 0          # every event up to this seq of that instance is applied
        self.snapshots = 0         # snapshots applied (1 + resubscriptions)
        self.resyncs = 0           # resubscriptions because a domain was dropped (a `cleared` event)
        self.last_error = ""
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sub = None
        self._thread = threading.Thread(target=self._run, name=f"flexkv-kv-feed-{node}", daemon=True)
        self._thread.start()

    def wait_synced(self, timeout: float) -> bool:
        """True once a snapshot has been applied (the view holds what the daemon held then)."""
        return self._synced.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._sub is not None:
                self._sub.cancel()
        self._thread.join(timeout=10.0)

    def _wanted(self, event) -> bool:
        # The index places prompts by their full-attention blocks: a hybrid geometry's window and state entries
        # (component > 0) are not keys of the prefix tree.
        if getattr(event, "component", 0) != 0:
            return False
        # An SSD block whose namespace the daemon has not seen attached since it started (it restarted on an SSD
        # directory, its DRAM pool gone) is reported under the namespace's hash, "#<16 hex digits>", until a
        # session of that namespace attaches: those blocks are this namespace's as much as the ones named.
        return self.namespace is None or event.model_namespace in self._names

    def _apply(self, event) -> bool:
        """Applies one event; False when the view must be rebuilt from a new snapshot instead."""
        if not self._wanted(event):
            return True
        if event.kind == "cleared":
            # One domain's keys left DRAM (an admin dropped it) while the node's other domains and its SSD blocks
            # stay. The index keeps no domains, so it cannot tell which of the node's keys were that domain's;
            # clearing the whole node would lose the others until the next snapshot, and remembering each key's
            # domain here would keep a second copy of every key. A new subscription's snapshot is the daemon's true
            # set, and replace_node swaps it in at once: the feed resubscribes (no backoff). Until then the node
            # keeps the dropped keys: a router may send a request there for nothing (a miss, never a wrong byte).
            return False
        tier = Tier.SSD if event.tier == "ssd" else Tier.DRAM
        if event.kind == "stored":
            self.index.stored(self.node, tier, [event.key])
        elif event.kind == "removed":
            self.index.removed(self.node, tier, [event.key])
        return True

    def _run(self) -> None:
        from .kv_events import subscribe_kv_events  # the subscription needs libflexkv with flexkv_kv_*
        backoff = self.backoff_initial_s
        while not self._stop.is_set():
            resync = False
            try:
                sub = subscribe_kv_events(self.socket)
                with self._lock:
                    if self._stop.is_set():
                        sub.close()
                        return
                    self._sub = sub
                snapshot: Dict[int, List[Tuple[int, int]]] = {0: [], 1: []}
                in_snapshot = True
                for batch in sub:
                    self.index.set_live(self.node, True, self.stale_after_s)  # heard from: live a while longer
                    if in_snapshot and batch.snapshot:
                        for e in batch.events:
                            if self._wanted(e) and e.kind == "stored":
                                snapshot[1 if e.tier == "ssd" else 0].append(e.key)
                        if not batch.snapshot_end:
                            continue
                        # One update: a router reading meanwhile sees the old view or the new, never half of it.
                        self.index.replace_node(self.node, snapshot[0], snapshot[1])
                        snapshot = {0: [], 1: []}
                        in_snapshot = False
                        self.instance_id = batch.instance_id
                        self.position = batch.snapshot_seq
                        self.snapshots += 1
                        self._synced.set()
                        backoff = self.backoff_initial_s
                        continue
                    in_snapshot = False
                    if not all(self._apply(e) for e in batch.events):
                        resync = True  # the events after the clear are in the new snapshot
                        self.resyncs += 1
                        break
                    if batch.position:
                        self.position = batch.position
            except Exception as err:  # the stream's end (ResourceExhausted, Unavailable, Cancelled) or no daemon
                self.last_error = f"{type(err).__name__}: {err}"
                if not self._stop.is_set():
                    # A request sent now would fail (the daemon is gone or restarting) or find nothing it was told
                    # of (it fell behind): not live until the next subscription is heard from.
                    self.index.set_live(self.node, False)
            finally:
                with self._lock:
                    sub, self._sub = self._sub, None
                if sub is not None:
                    sub.close()
            if resync:
                continue
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self.backoff_max_s)


class ClusterMembershipFeed:
    """Keeps a RoutingIndex's view of the cluster's membership (RoutingIndex.set_members) from the daemons' status,
    in a thread of its own: every interval_s it asks the daemons at `sockets` in turn for their status, and the first
    that is joined to the cluster names the members (each member's lease is alive in etcd; a node whose lease ended,
    killed or cut off from the cluster, is not among them). The index's node names must be the daemons' --node-id.
    When no daemon answers joined (etcd itself is away), membership is not known and no node is excluded for it.
    Complements KvEventFeed, which sees a node's own daemon only. close() ends the thread.
    """

    def __init__(self, index: RoutingIndex, sockets: Sequence[Optional[str]], interval_s: float = 1.0) -> None:
        if not sockets:
            raise InvalidArgument("ClusterMembershipFeed: no daemon sockets; expected at least one")
        self.index = index
        self.sockets = list(sockets)
        self.interval_s = interval_s
        self.last_error = ""
        self.members: Optional[Tuple[str, ...]] = None  # as last set
        self._stop = threading.Event()
        self._updated = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flexkv-cluster-members", daemon=True)
        self._thread.start()

    def wait_updated(self, timeout: float) -> bool:
        """True once a round has set the membership (known or not)."""
        return self._updated.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _poll(self) -> Optional[Tuple[str, ...]]:
        from .client import connect
        for socket in self.sockets:
            try:
                with connect(socket, timeout=0.5) as client:
                    status = client.status()
            except Exception as err:  # that daemon is away: ask the next
                self.last_error = f"{type(err).__name__}: {err}"
                continue
            if status.cluster is not None and status.cluster.state == "joined":
                return tuple(m.node_id for m in status.cluster.members)
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.members = self._poll()
            self.index.set_members(self.members)
            self._updated.set()
            if self._stop.wait(self.interval_s):
                return
