"""The vLLM connector's logic without vLLM: its configuration, the metadata the scheduler side hands the workers, its
counters, and the scheduler side (SchedulerLogic). The worker side is WorkerLogic (_vllm_worker.py); the thin vLLM
adapter (vllm.py) only turns vLLM's objects into the plain arguments these take. docs/integrations.md, "vLLM".

The protocol with vLLM V1 (vllm/v1/core/sched/scheduler.py; vllm/distributed/kv_transfer/kv_connector/v1/base.py):
  get_num_new_matched_tokens  (scheduler, new or preempted request, num_computed_tokens = its block-aligned local hit)
      an unpinned match of the prompt's full blocks; answers (hit tokens beyond the local hit, True): an async load.
  update_state_after_alloc    (scheduler) the block ids vLLM allocated (per KV cache group): the load [local blocks,
      local + hit) is planned, from the end of the engine's own prefix (first_block).
  build_connector_meta        (scheduler, once per step) the planned loads and stores go to the workers.
  start_load_kv / get_finished (worker TP rank 0, which holds the data session with every rank's KV registered)
      pins and loads; reports finished_recving when a load ended and its failed block ids
      (get_block_ids_with_load_errors: vLLM recomputes them); stores; reports finished_sending when a store ended.
  request_finished            (scheduler; request_finished_all_groups under vLLM's hybrid allocator, with every KV
      cache group's blocks) plans the store of the blocks whose KV was computed; True (vLLM keeps the blocks) until
      the store ended.
  update_connector_output     (scheduler) learns which loads and stores ended.
Only TP rank 0 reports (get_finished_count() == 1): vLLM's KVOutputAggregator counts a request finished once it
was reported get_finished_count() times (or world_size times without it).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import flexkvd
from flexkvd import _lib

from ._vllm_groups import GroupMap
from ._vllm_link import DaemonLink, LinkOptions, session_lost

log = logging.getLogger("flexkvd.integrations.vllm")

_KEY_BYTES = 16


def keys_to_bytes(keys: flexkvd.BlockKeys) -> bytes:
    """A prompt's block keys as 16 bytes each (lo, hi little-endian): what the metadata carries to the workers."""
    return bytes(keys._array)  # noqa: SLF001 - the C array of {lo, hi} pairs, as libflexkv reads it


def keys_from_bytes(data: bytes) -> flexkvd.BlockKeys:
    """keys_to_bytes's inverse: keys that start a prompt (parent None)."""
    if len(data) % _KEY_BYTES:
        raise flexkvd.InvalidArgument(f"{len(data)} bytes of block keys; expected a multiple of {_KEY_BYTES}")
    n = len(data) // _KEY_BYTES
    return flexkvd.BlockKeys._wrap((_lib.BlockKeyStruct * n).from_buffer_copy(data))  # noqa: SLF001


def vllm_namespace(model: str, kv_dtype: str, tp_size: int, *, revision: Optional[str] = None,
                   extra: str = "") -> str:
    """The cache namespace of a vLLM engine: everything that changes the KV bytes of a token prefix. Two engines
    share blocks only when all of these agree: the model (and its revision), the KV cache dtype, the TP size (it
    changes the layout of a host block; the geometry check refuses a mismatch anyway) and `extra` (anything else the
    deployment knows changes KV: a fine-tune's name, a RoPE scaling override). What changes one request's KV (cache
    salt, LoRA adapter, media, prompt embeddings) is in its keys instead (flexkvd.BlockExtras)."""
    parts = ["vllm", model, revision or "main", kv_dtype, f"tp{tp_size}"]
    if extra:
        parts.append(extra)
    ns = "|".join(parts)
    if len(ns.encode()) > 256:
        raise flexkvd.InvalidArgument(f"namespace {ns[:64]!r}... is {len(ns.encode())} bytes; expected at most 256: "
                                     "set kv_connector_extra_config.namespace")
    return ns


