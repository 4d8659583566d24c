"""Loads libflexkv and declares the C ABI (client/include/flexkv/c.h) for ctypes.

Why ctypes over the C ABI rather than a compiled extension: the package is pure Python, so one copy serves every
CPython >= 3.10 the engine runs (no per-version build, no compiler at install time), it loads into the engine's
own interpreter next to torch, and ctypes releases the GIL for the duration of every foreign call, so a thread
blocked in a wait does not stop the engine's other Python threads. The per-request calls have an optional compiled
twin (flexkvd._fast, found and bound by _native.py) that calls the functions of the library loaded here.

Where the library is looked for, first hit wins:
  1. $FLEXKV_LIBRARY (a path to libflexkv.so.0);
  2. next to the package: flexkv/libflexkv.so.0, then libflexkv.so.0 beside the flexkv/ directory;
  3. the system loader ("libflexkv.so.0": ld.so.cache, $LD_LIBRARY_PATH).

The library found must speak the C ABI declared here: its flexkv_abi_version() must be ABI_VERSION and its
flexkv_struct_size() must agree with every Structure below, or the import fails with ImportError saying what
differs (a libflexkv from another build would otherwise read and write structs of another size).
"""
from __future__ import annotations

import ctypes
import os
from ctypes import (POINTER, Structure, c_char, c_char_p, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64,
                    c_void_p)
from typing import List

from .errors import Error, error_for

SONAME = "libflexkv.so.0"
# FLEXKV_ABI_VERSION of the client/include/flexkv/c.h that the declarations below mirror.
ABI_VERSION = 6


class BlockKeyStruct(Structure):
    _fields_ = [("lo", c_uint64), ("hi", c_uint64)]


class ComponentStruct(Structure):
    _fields_ = [("kind", c_uint32), ("num_layers", c_uint32), ("kv_planes", c_uint32), ("kv_heads_per_rank", c_uint32),
                ("head_dim", c_uint32), ("dtype_bytes", c_uint32), ("window_tokens", c_uint32),
                ("reserved", c_uint32), ("state_bytes_per_layer", c_uint64)]


class GeometryStruct(Structure):
    _fields_ = [("tokens_per_block", c_uint32), ("num_layers", c_uint32), ("kv_planes", c_uint32),
                ("kv_heads_per_rank", c_uint32), ("head_dim", c_uint32), ("dtype_bytes", c_uint32),
                ("tp_size", c_uint32), ("n_components", c_uint32), ("components", POINTER(ComponentStruct))]


class DaemonStatusStruct(Structure):
    _fields_ = [("state", c_char * 16), ("version", c_char * 32), ("pid", c_uint32), ("uptime_s", c_uint64),
                ("block_bytes", c_uint64), ("capacity_blocks", c_uint64), ("used_blocks", c_uint64),
                ("pinned_blocks", c_uint64), ("index_blocks", c_uint64), ("sessions", c_uint32)]


class ComponentStatusStruct(Structure):
    _fields_ = [("kind", c_uint32), ("reserved", c_uint32), ("slot_bytes", c_uint64), ("capacity", c_uint64),
                ("used", c_uint64), ("pinned", c_uint64), ("evicted", c_uint64), ("unanchored", c_uint64)]


class OpResultStruct(Structure):
    _fields_ = [("status_code", c_int32), ("matched_blocks", c_uint32), ("done_blocks", c_uint32),
                ("match_handle", c_uint64), ("message", c_char * 256), ("bytes", c_uint64), ("source", c_char * 96)]


class TicketStruct(Structure):
    _fields_ = [("id", c_uint64), ("generation", c_uint64)]


# The C name of each struct, as flexkv_struct_size knows it.
STRUCTS = {"flexkv_geometry": GeometryStruct, "flexkv_component": ComponentStruct,
           "flexkv_daemon_status": DaemonStatusStruct, "flexkv_component_status": ComponentStatusStruct,
           "flexkv_block_key": BlockKeyStruct, "flexkv_op_result": OpResultStruct, "flexkv_ticket": TicketStruct}


