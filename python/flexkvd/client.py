"""Client: one process's connection to the node's flexkvd (flexkv::Client); its requests' Tickets are in _ticket.py.

Over 700 lines: the Client class mirrors libflexkv's calls one method each (attach, store, load, match, prefetch,
status, events), each converting its arguments and errors; the Tickets, keys and status types live in their own modules.

Thread safety: every method may be called from several threads at once, attach(), detach() and close() included:
libflexkv lets them race the other calls (a call running on a session that detach() or close() ends raises
FailedPrecondition; a ticket of an ended session raises FailedPrecondition, never another request's result).
Two locks are left here: attach(), detach(), close() and create_host_kv() run one at a time, for the host KV
buffer's bookkeeping (its views must be gone before its mapping is); and the flexkv_client* is freed only once
no call is using it (close() does not wait: the last call to return frees it). Calls made after close() raise
FailedPrecondition. No method holds the GIL while it blocks in libflexkv.
"""
from __future__ import annotations

import copy
import ctypes
import dataclasses
import math
import numbers
import operator
import os
import sys
import threading
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _lib, _native
from ._convert import INT_MAX, U64_MAX, c_int_array, c_uint, device_region
from ._handle import Handle
from ._ticket import OpResult, Ticket
from .errors import FailedPrecondition, InvalidArgument, StatusCode, Unimplemented
from .geometry import MAX_COMPONENTS, ComponentKind, Geometry, Layout
from .keys import BlockKeys, as_block_keys

__all__ = ["Client", "ClusterMember", "ClusterStatus", "ComponentPoolStatus", "DaemonStatus", "KvEventsStatus",
           "OpResult", "Ticket", "connect", "export_gpu_kv"]


@dataclasses.dataclass(frozen=True)
class KvEventsStatus:
    """The daemon's KV event stream (docs/kv_events.md): a router compares a subscription's position with last_seq
    (caught up?) and instance_id with its batches' (the daemon restarted?)."""

    instance_id: int  # random per daemon start
    last_seq: int  # the last event's seq (events are numbered only while someone subscribes)
    subscribers: int
    cut_off: int  # subscribers cut off for falling behind
    buffer_events: int  # --kv-events-buffer


@dataclasses.dataclass(frozen=True)
class ClusterMember:
    """One member of the cluster as the daemon sees it (its lease is alive)."""

    node_id: str
    endpoint: str
    epoch: int
    is_self: bool


@dataclasses.dataclass(frozen=True)
class ClusterStatus:
    """The daemon's cluster tier (docs/cluster.md): its state and the current members."""

    state: str  # "joined" | "joining: <why not yet>" | "stopped"
    node_id: str
    endpoint: str
    epoch: int
    members: Tuple[ClusterMember, ...]


@dataclasses.dataclass(frozen=True)
class DaemonStatus:
    """GetStatus, as the C ABI reports it (docs/operations.md, "What each status field means")."""

    state: str  # "serving" | "draining" | "drained"
    version: str
    pid: int
    uptime_s: int
    block_bytes: int
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int
    index_blocks: int
    sessions: int
    # The KV event stream; None from a libflexkv without flexkv_get_status_routing.
    kv_events: Optional[KvEventsStatus] = None
    # The cluster tier; None without one (no --etcd-endpoints) or from a libflexkv without flexkv_get_status_routing.
    cluster: Optional[ClusterStatus] = None


@dataclasses.dataclass(frozen=True)
class ComponentPoolStatus:
    """One sub-pool of the daemon's cache domain (Client.pool_components; docs/hybrid.md "Pool and eviction")."""

    kind: ComponentKind
    slot_bytes: int
    capacity: int
    used: int  # pending + committed
    pinned: int
    evicted: int
    unanchored: int  # entries whose full-attention block is gone (evicted first)