@dataclasses.dataclass
class ConnectorConfig:
    """What both sides need; from kv_connector_extra_config (from_extra_config) plus the engine's shape.

    namespace: the cache domain (vllm_namespace()); geometry: the KV shape (tokens_per_block == vLLM's block_size).
    link: socket and reconnect backoff. op_timeout_s: how long the scheduler waits for a match and a worker for a pin
    before it treats the request as a miss (the request is never held up longer). name: the sessions' name prefix.
    groups: how vLLM's KV cache groups map to the geometry's components (_vllm_groups.map_kv_cache_groups); None:
    group i is component i. kv_events: hand the daemon's KV events of this namespace to vLLM (take_events).
    """

    namespace: str
    geometry: flexkvd.Geometry
    link: LinkOptions = dataclasses.field(default_factory=LinkOptions)
    op_timeout_s: float = 0.5
    name: str = "vllm"
    dp_rank: int = 0
    # "layerwise": a hit loads in the step that computes the rest of the prompt, each layer awaited just before it
    # is computed (vLLM: a synchronous load); "whole": the request waits for its whole load between steps (an
    # asynchronous load). Layer-wise needs one TP rank's layer events: see layerwise.
    load_mode: str = "whole"
    groups: Optional[GroupMap] = None
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.groups is None:
            self.groups = GroupMap.single(self.geometry)

    @property
    def block_size(self) -> int:
        return self.geometry.tokens_per_block

    @property
    def layerwise(self) -> bool:
        """Whether loads run layer by layer: load_mode "layerwise" and TP 1 (the layer events of a set the Python
        client registers are one rank's). A hybrid model's layers go in geometry.layer_order(), every KV cache
        group's together; that needs a libflexkv with hybrid layer-wise loads (else its loads are whole)."""
        return self.load_mode == "layerwise" and self.geometry.tp_size == 1 and \
            (not self.geometry.is_hybrid or flexkvd._lib.has_hybrid_layerwise)  # noqa: SLF001

    EXTRA_KEYS = ("socket", "namespace", "namespace_extra", "op_timeout_s", "connect_timeout_s",
                  "backoff_initial_s", "backoff_max_s", "name", "load_mode", "cross_layer_blocks", "kv_events")
    LOAD_MODES = ("layerwise", "whole")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], *, default_namespace: str, geometry: flexkvd.Geometry,
                          dp_rank: int = 0, default_load_mode: str = "whole",
                          groups: Optional[GroupMap] = None) -> "ConnectorConfig":
        """Reads kv_connector_extra_config: socket, namespace (default: default_namespace), op_timeout_s,
        connect_timeout_s, backoff_initial_s, backoff_max_s, name, kv_events (a bool). InvalidArgument names an
        unknown key or a value of the wrong type."""
        unknown = sorted(set(extra) - set(cls.EXTRA_KEYS))
        if unknown:
            raise flexkvd.InvalidArgument(f"kv_connector_extra_config has unknown keys {unknown}; expected some of "
                                         f"{list(cls.EXTRA_KEYS)}")

        def number(key: str, default: float) -> float:
            value = extra.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise flexkvd.InvalidArgument(f"kv_connector_extra_config.{key} is {value!r}; expected seconds >= 0")
            return float(value)

        def text(key: str, default: Optional[str]) -> Optional[str]:
            value = extra.get(key, default)
            if value is not None and not isinstance(value, str):
                raise flexkvd.InvalidArgument(f"kv_connector_extra_config.{key} is {value!r}; expected a string")
            return value

        link = LinkOptions(socket=text("socket", None),
                           connect_timeout_s=number("connect_timeout_s", LinkOptions.connect_timeout_s),
                           backoff_initial_s=number("backoff_initial_s", LinkOptions.backoff_initial_s),
                           backoff_max_s=number("backoff_max_s", LinkOptions.backoff_max_s))
        namespace = text("namespace", None) or default_namespace
        if extra.get("namespace_extra"):
            namespace = f"{namespace}|{text('namespace_extra', '')}"
        load_mode = text("load_mode", default_load_mode)
        if load_mode not in cls.LOAD_MODES:
            raise flexkvd.InvalidArgument(f"kv_connector_extra_config.load_mode is {load_mode!r}; expected one of "
                                          f"{list(cls.LOAD_MODES)}")
        if not isinstance(extra.get("cross_layer_blocks", True), bool):
            raise flexkvd.InvalidArgument(f"kv_connector_extra_config.cross_layer_blocks is "
                                          f"{extra['cross_layer_blocks']!r}; expected true or false")
        events = extra.get("kv_events", False)
        if not isinstance(events, bool):
            raise flexkvd.InvalidArgument(f"kv_connector_extra_config.kv_events is {events!r}; expected true or false")
        return cls(namespace=namespace, geometry=geometry, link=link, op_timeout_s=number("op_timeout_s", 0.5),
                   name=text("name", "vllm") or "vllm", dp_rank=dp_rank, load_mode=load_mode, groups=groups,
                   kv_events=events)