def _candidates() -> List[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = []
    env = os.environ.get("FLEXKV_LIBRARY")
    if env:
        paths.append(env)
    paths.append(os.path.join(here, SONAME))
    paths.append(os.path.join(os.path.dirname(here), SONAME))
    paths.append(SONAME)
    return paths


def _load() -> ctypes.CDLL:
    tried = []
    env = os.environ.get("FLEXKV_LIBRARY")
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} (no such file)")
            if path == env:  # an explicit choice that does not exist is an error, not a hint to look elsewhere
                break
            continue
        try:
            return ctypes.CDLL(path)  # CDLL (not PyDLL): every call releases the GIL
        except OSError as e:
            tried.append(f"{path} ({e})")
            if path == env:
                break
    raise ImportError("flexkv: cannot load libflexkv; tried " + "; ".join(tried) +
                      ". Set FLEXKV_LIBRARY to the path of libflexkv.so.0 (build/libflexkv.so.0 in a build tree).")


def verify_abi(library: ctypes.CDLL, path: str) -> None:
    """Raises ImportError, saying what differs, unless `library` (loaded from `path`) speaks this package's C ABI:
    the same ABI_VERSION and the same size for every struct in STRUCTS."""
    hint = ("use the libflexkv built from the same source as this package (build/libflexkv.so.0 in a build tree; "
            "FLEXKV_LIBRARY names it)")
    try:
        abi_version = library.flexkv_abi_version
        struct_size = library.flexkv_struct_size
    except AttributeError:
        raise ImportError(f"flexkv: {path} has no flexkv_abi_version(): it is older than the C ABI version "
                          f"{ABI_VERSION} this package speaks; {hint}") from None
    abi_version.restype, abi_version.argtypes = c_uint32, []
    struct_size.restype, struct_size.argtypes = c_size_t, [c_char_p]
    theirs = int(abi_version())
    if theirs != ABI_VERSION:
        raise ImportError(f"flexkv: {path} speaks C ABI version {theirs}; this package speaks version {ABI_VERSION}; "
                          f"{hint}")
    for name, struct in STRUCTS.items():
        size = int(struct_size(name.encode()))
        if size != ctypes.sizeof(struct):
            raise ImportError(f"flexkv: struct {name} is {size} bytes in {path} but {ctypes.sizeof(struct)} bytes in "
                              f"this package (both say C ABI version {ABI_VERSION}); {hint}")


lib = _load()
verify_abi(lib, lib._name)
client_p = c_void_p
gpu_kv_p = c_void_p

