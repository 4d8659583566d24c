"""flexkvd: the Python client of flexkvd, the node-local KV-cache daemon (a ctypes binding of libflexkv's C ABI).

    import flexkvd
    with flexkvd.connect() as client:                          # $FLEXKV_SOCKET, else the default socket
        client.attach("vllm-dp0", "llama3-8b", flexkvd.Geometry.llama3_8b())
        keys = flexkvd.block_keys("llama3-8b", prompt_token_ids, 16)
        hit = client.match(keys, pin=True).wait()

See docs/python.md for the whole API and its contracts.
"""
from . import _lib, _native
from .client import (Client, ClusterMember, ClusterStatus, ComponentPoolStatus, DaemonStatus, KvEventsStatus,
                     LayerEventSet, OpResult, Ticket, connect, export_gpu_kv)
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, Error, FailedPrecondition,
                     Internal, InvalidArgument, NotFound, OutOfRange, PermissionDenied, ResourceExhausted, StatusCode,
                     Unauthenticated, Unavailable, Unimplemented, Unknown)
from .geometry import ComponentKind, ComponentSpec, Geometry, Layout
from .keys import BlockExtras, BlockKey, BlockKeys, block_keys
from .kv_events import KvEvent, KvEventBatch, KvEventSubscription, subscribe_kv_events

_native.load()
fast_path: str = _native.path
"""The compiled fast path in use (the path of flexkvd/_fast*.so; docs/python.md "Fast path"), or "" when the package
runs on ctypes alone (flexkvd._native.reason says why). Results and errors are the same either way."""

__version__ = _lib.version()  # libflexkv's, from CMake's project(): the version is written in one place

__all__ = [
    "Aborted", "AlreadyExists", "BlockExtras", "BlockKey", "BlockKeys", "Cancelled", "Client", "ClusterMember",
    "ClusterStatus", "ComponentKind", "ComponentPoolStatus", "ComponentSpec", "DaemonStatus", "DataLoss",
    "DeadlineExceeded", "Error", "FailedPrecondition", "Geometry", "Internal", "InvalidArgument", "KvEvent",
    "KvEventBatch", "KvEventSubscription", "KvEventsStatus", "LayerEventSet", "Layout", "NotFound", "OpResult",
    "OutOfRange", "PermissionDenied", "ResourceExhausted", "StatusCode", "Ticket", "Unauthenticated", "Unavailable",
    "Unimplemented", "Unknown", "block_keys", "connect", "export_gpu_kv", "fast_path", "subscribe_kv_events"
]