@dataclasses.dataclass
class LoadSpec:
    """Load the prefix end e = len(keys) of a prompt past the engine's own first `first_block` blocks (its local
    prefix hit, never rewritten) into vLLM's blocks: block_ids holds one list per KV cache group, position i of a
    group receiving that group's KV of block i (GroupMap.load_ids picks what each component needs)."""

    request_id: str
    keys: bytes  # keys_to_bytes of the prompt's first e blocks
    block_ids: List[List[int]]  # per group, positions [0, e)
    first_block: int
    layerwise: bool = False  # loaded in the step that computes the request, layer by layer (not async)

    @property
    def end(self) -> int:
        return len(self.keys) // _KEY_BYTES


@dataclasses.dataclass
class StoreSpec:
    """Store the prompt's blocks [0, len(keys)) from vLLM's blocks (flexkvd skips those already cached):
    block_ids holds one id list per flexkvd component (component 0: every block; a window: the last window_keys
    blocks, or its trailing window when window_keys is 0; a state: one id per boundary)."""

    request_id: str
    keys: bytes
    block_ids: List[List[int]]
    boundaries: List[int] = dataclasses.field(default_factory=list)
    window_keys: int = 0


@dataclasses.dataclass
class ConnectorMetadata:
    """One step's work for the workers (picklable: vLLM sends it to every worker process)."""

    loads: List[LoadSpec] = dataclasses.field(default_factory=list)
    stores: List[StoreSpec] = dataclasses.field(default_factory=list)
    preempted: Set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class ConnectorStats:
    """Counters of one side since it started (or since the last take(), for vLLM's per-interval stats)."""

    lookups: int = 0          # scheduler: get_num_new_matched_tokens that asked the daemon
    lookup_hit_tokens: int = 0
    lookup_errors: int = 0    # daemon unreachable or slow: answered as a miss
    loads: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_failed_blocks: int = 0  # reported to vLLM through get_block_ids_with_load_errors
    stores: int = 0
    stored_blocks: int = 0    # newly stored (already cached ones are skipped by the daemon)
    stored_bytes: int = 0
    store_failures: int = 0
    skipped_requests: int = 0  # not cacheable (media that cannot be keyed), or a store whose windows were gone
    session_losses: int = 0

    def take(self) -> "ConnectorStats":
        """A copy of the counters, which are reset to zero."""
        copy = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)
        return copy

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)

    def is_empty(self) -> bool:
        return not any(self.as_dict().values())

    def add(self, other: "ConnectorStats") -> "ConnectorStats":
        return ConnectorStats(**{k: v + getattr(other, k) for k, v in self.as_dict().items()})


@dataclasses.dataclass
class _RequestState:
    keys: flexkvd.BlockKeys
    keyed_tokens: int
    local_tokens: int = 0     # the local hit given to get_num_new_matched_tokens
    cached_blocks: int = 0    # blocks flexkvd had at the last lookup
    match: Any = None         # a lookup in flight (a Ticket), answered "not yet" meanwhile (may_defer)
    match_started: float = 0.0
    hit_tokens: int = 0       # promised to vLLM
    load_planned: int = -1    # the request's num_preemptions when its last load was planned (-1: none)