_PROTOTYPES = {
    "flexkv_compute_block_keys": (c_int, [c_char_p, c_size_t, POINTER(c_int32), c_size_t, c_uint32,
                                          POINTER(BlockKeyStruct), c_size_t, POINTER(c_size_t)]),
    "flexkv_compute_block_keys_extra": (c_int, [c_char_p, c_size_t, POINTER(c_int32), c_size_t, c_uint32, c_char_p,
                                                c_size_t, POINTER(BlockKeyStruct), c_size_t, POINTER(c_size_t)]),
    "flexkv_connect": (c_int, [c_char_p, c_int, POINTER(client_p), c_char_p, c_size_t]),
    "flexkv_attach": (c_int, [client_p, c_char_p, c_char_p, c_uint32, c_uint32, POINTER(GeometryStruct),
                              POINTER(c_uint64)]),
    "flexkv_detach": (c_int, [client_p]),
    "flexkv_session_component": (c_int, [client_p, c_uint32, POINTER(c_uint64), POINTER(c_uint64)]),
    "flexkv_get_status": (c_int, [client_p, POINTER(DaemonStatusStruct)]),
    "flexkv_get_status_components": (c_int, [client_p, POINTER(ComponentStatusStruct), c_size_t,
                                             POINTER(c_size_t)]),
    "flexkv_drain": (c_int, [client_p, c_char_p, c_size_t]),
    "flexkv_resume": (c_int, [client_p, c_char_p, c_size_t]),
    "flexkv_check_health": (c_int, [client_p]),
    "flexkv_create_host_kv": (c_int, [client_p, c_int, c_uint32, POINTER(c_void_p), POINTER(c_uint64)]),
    "flexkv_create_host_kv_component": (c_int, [client_p, c_uint32, c_int, c_uint32, POINTER(c_void_p),
                                                POINTER(c_uint64)]),
    "flexkv_describe_gpu_kv": (c_int, [c_int, POINTER(c_void_p), c_size_t, c_uint64, c_uint32, c_uint32,
                                       POINTER(gpu_kv_p)]),
    "flexkv_gpu_kv_uuid": (c_char_p, [gpu_kv_p]),
    "flexkv_gpu_kv_set_component": (c_int, [gpu_kv_p, c_uint32]),
    "flexkv_register_gpu_kv": (c_int, [client_p, gpu_kv_p]),
    "flexkv_gpu_kv_free": (None, [gpu_kv_p]),
    "flexkv_gpu_kv_export": (c_int, [gpu_kv_p, c_void_p, c_size_t, POINTER(c_size_t)]),
    "flexkv_gpu_kv_import": (c_int, [c_char_p, c_size_t, POINTER(gpu_kv_p)]),
    "flexkv_match": (c_int, [client_p, POINTER(BlockKeyStruct), c_size_t, c_int, POINTER(TicketStruct)]),
    "flexkv_prefetch": (c_int, [client_p, POINTER(BlockKeyStruct), c_size_t, POINTER(TicketStruct)]),
    "flexkv_load": (c_int, [client_p, c_uint64, POINTER(c_uint32), c_size_t, c_int, POINTER(TicketStruct)]),
    "flexkv_store": (c_int, [client_p, POINTER(BlockKeyStruct), POINTER(BlockKeyStruct), POINTER(c_uint32),
                             c_size_t, POINTER(TicketStruct)]),
    "flexkv_load_components": (c_int, [client_p, c_uint64, POINTER(POINTER(c_uint32)), POINTER(c_size_t), c_size_t,
                                       POINTER(TicketStruct)]),
    "flexkv_store_components": (c_int, [client_p, POINTER(BlockKeyStruct), POINTER(BlockKeyStruct), c_size_t,
                                        POINTER(POINTER(c_uint32)), POINTER(c_size_t), c_size_t, POINTER(c_uint32),
                                        c_size_t, POINTER(TicketStruct)]),
    "flexkv_release": (c_int, [client_p, c_uint64, POINTER(TicketStruct)]),
    "flexkv_match_via_control": (c_int, [client_p, POINTER(BlockKeyStruct), c_size_t, POINTER(c_uint32)]),
    "flexkv_wait": (c_int, [client_p, TicketStruct, c_int64, POINTER(OpResultStruct)]),
    "flexkv_try_wait": (c_int, [client_p, TicketStruct, POINTER(OpResultStruct)]),
    "flexkv_wait_layers": (c_int, [client_p, TicketStruct, c_uint32, c_int64, POINTER(c_uint32)]),
    "flexkv_layer_events_create": (c_int, [c_uint32, c_uint32, POINTER(c_void_p)]),
    "flexkv_layer_events_stream_wait": (c_int, [c_void_p, c_uint32, c_void_p]),
    "flexkv_layer_events_free": (None, [c_void_p]),
    "flexkv_register_layer_events": (c_int, [client_p, POINTER(c_void_p), c_size_t, POINTER(c_uint32)]),
    "flexkv_release_layer_events": (c_int, [client_p, c_uint32]),
    "flexkv_load_with_events": (c_int, [client_p, c_uint64, POINTER(c_uint32), c_size_t, c_uint32,
                                        POINTER(TicketStruct)]),
    "flexkv_wait_launched": (c_int, [client_p, TicketStruct, c_int64]),
    "flexkv_version": (c_char_p, []),
    "flexkv_last_error": (c_char_p, []),
    "flexkv_close": (None, [client_p]),
}

for _name, (_restype, _argtypes) in _PROTOTYPES.items():
    _fn = getattr(lib, _name)  # AttributeError here: a libflexkv older than this package
    _fn.restype = _restype
    _fn.argtypes = _argtypes


