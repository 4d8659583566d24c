"""The vLLM worker's layer-by-layer loads and its stores that do not block the CPU (WorkerLogic's mixin).

Layer-wise loads (LoadSpec.layerwise; vLLM: get_num_new_matched_tokens answered "not async"): the request runs in
the step its load is planned. start_load_kv (before the forward) pins the prefix and submits the load; with a GPU
engine each load names a LayerEventSet, so the daemon records a CUDA event per layer right after that layer's
copies, and wait_for_layer_load(layer) makes the engine's current stream wait on that layer's events
(cudaStreamWaitEvent: the CPU goes on at once). With host KV (no GPU) the load reports layer progress and the wait
is the CPU's. At get_finished (the same step) the loads are waited for on the CPU, so that a load that failed
reports its blocks in that step's get_block_ids_with_load_errors, as vLLM requires of synchronous loads (it then
discards the step's output of that request and computes those tokens again); a layer-wise load is never reported
in finished_recving (vLLM did not wait for it).

Each load carries the deadline the connector waits for as its launch deadline (ring layout 6): flexkvd starts none of
its copies after that time. So when the connector gives up on a load (not launched in time: a stalled daemon), the
daemon either launched it before - its copies complete promptly, into blocks the request still holds - or never
will: no byte lands later in blocks vLLM gave to another request. With a libflexkv or flexkvd older than layout 6
the loads go without one (logged once): then a daemon that resumes after a give-up may still copy.

Stores: vLLM keeps a finished request's blocks until the store is reported, so nothing has to be copied during the
forward (save_kv_layer has nothing to do); the store must only not read the blocks before the engine's kernels that
write them have run. With a store_fence (GPU: a CUDA event recorded on the engine's current stream), the stores of
a step are parked behind it and submitted once it has completed (polled each step, event.query(): the CPU never
waits for the stream).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import flexkvd

from ._vllm_logic import LoadSpec, StoreSpec

log = logging.getLogger("flexkvd.integrations.vllm")


@dataclasses.dataclass
class _LayerLoad:
    spec: LoadSpec
    handle: int
    ticket: Optional[flexkvd.Ticket]
    usable: int   # blocks of the match loaded (<= len(spec.block_ids))
    first: int    # the first block copied
    events: Any   # the LayerEventSet it records, None for layer progress
    # False once a wait for one of its layers failed (timed out): the forward may have read a layer that had not
    # landed, so the load is reported failed (recomputed) even if it ends OK.
    waits_ok: bool = True


class LayerwiseMixin:
    """WorkerLogic's layer-wise loads and fenced stores; WorkerLogic.__init__ calls _init_layerwise()."""

    # Set by the vLLM adapter (GPU): the engine's current stream, for the layer waits; None: layer progress (host KV).
    layer_stream: Optional[Callable[[], Any]] = None
    # Set by the vLLM adapter (GPU): records a fence after everything enqueued on the engine's stream so far; the
    # object's query() is True once it passed. None: stores are submitted at once (after `sync`, if any).
    store_fence: Optional[Callable[[], Any]] = None

    def _init_layerwise(self) -> None:
        self.layer_names: Dict[str, int] = {}   # vLLM layer name -> flexkvd layer (register_layer_names)
        self._layer_loads: List[_LayerLoad] = []
        self._free_sets: List[Any] = []
        self._sets_session: Optional[int] = None
        self._fenced: List[Tuple[Any, StoreSpec]] = []
        self._late: List[_LayerLoad] = []       # loads whose wait gave up: their sets come back when they end
        # Loads carry their launch deadline while libflexkv and flexkvd take one (ring layout 6).
        self._launch_deadlines = bool(flexkvd._lib.has_launch_deadlines)  # noqa: SLF001

    def register_layer_names(self, names: Dict[str, int]) -> None:
        """Which layer of a layer-wise load each vLLM layer name is (KvPlan.layer_index; a hybrid model: its index
        in geometry.layer_order(), layer_order_names), for wait_layer."""
        self.layer_names = dict(names)

    # ---- loads ----

    def _start_layer_loads(self, specs: Sequence[LoadSpec]) -> None:
        """Pins every load's prefix, then submits each pinned one layer-wise; returns once every load's copies are
        enqueued (GPU: wait_launched), so that wait_layer may bind the engine's stream to their events."""
        self._end_layer_loads()  # (a step whose get_finished was not called: never two steps' loads at once)
        pins, deadline = self._pin_all(specs)
        for spec, ticket in pins:
            if ticket is None or not self.link.attached:
                self._end_layer_load(_LayerLoad(spec, 0, None, 0, 0, None), ok=False)
                continue
            try:
                hit = ticket.wait(timeout=max(0.0, deadline - time.monotonic()))
            except flexkvd.DeadlineExceeded as err:
                self._stray.append(ticket)  # its pins, if it gets any, are released when it ends
                self._end_layer_load(_LayerLoad(spec, 0, None, 0, 0, None), ok=False)
                if self.link.client() is not None:
                    self.link.stalled(err)
                continue
            except flexkvd.Error as err:
                self._error(err)
                self._end_layer_load(_LayerLoad(spec, 0, None, 0, 0, None), ok=False)
                continue
            self._submit_layer_load(spec, hit, deadline)

    def _submit_layer_load(self, spec: LoadSpec, hit: flexkvd.OpResult, deadline: float) -> None:
        usable = min(hit.matched_blocks, spec.end)
        first = spec.first_block if flexkvd._lib.has_partial_loads else 0  # noqa: SLF001
        load = _LayerLoad(spec, hit.match_handle, None, usable, first, None)
        if usable <= spec.first_block:  # evicted since the scheduler looked
            self._end_layer_load(load, ok=False)
            return
        if self.groups.is_hybrid:  # FULL [k, e), each window's [max(k, e - w), e), the state at e
            ids: Any = self.groups.load_ids(spec.block_ids, first, usable)
            if ids is None:  # the engine holds no block at a position the load needs: nothing loaded
                self._end_layer_load(load, ok=False)
                return
        else:
            ids = _ids(spec)[first:usable]
        client = self.link.current()
        try:
            if self.layer_stream is not None:
                load.events = self._event_set(client)
                load.ticket = self._load(client, hit.match_handle, ids, first, deadline, event_set=load.events)
                load.ticket.wait_launched(timeout=max(0.0, deadline - time.monotonic()))
            else:
                load.ticket = self._load(client, hit.match_handle, ids, first, deadline, layerwise=True)
        except flexkvd.DeadlineExceeded:  # not launched in time: its layers are not waited for, nor used
            self._give_up(load)
            return
        except flexkvd.Error as err:  # refused, or ended with an error before launch: nothing was enqueued
            self._error(err)
            self._end_layer_load(load, ok=False)
            return
        self._layer_loads.append(load)
        self._wait_states(load)

    def _wait_states(self, load: _LayerLoad) -> None:
        """A hybrid model's states (Mamba / linear-attention layers: vLLM runs them without wait_for_layer_load)
        must be in place before the forward: they come first in the layer order, so the engine's stream waits for
        the last of them now (GPU), or the CPU does (host KV)."""
        states = sum(c.num_layers for c in self.config.geometry.components
                     if c.kind == flexkvd.ComponentKind.STATE)
        if states == 0:
            return
        try:
            if load.events is not None:
                load.events.wait(states - 1, self.layer_stream())
            else:
                load.ticket.wait_layers(states, timeout=self.config.op_timeout_s)
        except flexkvd.Error as err:  # judged when it ends (_end_layer_loads): failed, its blocks recomputed
            load.waits_ok = False
            log.debug("the states of a flexkvd load: %s", err)

    def _load(self, client: flexkvd.Client, handle: int, ids: List[int], first: int, deadline: float,
              **kind: Any) -> flexkvd.Ticket:
        """Submits a load whose launch deadline is `deadline` (the time the connector gives up on it); without one
        when libflexkv or flexkvd predates ring layout 6."""
        if self._launch_deadlines:
            try:
                return client.load(handle, ids, first_block=first, launch_deadline=deadline, **kind)
            except flexkvd.FailedPrecondition as err:
                if "ring layout 6" not in str(err):
                    raise
                self._launch_deadlines = False
                log.warning("flexkvd takes no launch deadline (%s): loads go without one, so a daemon that resumes "
                            "after the connector gave up on a load may still copy it", err)
        return client.load(handle, ids, first_block=first, **kind)

    def wait_layer(self, layer_name: str) -> None:
        """vLLM's wait_for_layer_load: the engine's stream waits for this layer of every layer-wise load of the
        step (GPU), or the CPU waits for it to land (host KV). A name that is not a registered layer (a draft
        layer, or a layer whose name is not known yet) waits for the last layer: for every copy. A step without
        layer-wise loads: nothing to wait for."""
        if not self._layer_loads:
            return
        layer = self.layer_names.get(layer_name, self.config.geometry.total_layers - 1)
        stream = self.layer_stream() if self.layer_stream is not None else None
        for load in self._layer_loads:
            try:
                if load.events is not None:
                    load.events.wait(layer, stream)
                else:
                    load.ticket.wait_layers(layer + 1, timeout=self.config.op_timeout_s)
            except flexkvd.Error as err:  # judged when it ends (_end_layer_loads): failed, its blocks recomputed
                load.waits_ok = False
                log.debug("layer %d of a flexkvd load: %s", layer, err)

    def _end_layer_loads(self) -> None:
        """Waits (CPU) for this step's layer-wise loads and reports them: the blocks they did not fill as load
        errors, never as finished_recving; releases their pins."""
        loads, self._layer_loads = self._layer_loads, []
        for load in loads:
            try:
                r = load.ticket.wait(timeout=self.config.op_timeout_s)
            except flexkvd.DeadlineExceeded:
                self._give_up(load)
                continue
            except flexkvd.Error as err:
                self._error(err)
                self._end_layer_load(load, ok=False)
                continue
            self._end_layer_load(load, ok=load.waits_ok and r.done_blocks >= load.usable - load.first,
                                 moved_bytes=r.bytes)
        self._retire_late()

    def _give_up(self, load: _LayerLoad) -> None:
        """A load that did not launch or end in time: its blocks are reported now; its event set and pins stay
        with it until it ends (_retire_late), since the daemon may still copy."""
        self._late.append(load)
        self._end_layer_load(dataclasses.replace(load, ticket=None, events=None, handle=0), ok=False)

    def _retire_late(self) -> None:
        late, self._late = self._late, []
        for load in late:
            try:
                ended = load.ticket.try_wait() is not None
            except flexkvd.Error:
                ended = True
            if not ended:
                self._late.append(load)
                continue
            self._give_back_set(load.events)
            if load.handle and self.link.attached:
                try:
                    self._stray.append(self.link.current().release(load.handle))
                except flexkvd.Error as err:
                    self._error(err)

    def _end_layer_load(self, load: _LayerLoad, ok: bool, moved_bytes: int = 0) -> None:
        """Reports a layer-wise load (moved_bytes: what the daemon copied, every component's)."""
        spec = load.spec
        usable = load.usable if ok else spec.first_block
        loaded = max(0, usable - spec.first_block)
        if self.groups.is_hybrid:  # a hybrid prefix end loads whole or not at all: every group's later positions
            failed = self.groups.positions_ids(spec.block_ids, max(spec.first_block, usable), spec.end)
        else:
            failed = _ids(spec)[max(spec.first_block, usable):]
        self.stats.loaded_blocks += loaded
        self.stats.loaded_bytes += (moved_bytes or loaded * self.config.geometry.host_block_bytes) if loaded else 0
        self.stats.load_failed_blocks += max(0, spec.end - max(spec.first_block, usable))  # positions, as whole loads
        self._load_errors.update(failed)
        self._give_back_set(load.events)  # (None for a load given up on: its set stays with it)
        if load.handle and self.link.attached:
            try:
                self._stray.append(self.link.current().release(load.handle))
            except flexkvd.Error as err:
                self._error(err)

    def _event_set(self, client: flexkvd.Client) -> Any:
        """A layer-event set of this session that no load uses (made on first need; one per concurrent load)."""
        if self._sets_session != client.session_id:  # a new session: the daemon forgot the old sets
            for s in self._free_sets:
                s.close()
            self._free_sets, self._sets_session = [], client.session_id
        if self._free_sets:
            return self._free_sets.pop()
        return client.layer_events(self.config.geometry.total_layers)

    def _give_back_set(self, events: Any) -> None:
        if events is not None and self._sets_session is not None:
            self._free_sets.append(events)

    # ---- stores ----

    def _park_stores(self, specs: Sequence[StoreSpec]) -> None:
        """Stores behind a fence recorded now on the engine's stream (store_fence)."""
        fence = self.store_fence()
        self._fenced.extend((fence, spec) for spec in specs)

    def _submit_fenced_stores(self) -> None:
        """Submits the parked stores whose fence has passed (in order: a later fence passes after an earlier)."""
        while self._fenced and self._fenced[0][0].query():
            _, spec = self._fenced.pop(0)
            self._start_store(self.link.client(), spec)

    @property
    def fenced_stores(self) -> int:
        """Stores waiting for the engine's stream to pass their fence."""
        return len(self._fenced)

    def _close_layerwise(self) -> None:
        for s in self._free_sets:
            s.close()
        self._free_sets, self._layer_loads, self._late, self._fenced = [], [], [], []


def layer_order_names(geometry: flexkvd.Geometry, names: Sequence[Sequence[Optional[str]]]) -> Dict[str, int]:
    """A hybrid model's layer names (names[c]: component c's layers, as its KvPlan lists them) to their index in a
    layer-wise load: the position of (c, layer) in geometry.layer_order(). Unnamed layers (None) are left out."""
    index = {step: i for i, step in enumerate(geometry.layer_order())}
    return {name: index[(c, j)] for c, layers in enumerate(names) for j, name in enumerate(layers)
            if name is not None and (c, j) in index}


def _ids(spec: LoadSpec) -> List[int]:
    """The engine's block ids of a layer-wise load: its one KV cache group's (layer-wise loads are for models of one
    group, ConnectorConfig.layerwise)."""
    if len(spec.block_ids) != 1:
        raise flexkvd.InvalidArgument(f"request {spec.request_id!r}: a layer-wise load with {len(spec.block_ids)} KV "
                                      "cache groups; layer-wise loads are for models of one group")
    return spec.block_ids[0]