class Client:
    """A connection to flexkvd and, once attached, this process's session (flexkv::Client). Use connect().

    One Client per engine process (per DP rank or TP worker). Closing it (close(), the with-statement, or garbage
    collection) ends the session; everything the session held (pins, in-flight requests) is released.
    """

    def __init__(self, ptr: int, socket_path: Optional[str]) -> None:
        self._handle = Handle(ptr)
        self.socket_path = socket_path  # as given to connect(); None: $FLEXKV_SOCKET or the default
        # attach, detach, close and create_host_kv one at a time: they change the three below together with the call
        # that makes them true, and check the host KV buffer's views before its mapping can go.
        self._session_lock = threading.Lock()
        self.session_id: Optional[int] = None
        self.geometry: Optional[Geometry] = None
        # The host KV mappings by geometry component, exported to the caller's views.
        self._host_arrays: Dict[int, ctypes.Array] = {}

    # ---- lifetime ----

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful left to report
            pass

    def close(self) -> None:
        """Detaches and frees the client; idempotent. Later calls raise FailedPrecondition.

        If views of a host KV buffer (memoryviews, NumPy arrays, tensors) are still alive, the session and its
        mappings stay until the last of them is gone (then it is closed), so a stale view never touches unmapped
        memory. Otherwise the session ends now: calls in progress on other threads end with FailedPrecondition
        (or their own result), and the last of them frees the client; close() does not wait for them.
        """
        with self._session_lock:
            host, self._host_arrays = list(self._host_arrays.values()), {}
            # getrefcount's argument and the list's reference are not views.
            viewed = [host[i] for i in range(len(host)) if sys.getrefcount(host[i]) > 2]
            views = bool(viewed)
            ptr = self._handle.close(keep_until=viewed)
            del host, viewed
            if ptr is None:
                return
            try:
                if not views:
                    _lib.lib.flexkv_detach(ptr)  # ends the waits of other threads now; freeing it would detach too
            finally:
                self.session_id = None
                self._handle.release()

    # ---- control plane ----

    def attach(self, name: str, namespace: str, geometry: Geometry, dp_rank: int = 0, tp_rank: int = 0) -> int:
        """Opens this process's session and returns its id.

        name: shown by `flexkvctl sessions`. namespace: the cache domain (sessions share blocks within it; keys
        must be computed with the same namespace). geometry: the KV cache shape.
        Attaching again after the daemon went away (Unavailable from a wait) is the way to recover: the lost
        session, its rings and its host KV buffer are dropped, and create_host_kv / register_gpu_kv must be called
        again for the new one. Since that unmaps the old host KV buffer, attach() refuses (FailedPrecondition, and
        nothing changes) while views of it are alive, as detach() does: drop them first, or close() this client
        (which waits for them) and connect anew. Calls in progress on other threads on the old session end with
        FailedPrecondition or Unavailable, and its tickets answer FailedPrecondition from then on.

        Raises InvalidArgument for a bad geometry (naming the field and the accepted range), a rank that is not a
        uint32, or a NUL character in name or namespace; FailedPrecondition when already attached (to a live
        session), for a geometry that does not match the cache domain, or a protocol mismatch; Unavailable while
        the daemon is draining or not reachable.
        """
        g = geometry._to_c()
        dp = c_uint(dp_rank, "dp_rank")
        tp = c_uint(tp_rank, "tp_rank")
        name_c = _c_string(name, "name")
        namespace_c = _c_string(namespace, "namespace")
        sid = ctypes.c_uint64(0)
        with self._session_lock:
            ptr = self._handle.acquire()
            try:
                return self._attach(ptr, name_c, namespace_c, dp, tp, g, sid, geometry)
            finally:
                self._handle.release()

    def _attach(self, ptr: int, name_c: bytes, namespace_c: bytes, dp: int, tp: int, g: Any, sid: Any,
                geometry: Geometry) -> int:
        """attach() under the session lock and the handle."""
        if self._host_arrays:
            views = self._host_views()
            if views > 0:
                raise FailedPrecondition(
                    f"this client is attached (session {self.session_id}) and its host KV buffer is still "
                    f"referenced ({views} views: memoryviews, NumPy arrays, tensors); attaching again ends that "
                    "buffer's use (the new session registers its own): drop them first (or close() this "
                    "client, which waits for them, and connect anew)")
            # No view is left and none can be made any more: whatever attach does to the old mapping (nothing,
            # if the session is alive; unmapped, if it was lost), nobody can touch it through Python.
            self._host_arrays = {}
        rc = _lib.lib.flexkv_attach(ptr, name_c, namespace_c, dp, tp, ctypes.byref(g), ctypes.byref(sid))
        if rc != 0:
            # Only a live session answers FAILED_PRECONDITION without being dropped ("already attached"); any
            # other failure of a client that was attached means libflexkv found it lost and dropped it.
            if rc != StatusCode.FAILED_PRECONDITION:
                self.session_id = None
            raise _lib.error_from_last(rc)
        self.session_id = int(sid.value)
        self.geometry = copy.deepcopy(geometry)
        return self.session_id

    def _host_views(self) -> int:
        """Live views (memoryviews, NumPy arrays, tensors) of the host KV buffers; caller holds the session lock.
        getrefcount's own argument and our dict's reference are not views."""
        return sum(sys.getrefcount(self._host_arrays[c]) - 2 for c in list(self._host_arrays))

    @property
    def attached(self) -> bool:
        return self.session_id is not None

    def detach(self) -> None:
        """Ends the session; everything it held is released and the host KV buffer is unmapped. No-op when not
        attached. Raises FailedPrecondition (and stays attached) while views of the host KV buffer are alive: drop
        them first, or use close(), which waits for them."""
        with self._session_lock:
            ptr = self._handle.acquire()
            try:
                if self._host_arrays:
                    views = self._host_views()
                    if views > 0:
                        raise FailedPrecondition(
                            f"the host KV buffer is still referenced ({views} views: memoryviews, NumPy arrays, "
                            "tensors); drop them before detach() (close() detaches once they are gone)")
                _lib.check(_lib.lib.flexkv_detach(ptr))
                self._host_arrays = {}
                self.session_id = None
            finally:
                self._handle.release()

    def status(self) -> DaemonStatus:
        """The daemon's status (state, pool, index, sessions, the KV event stream and the cluster tier), from one
        GetStatus."""
        out = _lib.DaemonStatusStruct()
        kv_events: Optional[KvEventsStatus] = None
        cluster: Optional[ClusterStatus] = None
        if not _lib.has_status_routing:
            self._call(_lib.lib.flexkv_get_status, ctypes.byref(out))
        else:
            events = _lib.KvEventsStatusStruct()
            c = _lib.ClusterStatusStruct()
            capacity = 64
            while True:
                members = (_lib.ClusterMemberStruct * capacity)()
                count = ctypes.c_size_t(0)
                self._call(_lib.lib.flexkv_get_status_routing, ctypes.byref(out), ctypes.byref(events),
                           ctypes.byref(c), members, capacity, ctypes.byref(count))
                if count.value <= capacity:
                    break
                capacity = count.value  # more members than room: ask again with room for all
            kv_events = KvEventsStatus(int(events.instance_id), int(events.last_seq), int(events.subscribers),
                                       int(events.cut_off), int(events.buffer_events))
            if c.present:
                cluster = ClusterStatus(
                    c.state.decode("utf-8", "replace"), c.node_id.decode("utf-8", "replace"),
                    c.endpoint.decode("utf-8", "replace"), int(c.epoch),
                    tuple(ClusterMember(m.node_id.decode("utf-8", "replace"), m.endpoint.decode("utf-8", "replace"),
                                        int(m.epoch), bool(m.self)) for m in members[:count.value]))
        return DaemonStatus(out.state.decode(), out.version.decode(), int(out.pid), int(out.uptime_s),
                            int(out.block_bytes), int(out.capacity_blocks), int(out.used_blocks),
                            int(out.pinned_blocks), int(out.index_blocks), int(out.sessions), kv_events, cluster)

    def pool_components(self) -> List[ComponentPoolStatus]:
        """The sub-pools of the daemon's cache domain, component 0 first (one for a full-attention domain; none
        before a domain is set)."""
        count = ctypes.c_size_t(0)
        out = (_lib.ComponentStatusStruct * MAX_COMPONENTS)()
        self._call(_lib.lib.flexkv_get_status_components, out, MAX_COMPONENTS, ctypes.byref(count))
        return [ComponentPoolStatus(ComponentKind(c.kind), int(c.slot_bytes), int(c.capacity), int(c.used),
                                    int(c.pinned), int(c.evicted), int(c.unanchored))
                for c in out[:min(count.value, MAX_COMPONENTS)]]

    def drain(self) -> str:
        """Admin: stop admitting new sessions, loads and stores ("draining"; "drained" once nothing is in flight).
        Returns the state after the call. PermissionDenied unless root, the daemon's uid or --admin-group."""
        state = ctypes.create_string_buffer(32)
        self._call(_lib.lib.flexkv_drain, state, len(state))
        return state.value.decode()

    def resume(self) -> str:
        """Admin: serve again after drain(). Returns the state after the call."""
        state = ctypes.create_string_buffer(32)
        self._call(_lib.lib.flexkv_resume, state, len(state))
        return state.value.decode()

    def health(self) -> bool:
        """True when the daemon is SERVING (grpc.health.v1); False when it is not (draining, or unreachable)."""
        ptr = self._handle.acquire()
        try:
            rc = _lib.lib.flexkv_check_health(ptr)
            err = None if rc in (0, StatusCode.UNAVAILABLE) else _lib.error_from_last(rc)
        finally:
            self._handle.release()
        if err is not None:
            raise err
        return rc == 0

    # ---- KV buffers ----

    def create_host_kv(self, layout: Union[Layout, int], num_blocks: int, component: int = 0) -> memoryview:
        """Host backend: creates num_blocks blocks of KV buffers in `layout`, in memory shared with the daemon,
        and registers them (once per session and component). Returns a writable, flat memoryview of all of it
        (format "B", len == num_blocks * the bytes of one block of one TP rank); wrap it with numpy.frombuffer /
        torch.frombuffer.

        component: hybrid models register every component's buffers, each in its copy geometry
        (geometry.component(component)): a block is num_layers x kv_planes x chunk_bytes_per_rank bytes of it; a
        state component's "blocks" are the engine's state slots (num_layers x state_bytes_per_layer bytes each).

        The memory stays mapped while the session lasts and any view of it is alive (see close()).
        Raises InvalidArgument for a bad layout, block count or component, FailedPrecondition when not attached,
        AlreadyExists when that component is already registered.
        """
        lay = _layout(layout)
        n = c_uint(num_blocks, "num_blocks")  # 0 is refused by libflexkv
        comp = c_uint(component, "component")
        data = ctypes.c_void_p(0)
        nbytes = ctypes.c_uint64(0)
        with self._session_lock:
            ptr = self._handle.acquire()
            try:
                if comp == 0:  # every geometry's component 0; the call a full-attention engine has always made
                    rc = _lib.lib.flexkv_create_host_kv(ptr, lay, n, ctypes.byref(data), ctypes.byref(nbytes))
                else:
                    rc = _lib.lib.flexkv_create_host_kv_component(ptr, comp, lay, n, ctypes.byref(data),
                                                                  ctypes.byref(nbytes))
                _lib.check(rc)
                # Under the session lock with the call: a close() or detach() on another thread sees the buffer (and
                # this view of it) and keeps the mapping, instead of unmapping it between the call and these lines.
                array = (ctypes.c_uint8 * nbytes.value).from_address(data.value)
                self._host_arrays[comp] = array
                return memoryview(array).cast("B")
            finally:
                self._handle.release()

    def session_component(self, component: int = 0) -> Tuple[int, int]:
        """(slot_bytes, capacity) of one geometry component's sub-pool as the attach answered: the host bytes of one
        slot (a block, or a state snapshot) and the slots. FailedPrecondition when not attached, InvalidArgument for
        a component the geometry does not have."""
        slot_bytes = ctypes.c_uint64(0)
        capacity = ctypes.c_uint64(0)
        self._call(_lib.lib.flexkv_session_component, c_uint(component, "component"), ctypes.byref(slot_bytes),
                   ctypes.byref(capacity))
        return int(slot_bytes.value), int(capacity.value)

    def register_gpu_kv(self, regions: Sequence[Any], layout: Union[Layout, int], num_blocks: int, tp_rank: int = 0,
                        *, region_bytes: Optional[int] = None, component: int = 0) -> str:
        """CUDA backend: registers one TP rank's KV buffers in GPU memory; returns the GPU's UUID.

        regions: LAYER_FIRST: one per layer (vLLM's per-layer tensors, each [2, num_blocks, block_size, heads,
          head_dim]); LAYER_BLOCK_REGIONS: one per layer, each [num_blocks, 2, block_size, heads, head_dim]
          (FlashInfer, Triton); BLOCK_FIRST / LAYER_BLOCK: one. Each is a CUDA tensor (anything with data_ptr(),
          numel() and element_size(), such as torch.Tensor, or with __cuda_array_interface__), contiguous, all of
          equal size; or an int device pointer, with region_bytes. torch is never imported here.
        Memory from PyTorch's caching allocator (cudaMalloc) and from expandable segments (cuMem/VMM) both work.
        component: the geometry component these buffers hold (hybrid models register each component's buffers, in
        its copy geometry, separately).
        Raises InvalidArgument for non-contiguous or unequal regions, CPU tensors or pointers that are not device
        memory; Unimplemented with a libflexkv built without CUDA.
        """
        kv = _describe_gpu_kv(regions, layout, num_blocks, tp_rank, region_bytes, component)
        try:
            uuid = (_lib.lib.flexkv_gpu_kv_uuid(kv) or b"").decode()
            self._call(_lib.lib.flexkv_register_gpu_kv, kv)
        finally:
            _lib.lib.flexkv_gpu_kv_free(kv)
        return uuid

    def register_exported_gpu_kv(self, description: bytes) -> None:
        """CUDA backend, TP engines: registers another process's GPU KV buffers from export_gpu_kv()'s bytes (TP rank
        r's worker describes, the attached process registers every rank). The describing process must keep the
        memory while this session uses it. Raises InvalidArgument for bytes that are not a description, and what
        register_gpu_kv raises."""
        data = bytes(description)
        kv = ctypes.c_void_p(0)
        _lib.check(_lib.lib.flexkv_gpu_kv_import(data, len(data), ctypes.byref(kv)))
        try:
            self._call(_lib.lib.flexkv_register_gpu_kv, kv)
        finally:
            _lib.lib.flexkv_gpu_kv_free(kv)

    # ---- data plane (after attach); each returns a Ticket at once ----

    def match(self, keys: Union[BlockKeys, Iterable[Any]], pin: bool = False) -> Ticket:
        """Looks up the leading blocks of `keys` that are cached (result.matched_blocks), walking from the root: pass
        the prompt's keys from its first block (keys.parent is not used). With pin, they stay pinned
        (never evicted) until release(result.match_handle), and result.match_handle names them for load(). Pinning
        beyond the daemon's --max-session-pin-share raises ResourceExhausted (nothing pinned); pins of a process
        stopped longer than --pin-lease lapse (load/release then raise FailedPrecondition). The library renews
        the lease while the process runs."""
        k = as_block_keys(keys)
        ext = _native.ext
        if ext is not None:
            return self._submit_fast("match", ext.match, k._array, pin)
        return self._submit("match", _lib.lib.flexkv_match, k._array, len(k), 1 if pin else 0)

    def prefetch(self, keys: Union[BlockKeys, Iterable[Any]]) -> Ticket:
        """Warms this node's cache for a prompt: pass its keys from its first block, as to match(). The result's
        matched_blocks are the leading blocks cached here; done_blocks the blocks after them pulled from peer daemons
        (the cluster tier) and cached here once verified, bytes what was pulled, source the node they came from or
        why none were pulled ("" when no peer had them). OK even when nothing was pulled; a daemon without a cluster
        tier answers with the local hits only. For a hybrid geometry a pull is a whole hit (FULL blocks, windows,
        state) or nothing: matched_blocks + done_blocks is then the hit end held here, done_blocks counts FULL
        blocks and bytes every component's. The ticket ends when the pull has ended (bounded by the daemon's
        deadline); beyond the daemon's per-session limit of prefetches in flight it raises ResourceExhausted. A
        read-only session (its uid may not store in the namespace) on a daemon with a cluster tier ends with
        PermissionDenied: a pull stores what it pulls. Pins nothing: match(keys, pin=True) after it, then load(). An
        all-zero key raises InvalidArgument."""
        k = as_block_keys(keys)
        ext = _native.ext
        if ext is not None:
            return self._submit_fast("prefetch", ext.prefetch, k._array)
        return self._submit("prefetch", _lib.lib.flexkv_prefetch, k._array, len(k))

    def layer_events(self, num_layers: int) -> "LayerEventSet":
        """CUDA layer events for load(..., event_set=...): creates one interprocess event per layer on the current CUDA
        device (torch.cuda.current_device(): the GPU of this rank's KV buffers) and registers them with the daemon
        as a set. Close it (or use it as a context manager) after the last load naming it has ended. A geometry with
        tp_size > 1 needs every rank's events in one set: use the C++ API (CudaLayerEvents, RegisterLayerEvents).
        Raises Unimplemented with a libflexkv built without CUDA, FailedPrecondition when the daemon has no CUDA
        backend, InvalidArgument when num_layers is not the geometry's (a hybrid geometry: its total_layers, every
        component's layers in its layer_order())."""
        layers = c_uint(num_layers, "num_layers")
        events = ctypes.c_void_p(0)
        _lib.check(_lib.lib.flexkv_layer_events_create(layers, 0, ctypes.byref(events)), "layer events")
        set_id = ctypes.c_uint32(0)
        try:
            ranks = (ctypes.c_void_p * 1)(events)
            self._call(_lib.lib.flexkv_register_layer_events, ranks, 1, ctypes.byref(set_id))
        except BaseException:
            _lib.lib.flexkv_layer_events_free(events)
            raise
        return LayerEventSet(self, events, int(set_id.value), layers)

    def load(self, match_handle: int, block_ids: Any, layerwise: bool = False,
             event_set: Optional[Union["LayerEventSet", int]] = None, first_block: int = 0,
             launch_deadline: Optional[float] = None) -> Ticket:
        """Copies blocks [first_block, first_block + len(block_ids)) of a pinned match into these KV blocks
        (result.done_blocks, result.bytes): an engine holding the prefix's first first_block blocks on its GPU
        already loads only past them, and its blocks before are not touched. With layerwise, Ticket.wait_layers
        reports each layer as it lands. block_ids: sequence or integer array, each < the registered num_blocks
        (else the request ends with OutOfRange). first_block > 0 needs a flexkvd of ring layout 5 (else
        FailedPrecondition, nothing sent) and a libflexkv with flexkv_load_from (else Unimplemented).

        With event_set (a LayerEventSet, or its id), the daemon records the set's event of each layer on its copy
        stream right after that layer's copies, so the engine's stream waits without the CPU: call
        ticket.wait_launched(), then event_set.wait(layer, stream) before each layer's compute, then ticket.wait()
        as usual. A set serves one load at a time: a second load naming it while one is in flight ends with
        FailedPrecondition. Not together with layerwise.

        Hybrid models: block_ids is a list with one id sequence (or integer array) per component, component 0
        first, for the handle's prefix end e (result.matched_blocks of the match) past first_block k: e - k ids of
        component 0 (blocks [k, e)), min(window_blocks(i), e - k) ids of a sliding-window component (blocks
        [max(k, e - w), e)), 1 id of a state component (the state slot that receives the snapshot at e). Layer-wise
        (layerwise or event_set) its layers are every component's together in geometry.layer_order(): wait_layers(i
        + 1), or the set's event i, before computing the model layer that is entry i there (a component that moves
        nothing has landed at once; its events are not recorded, so a wait on them passes). Wrong counts raise
        InvalidArgument naming the component, its kind and the count expected
        (nothing is sent); a single flat id sequence on a hybrid session raises InvalidArgument too.

        launch_deadline: an absolute time.monotonic() value in seconds (CLOCK_MONOTONIC on Linux, the clock flexkvd
        reads on this node), None for none. flexkvd starts none of the load's copies after it: the load then ends
        with DeadlineExceeded ("not launched by its launch deadline; nothing was copied"), its pins released. So a
        caller that gives up on the load at that time (wait_launched or wait timed out there) knows no byte of it
        lands later in its blocks: what started before the deadline finishes promptly (wait for it), nothing starts
        after it. Needs a flexkvd of ring layout 6 (else FailedPrecondition, nothing sent) and a libflexkv with
        flexkv_load_by (else Unimplemented); a negative or non-finite value raises InvalidArgument."""
        handle = c_uint(match_handle, "match_handle", U64_MAX)
        first = c_uint(first_block, "first_block")
        if launch_deadline is not None:
            return self._load_by(handle, block_ids, layerwise, event_set, first, launch_deadline)
        if first != 0:
            _need_partial("load with first_block")
        if _per_component(block_ids):
            if layerwise or event_set is not None:
                return self._load_layered(handle, block_ids, layerwise, event_set, first, 0)
            ptrs, counts, n, _keep = _component_arrays(block_ids)
            if first != 0:
                return self._submit("load", _lib.lib.flexkv_load_components_from, handle, first, ptrs, counts, n)
            return self._submit("load", _lib.lib.flexkv_load_components, handle, ptrs, counts, n)
        ids, n = c_int_array(block_ids, ctypes.c_uint32, "block_ids")
        if first != 0:
            if layerwise and event_set is not None:
                raise InvalidArgument("load with both layerwise and event_set; expected one completion kind: the "
                                      "set's CUDA events or layer progress")
            set_id = 0 if event_set is None else \
                event_set.id if isinstance(event_set, LayerEventSet) else c_uint(event_set, "event_set")
            return self._submit("load", _lib.lib.flexkv_load_from, handle, first, ids, n, 1 if layerwise else 0,
                                set_id)
        if event_set is not None:
            if layerwise:
                raise InvalidArgument("load with both layerwise and event_set; expected one completion kind: the "
                                      "set's CUDA events or layer progress")
            set_id = event_set.id if isinstance(event_set, LayerEventSet) else c_uint(event_set, "event_set")
            return self._submit("load", _lib.lib.flexkv_load_with_events, handle, ids, n, set_id)
        return self._submit("load", _lib.lib.flexkv_load, handle, ids, n, 1 if layerwise else 0)

    def _load_layered(self, handle: int, block_ids: Any, layerwise: bool,
                      event_set: Optional[Union["LayerEventSet", int]], first: int, deadline_ns: int) -> Ticket:
        """A hybrid geometry's layer-wise load (layer progress or the set's events), through
        flexkv_load_components_layered."""
        if layerwise and event_set is not None:
            raise InvalidArgument("load with both layerwise and event_set; expected one completion kind: the "
                                  "set's CUDA events or layer progress")
        if not _lib.has_hybrid_layerwise:
            raise Unimplemented("a layer-wise load of a hybrid geometry: the libflexkv loaded has no "
                                "flexkv_load_components_layered (it predates hybrid layer-wise loads); expected a "
                                "newer libflexkv")
        set_id = 0 if event_set is None else \
            event_set.id if isinstance(event_set, LayerEventSet) else c_uint(event_set, "event_set")
        ptrs, counts, n, _keep = _component_arrays(block_ids)
        return self._submit("load", _lib.lib.flexkv_load_components_layered, handle, first, ptrs, counts, n,
                            1 if layerwise else 0, set_id, deadline_ns)

    def _load_by(self, handle: int, block_ids: Any, layerwise: bool,
                 event_set: Optional[Union["LayerEventSet", int]], first: int, launch_deadline: float) -> Ticket:
        """load with a launch deadline, through flexkv_load_by / flexkv_load_components_by."""
        if not isinstance(launch_deadline, numbers.Real) or isinstance(launch_deadline, bool) or \
                not math.isfinite(launch_deadline) or launch_deadline <= 0:
            raise InvalidArgument(f"launch_deadline {launch_deadline!r}; expected a time.monotonic() value in "
                                  "seconds (above 0), or None for none")
        if not _lib.has_launch_deadlines:
            raise Unimplemented("load with a launch_deadline: the libflexkv loaded has no flexkv_load_by (it "
                                "predates ring layout 6); expected a newer libflexkv")
        deadline_ns = min(int(launch_deadline * 1e9), (1 << 63) - 1)
        if _per_component(block_ids):
            if layerwise or event_set is not None:
                return self._load_layered(handle, block_ids, layerwise, event_set, first, deadline_ns)
            ptrs, counts, n, _keep = _component_arrays(block_ids)
            return self._submit("load", _lib.lib.flexkv_load_components_by, handle, first, ptrs, counts, n,
                                deadline_ns)
        if layerwise and event_set is not None:
            raise InvalidArgument("load with both layerwise and event_set; expected one completion kind: the "
                                  "set's CUDA events or layer progress")
        ids, n = c_int_array(block_ids, ctypes.c_uint32, "block_ids")
        set_id = 0 if event_set is None else \
            event_set.id if isinstance(event_set, LayerEventSet) else c_uint(event_set, "event_set")
        return self._submit("load", _lib.lib.flexkv_load_by, handle, first, ids, n, 1 if layerwise else 0, set_id,
                            deadline_ns)

    def store(self, keys: Union[BlockKeys, Iterable[Any]], block_ids: Any,
              state_boundaries: Optional[Any] = None, window_keys: int = 0) -> Ticket:
        """Stores block keys[i] from KV block block_ids[i], keys[0] under keys.parent: pass a slice of the prompt's
        keys (keys[20:30] hangs under keys[19]) so that a match of the prompt from its start reaches the blocks; a
        plain sequence of pairs starts a prompt. The part already cached under the parent is skipped
        (result.matched_blocks); result.done_blocks were newly stored. A block becomes matchable once its bytes are
        in. A store that could store only a prefix ends with ResourceExhausted (pool full of pinned blocks) or
        Aborted (another request is storing the next block); the exception's .result says how many were stored.
        Nothing is stored, and the store ends with FailedPrecondition, when the parent is not cached (evicted, or
        never stored: match the prompt and store from its first uncached block), or with Aborted when the parent's
        own store has not completed yet (wait for it first).

        Hybrid models: block_ids is a list with one id sequence per component, component 0 first: len(keys) ids of
        component 0, the ids of a sliding-window component for the last m keys, and for a state component one id
        per entry of state_boundaries (each in 1..len(keys), strictly increasing; boundary b = the snapshot after
        keys[b - 1]). m is window_keys, or min(window_blocks(i), len(keys)) when it is 0 (right-aligned: the
        trailing window); an engine that still holds more window blocks passes more (at least every window's
        min(window_blocks, len(keys)), at most len(keys)), so that every prefix end inside the store whose window
        (and state) is there becomes a hit (window_keys needs a flexkvd of ring layout 5, else FailedPrecondition).
        All or none: when a sub-pool cannot take its part nothing is stored (ResourceExhausted). Wrong counts or
        boundaries raise InvalidArgument naming what was wrong (nothing is sent)."""
        k = as_block_keys(keys)
        parent = None
        if k.parent is not None:
            parent = ctypes.byref(_lib.BlockKeyStruct(k.parent.lo, k.parent.hi))
        windows = c_uint(window_keys, "window_keys")
        if windows != 0 and not _per_component(block_ids):
            raise InvalidArgument("window_keys given with a single block id sequence; expected one id sequence per "
                                  "component (a hybrid geometry's store)")
        if _per_component(block_ids):
            ptrs, counts, n, _keep = _component_arrays(block_ids)
            bounds, n_bounds = c_int_array([] if state_boundaries is None else state_boundaries, ctypes.c_uint32,
                                           "state_boundaries")
            if windows != 0:
                _need_partial("store with window_keys")
                return self._submit("store", _lib.lib.flexkv_store_components_windows, parent, k._array, len(k), ptrs,
                                    counts, n, bounds, n_bounds, windows)
            return self._submit("store", _lib.lib.flexkv_store_components, parent, k._array, len(k), ptrs, counts, n,
                                bounds, n_bounds)
        if state_boundaries is not None and len(state_boundaries) > 0:
            raise InvalidArgument("state_boundaries given with a single block id sequence; expected one id sequence "
                                  "per component (a hybrid geometry's store)")
        ids, n = c_int_array(block_ids, ctypes.c_uint32, "block_ids")
        if len(k) != n or n == 0:
            raise InvalidArgument(f"{len(k)} keys and {n} source block ids; expected the same non-zero number")
        return self._submit("store", _lib.lib.flexkv_store, parent, k._array, ids, n)

    def release(self, match_handle: int) -> Ticket:
        """Drops the pins of a match handle."""
        handle = c_uint(match_handle, "match_handle", U64_MAX)
        ext = _native.ext
        if ext is not None:
            return self._submit_fast("release", ext.release, handle)
        return self._submit("release", _lib.lib.flexkv_release, handle)

    def match_via_control(self, keys: Union[BlockKeys, Iterable[Any]]) -> int:
        """The same lookup as match() without pin, as a unary gRPC call (~50x slower): for diagnostics."""
        k = as_block_keys(keys)
        matched = ctypes.c_uint32(0)
        self._call(_lib.lib.flexkv_match_via_control, k._array, len(k), ctypes.byref(matched))
        return int(matched.value)

    # ---- helpers ----

    def _call(self, fn: Any, *args: Any) -> None:
        ptr = self._handle.acquire()
        try:
            _lib.check(fn(ptr, *args))
        finally:
            self._handle.release()

    def _submit(self, op: str, fn: Any, *args: Any) -> Ticket:
        ticket = _lib.TicketStruct()
        ptr = self._handle.acquire()
        try:
            _lib.check(fn(ptr, *args, ctypes.byref(ticket)))
        finally:
            self._handle.release()
        return Ticket(self, ticket, op)

    def _submit_fast(self, op: str, fn: Any, *args: Any) -> Ticket:
        """_submit through the compiled fast path: fn(ptr, *args) -> (rc, id, generation)."""
        ptr = self._handle.acquire()
        try:
            rc, ticket_id, generation = fn(ptr, *args)
            if rc != 0:
                raise _lib.error_from_last(rc)
        finally:
            self._handle.release()
        return Ticket(self, None, op, ticket_id, generation)