class KvEventStruct(Structure):
    _fields_ = [("seq", c_uint64), ("key", BlockKeyStruct), ("parent", BlockKeyStruct), ("tokens_per_block", c_uint32),
                ("kind", ctypes.c_uint8), ("tier", ctypes.c_uint8), ("component", ctypes.c_uint8),
                ("reserved", ctypes.c_uint8),
                ("model_namespace", c_char * 260), ("cause", c_char * 20)]


class KvBatchStruct(Structure):
    _fields_ = [("instance_id", c_uint64), ("started_unix_ms", c_uint64), ("snapshot_seq", c_uint64),
                ("head_seq", c_uint64), ("position", c_uint64), ("snapshot", ctypes.c_uint8),
                ("snapshot_end", ctypes.c_uint8), ("reserved", ctypes.c_uint8 * 6), ("n_events", c_size_t)]


kv_subscription_p = c_void_p
# The KV event subscription (flexkv/kv_events.h): added without an ABI bump, so a library without it still loads the
# package; flexkvd.subscribe_kv_events then raises Unimplemented.
_KV_PROTOTYPES = {
    "flexkv_kv_subscribe": (c_int, [c_char_p, c_int, c_uint32, c_int, POINTER(kv_subscription_p)]),
    "flexkv_kv_next": (c_int, [kv_subscription_p, POINTER(KvBatchStruct), POINTER(KvEventStruct), c_size_t]),
    "flexkv_kv_cancel": (None, [kv_subscription_p]),
    "flexkv_kv_close": (None, [kv_subscription_p]),
}
has_kv_events = all(hasattr(lib, name) for name in _KV_PROTOTYPES) and \
    int(lib.flexkv_struct_size(b"flexkv_kv_event")) == ctypes.sizeof(KvEventStruct) and \
    int(lib.flexkv_struct_size(b"flexkv_kv_batch")) == ctypes.sizeof(KvBatchStruct)
if has_kv_events:
    for _name, (_restype, _argtypes) in _KV_PROTOTYPES.items():
        _fn = getattr(lib, _name)
        _fn.restype = _restype
        _fn.argtypes = _argtypes


class KvEventsStatusStruct(Structure):
    _fields_ = [("instance_id", c_uint64), ("last_seq", c_uint64), ("subscribers", c_uint32), ("reserved", c_uint32),
                ("cut_off", c_uint64), ("buffer_events", c_uint64)]


class ClusterStatusStruct(Structure):
    _fields_ = [("present", c_uint32), ("reserved", c_uint32), ("epoch", c_uint64), ("state", c_char * 160),
                ("node_id", c_char * 72), ("endpoint", c_char * 72)]


class ClusterMemberStruct(Structure):
    _fields_ = [("epoch", c_uint64), ("self", c_uint32), ("reserved", c_uint32), ("node_id", c_char * 72),
                ("endpoint", c_char * 72)]


# flexkv_get_status_routing (the KV event and cluster parts of the status): added without an ABI bump, so a library
# without it still loads the package; DaemonStatus.kv_events and .cluster are then None.
has_status_routing = hasattr(lib, "flexkv_get_status_routing") and all(
    int(lib.flexkv_struct_size(name)) == ctypes.sizeof(struct)
    for name, struct in ((b"flexkv_kv_events_status", KvEventsStatusStruct),
                         (b"flexkv_cluster_status", ClusterStatusStruct),
                         (b"flexkv_cluster_member", ClusterMemberStruct)))
if has_status_routing:
    lib.flexkv_get_status_routing.restype = c_int
    lib.flexkv_get_status_routing.argtypes = [client_p, POINTER(DaemonStatusStruct), POINTER(KvEventsStatusStruct),
                                              POINTER(ClusterStatusStruct), POINTER(ClusterMemberStruct), c_size_t,
                                              POINTER(c_size_t)]


def _bind_optional(prototypes: dict) -> bool:
    """Functions added without an ABI bump: sets their prototypes when the library has every one of them (then
    True); an older library lacks them and the package still loads (the callers raise Unimplemented)."""
    if not all(hasattr(lib, name) for name in prototypes):
        return False
    for name, (restype, argtypes) in prototypes.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return True