class SchedulerLogic:
    """The scheduler side: looks prompts up, plans loads and stores, and tracks them until the workers report.

    It attaches a session of its own (nothing registered; it only matches, unpinned) through a DaemonLink, so a
    daemon that is down costs misses: get_num_new_matched_tokens answers (0, False) and stores are not planned.
    Thread safety: none; vLLM calls the scheduler side from its one scheduler thread.
    """

    # How long a lookup may take inside one get_num_new_matched_tokens when the engine takes "not yet" (a match on
    # the ring answers in microseconds; a daemon that is slow or stopped must not hold up the scheduler's step).
    DEFER_AFTER_S = 0.002

    def __init__(self, config: ConnectorConfig, link: Optional[DaemonLink] = None, may_defer: bool = False,
                 loads: bool = True) -> None:
        """may_defer: the engine takes None from get_num_new_matched_tokens as "not yet, ask again next step"
        (vLLM's interface since it documents that): a lookup then never blocks the scheduler's thread more than
        DEFER_AFTER_S; without it a lookup waits up to op_timeout_s, as engines that need an answer require.
        loads: False answers every lookup with 0 (an engine that cannot take loads for this model; stores go on)."""
        self.config = config
        self.groups: GroupMap = config.groups
        self.loads = loads
        self.may_defer = may_defer
        self.block_size = config.block_size
        self.link = link or DaemonLink(f"{config.name}-scheduler-dp{config.dp_rank}", config.namespace,
                                       config.geometry, config.link, dp_rank=config.dp_rank)
        self.stats = ConnectorStats()
        self._requests: Dict[str, _RequestState] = {}
        # Lookups whose request went (aborted, preempted, re-keyed) or timed out while the match was in flight:
        # libflexkv keeps a result until it is taken, so each is taken here later (_drain_stray_matches).
        self._stray_matches: List[Any] = []
        self._pending_loads: Dict[str, LoadSpec] = {}
        self._pending_stores: List[StoreSpec] = []
        self._loading: Dict[str, LoadSpec] = {}  # loads sent to the workers, not reported finished yet
        # Layer-wise loads of the last few steps (they end in their step; their load errors arrive with its output,
        # which async scheduling hands over after the next step was built).
        self._recent_layerwise: collections.deque = collections.deque(maxlen=4)
        self._storing: Set[str] = set()   # stores sent (or to be sent), not reported finished yet

    # ---- vLLM's scheduler calls, in the order it makes them ----

    def get_num_new_matched_tokens(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                                   cacheable: bool = True, num_preemptions: int = 0,
                                   extras: Optional[flexkvd.BlockExtras] = None) -> Tuple[Optional[int], bool]:
        """Tokens of `token_ids` beyond num_computed_tokens (vLLM's block-aligned local hit) that flexkvd holds, and
        whether they load asynchronously (when there are any and loads are not layer-wise). Side-effect free for vLLM:
        it may ask again for the same request. (0, False) when the request is not cacheable, nothing more is cached, the
        daemon is not reachable (counted in stats.lookup_errors), or a load was planned for it already since it was last
        preempted (num_preemptions: vLLM's Request.num_preemptions). extras: what changes the request's KV besides its
        token ids (cache salt, LoRA adapter, media, prompt embeddings), part of its keys. With may_defer, (None, False)
        while the lookup is in flight: the engine asks again at its next step; one that has not answered within
        op_timeout_s of its start is a miss (counted in stats.lookup_errors)."""
        if not cacheable:
            self.stats.skipped_requests += 1
            return 0, False
        if not self.loads:
            return 0, False
        # vLLM passes a block-aligned local hit; one that is not (a finer hash block size) loads from the block
        # holding its end, rewriting that block's computed part with the same prefix's KV.
        state = self._state(request_id, token_ids, extras)
        if state.load_planned == num_preemptions:
            # vLLM asks again after a load only when it loaded nothing (num_computed_tokens back to 0): one load per
            # request until it is preempted, so that a daemon refusing loads (draining, pins capped) never keeps a
            # request waiting step after step.
            return 0, False
        if len(state.keys) * self.block_size <= num_computed_tokens:
            return 0, False
        if state.match is None:
            client = self.link.client()
            if client is None:
                self.stats.lookup_errors += 1
                return 0, False
            self.stats.lookups += 1
            try:
                state.match = client.match(state.keys)
            except flexkvd.Error as err:
                self._failed(err)
                return 0, False
            state.match_started = time.monotonic()
        left = state.match_started + self.config.op_timeout_s - time.monotonic()
        try:
            cached = state.match.wait(timeout=min(left, self.DEFER_AFTER_S) if self.may_defer else left).matched_blocks
        except flexkvd.DeadlineExceeded as err:
            if self.may_defer and left > self.DEFER_AFTER_S:
                return None, False  # not yet: asked again at the next step
            self._abandon_match(state)
            self._failed(err)
            return 0, False
        except flexkvd.Error as err:
            state.match = None
            self._failed(err)
            return 0, False
        state.match = None
        state.local_tokens = num_computed_tokens
        state.cached_blocks = cached
        state.hit_tokens = max(0, cached * self.block_size - num_computed_tokens)
        if self.config.layerwise and num_computed_tokens + state.hit_tokens >= len(token_ids):
            # A synchronous load runs in the step that computes the rest: vLLM needs a token to compute, so the
            # last one is computed again (its block is still loaded whole: update_state_after_alloc rounds up).
            state.hit_tokens = max(0, len(token_ids) - 1 - num_computed_tokens)
        self.stats.lookup_hit_tokens += state.hit_tokens
        return state.hit_tokens, state.hit_tokens > 0 and not self.config.layerwise

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence, num_external_tokens: int,
                                 num_preemptions: int = 0) -> None:
        """vLLM allocated `block_ids` (the request's blocks from its first, local hits included: one list per KV
        cache group, or one flat list for a single group) and will wait for num_external_tokens to load. 0 (no hit,
        or the second call after the load) plans nothing. The load starts where the engine's own prefix ends: block
        local // block_size (first_block), never rewriting what the engine holds."""
        if num_external_tokens <= 0:
            return
        state = self._requests.get(request_id)
        if state is None or state.hit_tokens < num_external_tokens:
            raise flexkvd.FailedPrecondition(
                f"request {request_id!r}: {num_external_tokens} external tokens allocated, but "
                f"{0 if state is None else state.hit_tokens} were promised by get_num_new_matched_tokens")
        first = state.local_tokens // self.block_size
        end = -(-(state.local_tokens + num_external_tokens) // self.block_size)  # a hit ends inside a block only
        end = min(end, len(state.keys))                                          # when its last token is recomputed
        groups = self.groups.as_groups(block_ids)
        full = groups[self.groups.full_group]
        if len(full) < end:
            raise flexkvd.InvalidArgument(f"request {request_id!r}: {len(full)} block ids of the full-attention group "
                                          f"for a load up to block {end}; expected at least {end}")
        self._pending_loads[request_id] = LoadSpec(request_id, keys_to_bytes(state.keys[:end]),
                                                   [g[:end] for g in groups], first,
                                                   layerwise=self.config.layerwise)
        state.load_planned = num_preemptions

    def build_connector_meta(self, preempted_request_ids: Iterable[str] = ()) -> ConnectorMetadata:
        """This step's loads and stores for the workers; the plan is handed over (and cleared here). A preempted
        request (vLLM freed its blocks) is forgotten: it is looked up again when it is scheduled again."""
        preempted = set(preempted_request_ids)
        for rid in preempted - set(self._pending_loads):  # (one preempted and already looked up again keeps it)
            self._abandon_match(self._requests.pop(rid, None))
        self._drain_stray_matches()
        meta = ConnectorMetadata(loads=list(self._pending_loads.values()), stores=self._pending_stores,
                                 preempted=preempted)
        # A layer-wise load ends in the step it is sent with (never reported in finished_recving).
        self._loading.update((rid, s) for rid, s in self._pending_loads.items() if not s.layerwise)
        self._recent_layerwise.append({rid: s for rid, s in self._pending_loads.items() if s.layerwise})
        self._pending_loads = {}
        self._pending_stores = []
        return meta

    def request_finished(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence,
                         num_computed_tokens: int, cacheable: bool = True,
                         extras: Optional[flexkvd.BlockExtras] = None) -> bool:
        """The request ended (finished, aborted or in error) and vLLM is about to free `block_ids` (its blocks from
        the first: one list per KV cache group, or one flat list for a single group; vLLM's
        request_finished_all_groups). num_computed_tokens: tokens whose KV is in those blocks (computed, or loaded).
        Returns True when a store of its full blocks is planned: vLLM keeps the blocks until the workers report it in
        finished_sending. False (free now) when there is nothing to store, the request is not cacheable, the daemon
        is not reachable, its load is still in flight (then vLLM itself keeps the blocks until finished_recving,
        and the KV is not stored: never a store of blocks the load had not written), or a hybrid engine no longer
        holds the window blocks before the store's end (counted in stats.skipped_requests). A hybrid store carries
        every window block the engine still holds (window_keys) and the states at every block boundary it holds."""
        state = self._requests.pop(request_id, None)
        self._abandon_match(state)
        if request_id in self._loading or request_id in self._pending_loads or not cacheable:
            return False
        groups = self.groups.as_groups(block_ids)
        full = min(num_computed_tokens, len(token_ids)) // self.block_size
        full = min(full, len(groups[self.groups.full_group]))
        if full == 0 or (state is not None and state.cached_blocks >= full):
            return False
        plan = self.groups.store_plan(groups, full)
        if plan is None:
            self.stats.skipped_requests += 1
            return False
        if self.link.client() is None:
            return False
        if state is None or state.keyed_tokens < full * self.block_size:
            keys = flexkvd.block_keys(self.config.namespace, token_ids[:full * self.block_size], self.block_size,
                                     extras.for_blocks(full) if extras is not None else None)
        else:
            keys = state.keys[:full]
        self._pending_stores.append(StoreSpec(request_id, keys_to_bytes(keys), plan.component_ids, plan.boundaries,
                                              plan.window_keys))
        self._storing.add(request_id)
        return True

    def update_connector_output(self, finished_sending: Optional[Iterable[str]],
                                finished_recving: Optional[Iterable[str]],
                                invalid_block_ids: Optional[Iterable[int]] = None) -> None:
        """The workers' report of one step (KVConnectorOutput.finished_sending, finished_recving and
        invalid_block_ids). A load that left blocks unfilled (evicted since the lookup) makes its request store them
        again at its end."""
        invalid = set(invalid_block_ids or ())
        if invalid:
            sent = [self._loading] + list(self._recent_layerwise)
            for rid, spec in ((rid, spec) for loads in sent for rid, spec in loads.items()):
                failed = [i for g in spec.block_ids for i, b in enumerate(g) if b in invalid]
                state = self._requests.get(rid)
                if failed and state is not None:
                    state.cached_blocks = min(state.cached_blocks, min(failed))
        self._storing.difference_update(finished_sending or ())
        for rid in finished_recving or ():
            self._loading.pop(rid, None)

    # ---- state ----

    @property
    def in_flight(self) -> Tuple[int, int]:
        """(loads, stores) planned or sent and not reported finished."""
        return len(self._loading) + len(self._pending_loads), len(self._storing)

    def close(self) -> None:
        self.link.close()

    def _state(self, request_id: str, token_ids: Sequence[int],
               extras: Optional[flexkvd.BlockExtras] = None) -> _RequestState:
        """The request's keys over its full blocks, computed once per request (and again only when it grew)."""
        state = self._requests.get(request_id)
        # A hit that covers the whole block-aligned prompt makes vLLM recompute its last token: with a state
        # (Mamba) component that token would be applied twice to the loaded state, so such an engine keys only the
        # blocks before the prompt's last token.
        usable = len(token_ids) - 1 if self.groups.has_state else len(token_ids)
        n = max(0, usable) // self.block_size * self.block_size
        if state is None or state.keyed_tokens != n:
            keys = flexkvd.block_keys(self.config.namespace, token_ids[:n] if n != len(token_ids) else token_ids,
                                     self.block_size,
                                     extras.for_blocks(n // self.block_size) if extras is not None else None)
            planned = -1 if state is None else state.load_planned
            self._abandon_match(state)
            state = _RequestState(keys=keys, keyed_tokens=n, load_planned=planned)
            self._requests[request_id] = state
        return state

    MAX_STRAY_MATCHES = 4096

    def _abandon_match(self, state: Optional[_RequestState]) -> None:
        """A request's lookup still in flight is no longer wanted: its result is taken later, not left in libflexkv."""
        if state is None or state.match is None:
            return
        self._stray_matches.append(state.match)
        state.match = None
        if len(self._stray_matches) > self.MAX_STRAY_MATCHES:  # a daemon that answers nothing: the session goes
            self._stray_matches = self._stray_matches[-self.MAX_STRAY_MATCHES:]  # with its results (bounded here)

    def _drain_stray_matches(self) -> None:
        """Takes the results of abandoned lookups that ended (once per step; never waits)."""
        if not self._stray_matches:
            return
        left = []
        for ticket in self._stray_matches:
            try:
                if ticket.try_wait() is None:
                    left.append(ticket)
            except flexkvd.Error:  # ended with an error, or its session is gone: nothing left to take
                pass
        self._stray_matches = left

    @property
    def stray_matches(self) -> int:
        """Abandoned lookups whose result has not been taken yet (leak checks)."""
        return len(self._stray_matches)

    def _failed(self, err: flexkvd.Error) -> None:
        self.stats.lookup_errors += 1
        if isinstance(err, flexkvd.DeadlineExceeded):
            self.link.stalled(err)
        elif session_lost(err):
            self.stats.session_losses += 1
            self.link.lost(err)
        else:
            log.debug("flexkvd lookup failed: %s", err)