def _describe_gpu_kv(regions: Sequence[Any], layout: Union[Layout, int], num_blocks: int, tp_rank: int,
                     region_bytes: Optional[int], component: int) -> Any:
    """flexkv_describe_gpu_kv with the checks of Client.register_gpu_kv; returns the flexkv_gpu_kv* (a c_void_p),
    which the caller frees with flexkv_gpu_kv_free."""
    lay = _layout(layout)
    n = c_uint(num_blocks, "num_blocks")
    tp = c_uint(tp_rank, "tp_rank")
    comp = c_uint(component, "component")
    items = list(regions)
    if not items:
        raise InvalidArgument("no KV regions given; expected one per layer (LAYER_FIRST, LAYER_BLOCK_REGIONS) or one")
    if lay not in (Layout.LAYER_FIRST, Layout.LAYER_BLOCK_REGIONS) and len(items) != 1:
        raise InvalidArgument(f"{len(items)} KV regions for layout {Layout(lay).name}; expected one (only "
                              "LAYER_FIRST and LAYER_BLOCK_REGIONS take one per layer)")
    described = [device_region(obj, i) for i, obj in enumerate(items)]
    sizes = {b for _, b in described if b is not None}
    if region_bytes is not None:
        sizes.add(c_uint(region_bytes, "region_bytes", U64_MAX))
    if len(sizes) != 1:
        if not sizes:
            raise InvalidArgument("region_bytes is needed when the regions are given as int pointers")
        raise InvalidArgument(f"KV regions have different sizes {sorted(sizes)} bytes; expected equal regions")
    size = sizes.pop()
    if not 0 <= size <= U64_MAX:  # a tensor's own size; always fits in practice
        raise InvalidArgument(f"KV regions of {size} bytes; expected at most {U64_MAX}")
    ptrs = (ctypes.c_void_p * len(described))(*[p for p, _ in described])
    kv = ctypes.c_void_p(0)
    _lib.check(_lib.lib.flexkv_describe_gpu_kv(lay, ptrs, len(described), size, n, tp, ctypes.byref(kv)))
    try:
        _lib.check(_lib.lib.flexkv_gpu_kv_set_component(kv, comp))
    except BaseException:
        _lib.lib.flexkv_gpu_kv_free(kv)
        raise
    return kv


