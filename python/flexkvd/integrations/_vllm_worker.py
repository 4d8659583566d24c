"""The vLLM connector's worker side without vLLM (WorkerLogic): TP rank 0 holds the data session, registers the KV
buffers of every TP rank, and runs the loads and stores the scheduler side planned (ConnectorMetadata); the other
ranks only describe their buffers (RankKv) and report nothing. docs/integrations.md, "vLLM".
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import flexkvd
from flexkvd import _lib

from ._vllm_layerwise import LayerwiseMixin
from ._vllm_link import DaemonLink, session_lost
from ._vllm_logic import ConnectorConfig, ConnectorMetadata, ConnectorStats, LoadSpec, StoreSpec, keys_from_bytes

log = logging.getLogger("flexkvd.integrations.vllm")


@dataclasses.dataclass
class RankKv:
    """One TP rank's KV buffers as rank 0 registers them (picklable without `tensors`: rank r sends it to rank 0).

    kind: "gpu": rank 0's own `tensors` (per layer [2, num_blocks, block_size, heads, head_dim], LAYER_FIRST), or a
      rank r > 0's `exported` description (flexkvd.export_gpu_kv: CUDA IPC handles as bytes; rank r keeps the memory);
      "mla-replica": an MLA rank r > 0 (its latent KV equals rank 0's: nothing to register); "host": host KV in
      memory shared with the daemon, created by rank 0 (the host backend serves TP 1, and TP > 1 only for MLA).
    component: the geometry component these buffers hold (a hybrid model's GPU KV: one RankKv per rank and
      component, each in the component's copy geometry; host KV: component 0 stands for every component).
    """

    tp_rank: int
    kind: str
    num_blocks: int
    layout: int = int(flexkvd.Layout.LAYER_FIRST)
    tensors: Optional[List[Any]] = dataclasses.field(default=None, compare=False)
    exported: Optional[bytes] = None
    region_bytes: Optional[int] = None  # when `tensors` are int device pointers (a _vllm_layouts.KvPlan's regions)
    component: int = 0

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["tensors"] = None  # device memory does not travel; see the class comment
        return state


def describe_rank_kv(tp_rank: int, geometry: flexkvd.Geometry, num_blocks: int,
                     tensors: Optional[Sequence[Any]] = None, layout: flexkvd.Layout = flexkvd.Layout.LAYER_FIRST,
                     region_bytes: Optional[int] = None, component: int = 0) -> RankKv:
    """What TP rank `tp_rank` hands rank 0 (over vLLM's TP CPU group) about its KV buffers of one geometry
    component (a hybrid model describes each component's GPU buffers: a KvPlan per component): GPU `tensors`, or
    None for host KV (component 0, standing for all). A GPU rank r > 0 exports its description (FailedPrecondition
    for expandable segments, Unimplemented without CUDA). InvalidArgument for a rank outside the geometry's tp_size
    or a component outside it, or host KV described for a component other than 0. layout and region_bytes: as
    register_gpu_kv takes them (a _vllm_layouts.KvPlan's; the default: per-layer tensors)."""
    if not 0 <= tp_rank < geometry.tp_size:
        raise flexkvd.InvalidArgument(f"tp_rank {tp_rank}; expected 0..{geometry.tp_size - 1} (geometry.tp_size)")
    if not 0 <= component < geometry.component_count:
        raise flexkvd.InvalidArgument(f"component {component}; expected 0..{geometry.component_count - 1} (the "
                                      "geometry's components)")
    if tp_rank > 0 and geometry.component(component).is_mla:
        return RankKv(tp_rank, "mla-replica", num_blocks, component=component)
    if tensors is None:
        if component != 0:
            raise flexkvd.InvalidArgument(f"host KV described for component {component}; host KV is described once "
                                          "(component 0) and created for every component")
        return RankKv(tp_rank, "host", num_blocks)
    if tp_rank > 0:
        return RankKv(tp_rank, "gpu", num_blocks, int(layout),
                      exported=flexkvd.export_gpu_kv(list(tensors), layout, num_blocks, tp_rank,
                                                     region_bytes=region_bytes, component=component),
                      component=component)
    return RankKv(tp_rank, "gpu", num_blocks, int(layout), tensors=list(tensors), region_bytes=region_bytes,
                  component=component)


@dataclasses.dataclass
class _Load:
    spec: LoadSpec
    handle: int
    ticket: Optional[flexkvd.Ticket]
    usable: int  # the prefix end loaded up to (<= spec.end); blocks [first, usable) are filled
    first: int = 0  # the first block copied: spec.first_block, or 0 with a libflexkv without partial loads
    bytes: int = 0  # what the daemon reported copying


@dataclasses.dataclass
class _Store:
    spec: StoreSpec
    ticket: Optional[flexkvd.Ticket]


class WorkerLogic(LayerwiseMixin):
    """The worker side of the connector, for one TP rank.

    Rank 0 (the reporter): register_kv() (or register_gpu_kv / create_host_kv for TP 1) once, then per engine step
    start(metadata) and get_finished(finished_request_ids) + take_load_errors(). Ranks > 0: describe_kv() for rank 0;
    their start/get_finished do nothing and report nothing (vLLM: get_finished_count() == 1).

    Loads pin the prefix (match with pin) and copy it into the block ids vLLM allocated; a load that finds fewer
    blocks than planned (evicted meanwhile), fails, or meets a lost daemon reports the block ids it did not fill as
    load errors, and the request as finished receiving either way, so vLLM recomputes them and nothing waits. Pins
    are released as soon as a load ends. Stores run when planned; a failed store is counted, never retried.
    Thread safety: none; vLLM calls a worker's connector from its one execution thread.
    KV buffers (GPU tensors, host KV views) must outlive this object's session: close() it first.
    """

    def __init__(self, config: ConnectorConfig, tp_rank: int = 0,
                 sync: Optional[Callable[[], None]] = None, link: Optional[DaemonLink] = None) -> None:
        """sync: called before stores are submitted, to wait for the engine's writes of the KV to be stored (GPU:
        the current CUDA stream's synchronize); None for host KV written synchronously."""
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = config.geometry.tp_size
        self.sync = sync
        self.stats = ConnectorStats()
        self._ranks: Dict[Tuple[int, int], RankKv] = {}  # (component, tp_rank)
        self.groups = config.groups
        self._host_views: Dict[int, memoryview] = {}  # per component
        self._host_num_blocks = 0
        self.kv_generation = 0  # bumped when the host KV buffer was replaced (after a daemon restart)
        self.link = link
        if self.link is None and tp_rank == 0:
            self.link = DaemonLink(f"{config.name}-worker-dp{config.dp_rank}", config.namespace, config.geometry,
                                   config.link, dp_rank=config.dp_rank, on_attach=self._register)
        elif self.link is not None:
            self.link.on_attach = self._register
        self._loads: List[_Load] = []
        self._stores: List[_Store] = []
        self._stray: List[flexkvd.Ticket] = []  # pins that timed out or releases: their results are taken later
        self._recving: Set[str] = set()
        self._sent: Set[str] = set()  # stores that ended, reported once vLLM named the request finished
        self._finished_seen: Set[str] = set()
        self._load_errors: Set[int] = set()
        self._hybrid_layerwise_refused = False  # logged once (_error)
        self._init_layerwise()

    # ---- registration ----

    @property
    def is_reporter(self) -> bool:
        return self.tp_rank == 0

    def describe_kv(self, num_blocks: int, tensors: Optional[Sequence[Any]] = None,
                    component: int = 0) -> RankKv:
        """This rank's RankKv of one component for rank 0 (describe_rank_kv)."""
        return describe_rank_kv(self.tp_rank, self.config.geometry, num_blocks, tensors, component=component)

    def register_kv(self, ranks: Iterable[RankKv]) -> None:
        """Rank 0: registers every TP rank's buffers (its own included), gathered from describe_kv() on each rank,
        and attaches. GPU KV of a hybrid geometry: one RankKv per rank and component (each rank registers each
        component); host KV: one per rank (component 0; the host buffers of every component are created). A daemon
        that is not reachable now is retried later (with backoff; the KV is registered again on every attach).
        InvalidArgument when ranks or components are missing or repeated, or a GPU rank has neither tensors
        (rank 0) nor an exported description (rank > 0); what the registration raises otherwise."""
        if not self.is_reporter:
            raise flexkvd.FailedPrecondition(f"register_kv on TP rank {self.tp_rank}; only rank 0 registers (hand it "
                                            "describe_kv())")
        by_key: Dict[Tuple[int, int], RankKv] = {}
        for r in ranks:
            key = (r.component, r.tp_rank)
            if key in by_key:
                raise flexkvd.InvalidArgument(f"TP rank {r.tp_rank} of component {r.component} given twice; expected "
                                             "one RankKv per rank and component")
            by_key[key] = r
        host = any(r.kind == "host" for r in by_key.values())
        count = 1 if host else self.config.geometry.component_count
        components = sorted({c for c, _ in by_key})
        if components != list(range(count)):
            raise flexkvd.InvalidArgument(
                f"RankKv of components {components}; expected 0..{count - 1} (" +
                ("host KV is described once, as component 0)" if host else
                 "GPU KV registers every component of the geometry, each rank's)"))
        for c in components:
            tp = sorted(rank for comp, rank in by_key if comp == c)
            if tp != list(range(self.tp_size)):
                raise flexkvd.InvalidArgument(f"RankKv of TP ranks {tp} for component {c}; expected "
                                             f"0..{self.tp_size - 1}")
        for r in by_key.values():
            if r.kind == "gpu" and r.tensors is None and r.exported is None:
                raise flexkvd.InvalidArgument(f"TP rank {r.tp_rank}'s RankKv has neither tensors nor an exported "
                                             "description; expected describe_kv()'s")
        self._ranks = by_key
        self.link.client(raise_errors=True)  # attach now if the daemon is there (registers through _register)

    def register_gpu_kv(self, tensors: Sequence[Any], num_blocks: int) -> None:
        """TP 1 (or MLA): rank 0's per-layer CUDA tensors [2, num_blocks, block_size, heads, head_dim]."""
        ranks = [describe_rank_kv(r, self.config.geometry, num_blocks, tensors if r == 0 else None)
                 for r in range(self.tp_size)]
        self.register_kv(ranks)

    def create_host_kv(self, num_blocks: int) -> memoryview:
        """Host backend (no GPU): creates rank 0's KV in memory shared with the daemon and returns component 0's
        (per layer [2, num_blocks, block_size, heads, head_dim], layers back to back). A hybrid geometry gets every
        component's buffer, each of num_blocks blocks of its copy geometry (one id space, as vLLM's groups share one
        block pool): host_kv(component). After a daemon restart the buffers are replaced by new ones holding the
        same bytes (kv_generation grows): fetch them again with host_kv(). Unavailable when the daemon is not
        reachable now (host KV needs the daemon to exist)."""
        self._host_num_blocks = num_blocks
        self.register_kv([describe_rank_kv(r, self.config.geometry, num_blocks) for r in range(self.tp_size)])
        if 0 not in self._host_views:
            raise flexkvd.Unavailable(f"flexkvd not reachable to create host KV ({self.link.last_error})")
        return self._host_views[0]

    def host_kv(self, component: int = 0) -> Optional[memoryview]:
        """The current host KV buffer of a component (see create_host_kv)."""
        return self._host_views.get(component)

    def _register(self, client: flexkvd.Client) -> None:
        """DaemonLink's on_attach: registers every rank's KV with the new session."""
        for r in sorted(self._ranks.values(), key=lambda r: (r.component, r.tp_rank)):
            if r.kind == "gpu" and r.tensors is not None:
                client.register_gpu_kv(r.tensors, flexkvd.Layout(r.layout), r.num_blocks, tp_rank=r.tp_rank,
                                       region_bytes=r.region_bytes, component=r.component)
            elif r.kind == "gpu":
                client.register_exported_gpu_kv(r.exported)
            elif r.kind == "host" and r.tp_rank == 0:
                for c in range(self.config.geometry.component_count):
                    view = client.create_host_kv(flexkvd.Layout(r.layout), r.num_blocks, component=c)
                    old = self._host_views.get(c)
                    if old is not None:  # a new session after a restart: carry the engine's KV over
                        view[:] = old
                    self._host_views[c] = view
                self.kv_generation += 1

    # ---- per engine step ----

    def start(self, metadata: ConnectorMetadata) -> None:
        """Submits this step's loads and stores (vLLM: start_load_kv). Never raises for the daemon's sake: what cannot
        be done is reported as load errors / counted store failures."""
        if not self.is_reporter or (not metadata.loads and not metadata.stores):
            return
        whole = [spec for spec in metadata.loads if not getattr(spec, "layerwise", False)]
        if whole:
            self._start_loads(whole)
        if len(whole) != len(metadata.loads):
            self._start_layer_loads([spec for spec in metadata.loads if getattr(spec, "layerwise", False)])
        if metadata.stores and self.store_fence is not None:
            self._park_stores(metadata.stores)  # submitted once the engine's stream passed the fence
            self._submit_fenced_stores()
            return
        if metadata.stores and self.sync is not None:
            self.sync()
        for spec in metadata.stores:
            self._start_store(self.link.client(), spec)  # None while the daemon is away or stalled: not stored

    def get_finished(self, finished_request_ids: Iterable[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(finished sending, finished receiving) since the last call, as vLLM's get_finished answers: a store is
        reported once it ended and vLLM named its request finished (this call or an earlier one). Ranks > 0:
        (None, None)."""
        if not self.is_reporter:
            return None, None
        self._end_layer_loads()
        self._submit_fenced_stores()
        self._poll()
        storing = self._sent | {store.spec.request_id for store in self._stores} | \
            {spec.request_id for _, spec in self._fenced}
        # Only ids with a store are kept: vLLM names its request finished in the step that carries the store.
        self._finished_seen.update(rid for rid in finished_request_ids if rid in storing)
        recving, self._recving = self._recving, set()
        sending = self._sent & self._finished_seen
        self._sent -= sending
        self._finished_seen -= sending
        return sending or None, recving or None

    def take_load_errors(self) -> Set[int]:
        """Block ids that were planned to load and were not (vLLM: get_block_ids_with_load_errors)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_all(self, timeout: float = 10.0) -> bool:
        """Waits until every load and store submitted so far has ended (results kept for get_finished); True when
        all did within `timeout`. For examples and shutdown; vLLM's steps only poll."""
        deadline = time.monotonic() + timeout
        self._end_layer_loads()
        while self._loads or self._stores or self._fenced:
            self._submit_fenced_stores()
            self._poll()
            if not (self._loads or self._stores or self._fenced):
                break
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True

    @property
    def in_flight(self) -> Tuple[int, int]:
        """(loads, stores) submitted and not ended."""
        return len(self._loads), len(self._stores)

    @property
    def stray_requests(self) -> int:
        """Pins that ended after their wait gave up, and releases, whose results are still to be taken."""
        return len(self._stray)

    @property
    def tracked_requests(self) -> int:
        """Request ids held for a later report (bounded by what is in flight; grows only with a leak)."""
        return len(self._finished_seen) + len(self._sent) + len(self._recving)

    def close(self) -> None:
        """Ends the session: the daemon releases its pins and finishes or cancels what was in flight. The host KV
        buffer stays mapped (and the session open) while the caller still holds views of it."""
        self._close_layerwise()
        if self.link is not None:
            self.link.close()
        self._loads, self._stores, self._stray = [], [], []
        self._host_views = {}

    # ---- internals ----

    def _pin_all(self, specs: Sequence[LoadSpec]) -> Tuple[List[Tuple[LoadSpec, Optional[flexkvd.Ticket]]], float]:
        """Sends a pinning match for every load at once (one op_timeout_s for them all): each spec with its ticket,
        or None where the daemon is away or stalled (link.client() is None) or the match was refused; and the
        deadline they share."""
        pins: List[Tuple[LoadSpec, Optional[flexkvd.Ticket]]] = []
        for spec in specs:
            self.stats.loads += 1
            client = self.link.client()
            ticket = None
            if client is not None:
                try:
                    ticket = client.match(keys_from_bytes(spec.keys), pin=True)
                except flexkvd.Error as err:
                    self._error(err)
            pins.append((spec, ticket))
        return pins, time.monotonic() + self.config.op_timeout_s

    def _start_loads(self, specs: Sequence[LoadSpec]) -> None:
        """Pins every load's prefix (the matches go out together), then loads what each pinned. The pins share one
        op_timeout_s: a daemon that does not answer costs the step that much once, and the link stalls."""
        pins, deadline = self._pin_all(specs)
        for spec, ticket in pins:
            if ticket is None or not self.link.attached:
                self._end_load(_Load(spec, 0, None, 0))
                continue
            try:
                hit = ticket.wait(timeout=max(0.0, deadline - time.monotonic()))
            except flexkvd.DeadlineExceeded as err:
                self._stray.append(ticket)  # its pins, if it gets any, are released when it ends
                self._end_load(_Load(spec, 0, None, 0))
                if time.monotonic() >= deadline and self.link.client() is not None:
                    self.link.stalled(err)
                continue
            except flexkvd.Error as err:  # pin cap (nothing pinned), or the daemon went away
                self._error(err)
                self._end_load(_Load(spec, 0, None, 0))
                continue
            self._load_pinned(spec, hit)

    def _load_pinned(self, spec: LoadSpec, hit: flexkvd.OpResult) -> None:
        """Loads the pinned match's end e (at most the planned end; fewer when blocks left since the lookup) past the
        engine's own first_block blocks: FULL [k, e), each window's [max(k, e - w), e), the state at e."""
        usable = min(hit.matched_blocks, spec.end)
        # A libflexkv without partial loads copies from block 0: the engine's own prefix is rewritten with the
        # same prefix's KV (the only way it had).
        first = spec.first_block if _lib.has_partial_loads else 0
        load = _Load(spec, hit.match_handle, None, usable, first)
        if usable <= spec.first_block:  # evicted since the scheduler looked
            self._end_load(load)
            return
        ids = self.groups.load_ids(spec.block_ids, first, usable)
        if ids is None:  # the engine holds no block at a position the load needs: nothing loaded, all reported
            load.usable = 0
            self._end_load(load)
            return
        try:
            load.ticket = self.link.current().load(hit.match_handle, ids if self.groups.is_hybrid else ids[0],
                                                   first_block=first)
        except flexkvd.Error as err:
            load.usable = 0
            self._end_load(load)
            self._error(err)
            return
        self._loads.append(load)

    def _start_store(self, client: Optional[flexkvd.Client], spec: StoreSpec) -> None:
        self.stats.stores += 1
        ticket = None
        if client is not None:
            try:
                if self.groups.is_hybrid:
                    ticket = client.store(keys_from_bytes(spec.keys), spec.block_ids, spec.boundaries,
                                          window_keys=spec.window_keys)
                else:
                    ticket = client.store(keys_from_bytes(spec.keys), spec.block_ids[0])
            except flexkvd.Error as err:
                self._error(err)
        if ticket is None:
            self.stats.store_failures += 1
            self._sent.add(spec.request_id)
            return
        self._stores.append(_Store(spec, ticket))

    def _poll(self) -> None:
        """Takes the results of whatever ended; a lost session ends everything in flight."""
        try:
            still: List[_Load] = []
            for load in self._loads:
                try:
                    r = load.ticket.try_wait()
                except flexkvd.Error as err:
                    if session_lost(err):
                        raise
                    load.usable = 0
                    self._end_load(load)
                    continue
                if r is None:
                    still.append(load)
                    continue
                load.usable = min(load.usable, load.first + r.done_blocks)
                load.bytes = r.bytes
                self._end_load(load)
            self._loads = still
            pending: List[_Store] = []
            for store in self._stores:
                try:
                    r = store.ticket.try_wait()
                except flexkvd.Error as err:
                    if session_lost(err):
                        raise
                    self.stats.store_failures += 1
                    done = err.result.done_blocks if getattr(err, "result", None) is not None else 0
                    self._store_ended(store, done)
                    continue
                if r is None:
                    pending.append(store)
                else:
                    self._store_ended(store, r.done_blocks)
            self._stores = pending
            strays, self._stray = self._stray, []  # _stray_ended may add the release of a late pin
            self._stray.extend(t for t in strays if not self._stray_ended(t))
        except flexkvd.Error as err:
            self._lose(err)

    def _stray_ended(self, ticket: flexkvd.Ticket) -> bool:
        try:
            r = ticket.try_wait()
        except flexkvd.Error as err:
            if session_lost(err):
                raise
            return True
        if r is None:
            return False
        client = self.link.current()
        if ticket.op == "match" and r.match_handle and client is not None:  # a timed-out pin: release its pins
            self._stray.append(client.release(r.match_handle))
        return True

    def _end_load(self, load: _Load) -> None:
        """Reports a load: its request as received, the blocks it did not fill as load errors; releases its pins."""
        spec = load.spec
        loaded = max(0, load.usable - spec.first_block)
        failed = self.groups.positions_ids(spec.block_ids, max(spec.first_block, load.usable), spec.end)
        self.stats.loaded_blocks += loaded
        self.stats.loaded_bytes += load.bytes if load.bytes else \
            max(0, load.usable - load.first) * self.config.geometry.host_block_bytes if loaded else 0
        self.stats.load_failed_blocks += max(0, spec.end - max(spec.first_block, load.usable))
        self._load_errors.update(failed)
        self._recving.add(spec.request_id)
        if load.handle and self.link.attached:
            try:
                self._stray.append(self.link.current().release(load.handle))
            except flexkvd.Error as err:
                self._error(err)

    def _store_ended(self, store: _Store, done_blocks: int) -> None:
        self.stats.stored_blocks += done_blocks
        self.stats.stored_bytes += done_blocks * self.config.geometry.host_block_bytes
        self._sent.add(store.spec.request_id)

    def _lose(self, err: flexkvd.Error) -> None:
        """The session is gone: every load in flight fails (its blocks reported), every store is dropped, and no
        ticket of the old session is left to be polled (one would fail a later session)."""
        loads, self._loads = self._loads, []
        stores, self._stores = self._stores, []
        self._stray = []
        if self.link.attached:
            self.stats.session_losses += 1
            self.link.lost(err)
        for load in loads:
            load.handle = 0
            load.usable = 0
            self._end_load(load)
        for store in stores:
            self.stats.store_failures += 1
            self._sent.add(store.spec.request_id)

    def _error(self, err: flexkvd.Error) -> None:
        if session_lost(err):
            self._lose(err)
        elif isinstance(err, flexkvd.InvalidArgument) and "hybrid" in str(err) and \
                ("layer-wise" in str(err) or "layer events" in str(err)):
            if not self._hybrid_layerwise_refused:  # a daemon older than the connector: said once, loudly
                self._hybrid_layerwise_refused = True
                log.error("flexkvd refuses layer-wise loads of this hybrid model (%s): it predates them, so every "
                          "hit is computed again; upgrade flexkvd to the connector's release, or set load_mode "
                          "'whole' in kv_connector_extra_config", err)
        else:
            log.debug("flexkvd request failed: %s", err)