# Loads past the engine's own prefix and stores of more window blocks (ring layout 5): added without an ABI bump, so a
# library without them still loads the package; load(first_block > 0) and store(window_keys > 0) then raise
# Unimplemented.
_PARTIAL_PROTOTYPES = {
    "flexkv_load_from": (c_int, [client_p, c_uint64, c_uint32, POINTER(c_uint32), c_size_t, c_int, c_uint32,
                                 POINTER(TicketStruct)]),
    "flexkv_load_components_from": (c_int, [client_p, c_uint64, c_uint32, POINTER(POINTER(c_uint32)),
                                            POINTER(c_size_t), c_size_t, POINTER(TicketStruct)]),
    "flexkv_store_components_windows": (c_int, [client_p, POINTER(BlockKeyStruct), POINTER(BlockKeyStruct), c_size_t,
                                                POINTER(POINTER(c_uint32)), POINTER(c_size_t), c_size_t,
                                                POINTER(c_uint32), c_size_t, c_uint32, POINTER(TicketStruct)]),
}
has_partial_loads = _bind_optional(_PARTIAL_PROTOTYPES)

# Loads with a launch deadline (ring layout 6): added without an ABI bump, so a library without them still loads the
# package; load(launch_deadline=...) then raises Unimplemented.
_DEADLINE_PROTOTYPES = {
    "flexkv_load_by": (c_int, [client_p, c_uint64, c_uint32, POINTER(c_uint32), c_size_t, c_int, c_uint32, c_int64,
                               POINTER(TicketStruct)]),
    "flexkv_load_components_by": (c_int, [client_p, c_uint64, c_uint32, POINTER(POINTER(c_uint32)),
                                          POINTER(c_size_t), c_size_t, c_int64, POINTER(TicketStruct)]),
}
has_launch_deadlines = _bind_optional(_DEADLINE_PROTOTYPES)


# Layer-wise loads of hybrid geometries: added without an ABI bump (an older library lacks them; a layer-wise hybrid
# load and Geometry.layer_order then raise Unimplemented).
_HYBRID_LAYERWISE_PROTOTYPES = {
    "flexkv_load_components_layered": (c_int, [client_p, c_uint64, c_uint32, POINTER(POINTER(c_uint32)),
                                               POINTER(c_size_t), c_size_t, c_int, c_uint32, c_int64,
                                               POINTER(TicketStruct)]),
    "flexkv_layer_order": (c_int, [POINTER(GeometryStruct), POINTER(c_uint32), POINTER(c_uint32), c_size_t,
                                   POINTER(c_size_t)]),
}
has_hybrid_layerwise = _bind_optional(_HYBRID_LAYERWISE_PROTOTYPES)

# flexkv_namespace_hash: added without an ABI bump (an older library lacks it; namespace_hash then raises).
has_namespace_hash = hasattr(lib, "flexkv_namespace_hash")
if has_namespace_hash:
    lib.flexkv_namespace_hash.restype = c_uint64
    lib.flexkv_namespace_hash.argtypes = [c_char_p, c_size_t]


def version() -> str:
    """libflexkv's release version (the project version it was built as): the package's __version__."""
    return lib.flexkv_version().decode()


def last_error() -> str:
    """The calling thread's last libflexkv failure as "CODE_NAME: message" ("" after a success)."""
    raw = lib.flexkv_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def error_from_last(rc: int, context: str = "") -> Error:
    """The exception for a libflexkv call that returned `rc` on this thread, with flexkv_last_error()'s message
    (without its "CODE_NAME: " prefix, which the exception's code carries)."""
    text = last_error()
    head, sep, rest = text.partition(": ")
    message = rest if sep and head.replace("_", "").isalpha() and head.isupper() else text
    if context:
        message = f"{context}: {message}"
    return error_for(rc, message)


def check(rc: int, context: str = "") -> None:
    """Raises the exception for `rc` unless it is 0 (OK)."""
    if rc != 0:
        raise error_from_last(rc, context)