def export_gpu_kv(regions: Sequence[Any], layout: Union[Layout, int], num_blocks: int, tp_rank: int = 0, *,
                  region_bytes: Optional[int] = None, component: int = 0) -> bytes:
    """CUDA backend, TP engines: describes this process's GPU KV buffers of one TP rank (the arguments of
    Client.register_gpu_kv) as bytes that the process attached for the engine registers with
    Client.register_exported_gpu_kv (flexkv_gpu_kv_export). Needs no daemon. The bytes carry CUDA IPC handles: this
    node only, and only while this process keeps the memory. Raises FailedPrecondition for cuMem/VMM memory
    (PyTorch's expandable segments: register it from this process instead), Unimplemented with a libflexkv built
    without CUDA, and what register_gpu_kv raises for bad regions."""
    kv = _describe_gpu_kv(regions, layout, num_blocks, tp_rank, region_bytes, component)
    try:
        size = ctypes.c_size_t(0)
        _lib.check(_lib.lib.flexkv_gpu_kv_export(kv, None, 0, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _lib.check(_lib.lib.flexkv_gpu_kv_export(kv, buf, size.value, ctypes.byref(size)))
        return buf.raw[:size.value]
    finally:
        _lib.lib.flexkv_gpu_kv_free(kv)


def _per_component(block_ids: Any) -> bool:
    """True when `block_ids` is a list or tuple of per-component id sequences (a hybrid geometry's load or store)
    rather than one flat sequence of ids."""
    if not isinstance(block_ids, (list, tuple)) or not block_ids:
        return False
    first = block_ids[0]
    if isinstance(first, (str, bytes)):
        return False
    try:
        operator.index(first)
        return False
    except TypeError:
        return True


def _need_partial(what: str) -> None:
    """Unimplemented when the libflexkv loaded lacks the ring layout 5 calls (flexkv_load_from and its kin)."""
    if not _lib.has_partial_loads:
        raise Unimplemented(f"{what}: the libflexkv loaded has no flexkv_load_from (it predates ring layout 5); "
                            "expected a newer libflexkv")


def _component_arrays(block_ids: Sequence[Any]) -> Tuple[Any, Any, int, list]:
    """The C arrays of flexkv_load_components / flexkv_store_components: (pointers, counts, n, the id arrays the
    pointers point into, which must outlive the call)."""
    arrays = [c_int_array(ids, ctypes.c_uint32, f"block_ids[{i}]") for i, ids in enumerate(block_ids)]
    u32_p = ctypes.POINTER(ctypes.c_uint32)
    ptrs = (u32_p * len(arrays))(*[ctypes.cast(a, u32_p) for a, _ in arrays])
    counts = (ctypes.c_size_t * len(arrays))(*[n for _, n in arrays])
    return ptrs, counts, len(arrays), arrays


def _layout(layout: Union[Layout, int]) -> int:
    """A layout as the C int; InvalidArgument, as libflexkv words it, for any other value (a C int would wrap
    2**32 + 1 to LAYER_FIRST)."""
    try:
        value = operator.index(layout)
    except TypeError:
        raise TypeError(f"layout is a {type(layout).__name__}; expected a flexkvd.Layout") from None
    if value not in _LAYOUTS:
        raise InvalidArgument(f"layout {value} is not valid; expected LAYER_FIRST (1), BLOCK_FIRST (2), "
                              "LAYER_BLOCK (3) or LAYER_BLOCK_REGIONS (4)")
    return value


_LAYOUTS = frozenset(int(v) for v in Layout)


def _c_string(text: Union[str, bytes, "os.PathLike[str]"], what: str) -> bytes:
    """`text` as a NUL-terminated C string's bytes; InvalidArgument for a NUL inside (C would cut it there)."""
    data = os.fsencode(text) if isinstance(text, os.PathLike) else text.encode() if isinstance(text, str) else \
        bytes(text)
    if b"\0" in data:
        raise InvalidArgument(f"{what} {text!r} contains a NUL character")
    return data


def connect(socket_path: Optional[str] = None, timeout: float = 5.0) -> Client:
    """Connects to flexkvd (flexkv::Client::Connect).

    socket_path: None: $FLEXKV_SOCKET, else the default socket of a flexkvd started by the same user.
    timeout: seconds to wait for a daemon that is not up yet (socket missing or refusing), 0 to 2147483 (the C
      ABI takes milliseconds in an int).
    Raises Unavailable (naming the socket and what to check) when no daemon answers in time; any other failure
    (permission denied, not a flexkvd) at once with its cause; InvalidArgument for a negative, NaN or too long
    timeout, or a NUL character in socket_path.
    """
    if not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout is a {type(timeout).__name__}; expected seconds as a number")
    if not 0 <= timeout <= INT_MAX / 1000:  # NaN fails this too
        raise InvalidArgument(f"timeout is {timeout} s; expected 0..{INT_MAX // 1000} s")
    out = _lib.client_p(None)
    path = None if socket_path is None else _c_string(socket_path, "socket_path")
    rc = _lib.lib.flexkv_connect(path, int(timeout * 1000), ctypes.byref(out), None, 0)
    if rc != 0:
        raise _lib.error_from_last(rc)
    return Client(int(out.value), None if socket_path is None else os.fsdecode(socket_path))


def _stream_handle(stream: Any) -> Optional[int]:
    """A cudaStream_t as an int: None (the legacy default stream), an int, or an object with .cuda_stream
    (torch.cuda.Stream, torch.cuda.ExternalStream)."""
    if stream is None:
        return None
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, numbers.Integral) or handle < 0:
        raise InvalidArgument(f"stream is {stream!r}; expected None, a cudaStream_t as an int, or an object with "
                              ".cuda_stream (torch.cuda.Stream)")
    return int(handle) or None


class LayerEventSet:
    """One interprocess CUDA event per layer, registered with the daemon (Client.layer_events). The events are
    destroyed and the set released by close() (or on leaving a with block); close it only after the last load
    naming it has ended (wait()). Not thread-safe against close()."""

    def __init__(self, client: Client, events: ctypes.c_void_p, set_id: int, num_layers: int):
        self._client = client
        self._events = events
        self.id = set_id
        self.num_layers = num_layers

    def wait(self, layer: int, stream: Any = None) -> None:
        """Makes `stream` (a torch.cuda.Stream, a cudaStream_t int, or None: the legacy default stream) wait for
        `layer` of the load this set serves (cudaStreamWaitEvent; the CPU does not wait). Call it only after that
        load's ticket.wait_launched() returned (docs/python.md, "Layer events")."""
        if not self._events:
            raise FailedPrecondition(f"layer-event set {self.id} is closed")
        layer = c_uint(layer, "layer")
        _lib.check(_lib.lib.flexkv_layer_events_stream_wait(self._events, layer, _stream_handle(stream)),
                   f"layer-event set {self.id}")

    def close(self) -> None:
        """Releases the set in the daemon and destroys the events. Idempotent."""
        events, self._events = self._events, None
        if not events:
            return
        try:
            self._client._call(_lib.lib.flexkv_release_layer_events, self.id)
        except Exception:  # the client was closed or the session ended meanwhile: the daemon forgot the set with it
            pass
        finally:
            _lib.lib.flexkv_layer_events_free(events)

    def __enter__(self) -> "LayerEventSet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LayerEventSet(id={self.id}, num_layers={self.num_layers}, {'open' if self._events else 'closed'})"
