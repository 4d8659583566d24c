"""flexkvd as an SGLang HiCache storage backend (the L3 tier under SGLang's host pool), loaded dynamically:

    python -m sglang.launch_server ... --page-size 64 --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "flexkvd", "module_path": "flexkvd.integrations.sglang", "class_name": "FlexKVdStorage",
          "interface_v1": 1, "socket": "/run/flexkvd/flexkvd.sock"}'

Importing this module needs neither SGLang nor torch; asking for FlexKVdStorage imports SGLang and raises
ImportError saying so when it is missing. The logic is in plain classes (BackendConfig here, PageStore and
HostPoolLayout in _sglang_store.py / _sglang_layout.py) that the thin FlexKVdStorage adapter calls; how keys,
copies, TP ranks and failures are handled is written there and in docs/integrations.md ("## SGLang").
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Dict, List, Mapping, Optional

from ..errors import InvalidArgument
from ._sglang_layout import HostPoolLayout
from ._sglang_store import PageStore, PageStoreStats, page_block_key

# FlexKVdStorage (the SGLang class, built on first use by __getattr__) is not in __all__: `import *` must not need
# SGLang.
__all__ = ["BackendConfig", "HostPoolLayout", "PageStore", "PageStoreStats", "page_block_key"]

logger = logging.getLogger(__name__)

# Extra-config keys this backend reads, with their defaults (docs/integrations.md lists them).
_OPTIONS: Dict[str, Any] = {
    "socket": None,               # flexkvd's socket; None: $FLEXKV_SOCKET, else the default
    "namespace": None,            # the cache domain; None: "sglang/<served model name>"
    "staging_pages": 64,          # pages of the staging area shared with flexkvd
    "connect_timeout_s": 1.0,     # one connect attempt
    "op_timeout_s": 30.0,         # every wait on the daemon
    "backoff_initial_s": 0.5,     # reconnect backoff, doubling up to backoff_max_s
    "backoff_max_s": 30.0,
}
# Keys SGLang's loader and HiCache themselves read from the same dict (hicache_storage_pass_prefix_keys and the
# prefetch_* keys are popped before the backend sees the dict; listed for older SGLang versions that do not).
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "allocator",
                          "hicache_storage_pass_prefix_keys", "prefetch_threshold", "prefetch_timeout_base",
                          "prefetch_timeout_per_ki_token", "storage_batch_size"})
_HOST_POOLS = ("MHATokenToKVPoolHost", "MLATokenToKVPoolHost")


@dataclasses.dataclass(frozen=True)
class BackendConfig:
    """What one SGLang rank's backend connects as, from SGLang's HiCacheStorageConfig fields and extra config.

    TP. flexkvd's host backend registers whole blocks (tp_size 1), so each TP rank of a K/V model stores its own
    head shard in a namespace of its own ("<namespace>@tp<rank>of<size>"); the daemon needs --max-domains at least
    the number of namespaces (tp_size x pp_size x cp_size). SGLang reduces the hit counts of all ranks with a MIN,
    so a page counts only when every rank has its shard. MLA KV is the same on every rank: one namespace, written
    by rank 0 only (SGLang skips the backup on the others) and read by all. Attention DP replicas share a namespace.
    """

    namespace: str
    session_name: str
    socket: Optional[str]
    staging_pages: int
    connect_timeout_s: float
    op_timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float
    zero_copy_interface: bool  # SGLang calls batch_get_v1 / batch_set_v1 (extra config "interface_v1": 1)

    @classmethod
    def from_fields(cls, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                    attn_cp_rank: int = 0, attn_cp_size: int = 1, dp_rank: int = 0, is_mla_model: bool = False,
                    model_name: Optional[str] = None, extra_config: Optional[Mapping[str, Any]] = None
                    ) -> "BackendConfig":
        """InvalidArgument naming the key for a malformed extra-config value; unknown keys are logged, not
        refused (SGLang adds its own)."""
        extra = dict(extra_config or {})
        unknown = sorted(k for k in extra if k not in _OPTIONS and k not in _SGLANG_KEYS)
        if unknown:
            logger.warning("flexkvd HiCache backend ignores extra-config keys %s (it reads %s)", unknown,
                           sorted(_OPTIONS))
        opts = {k: extra.get(k, v) for k, v in _OPTIONS.items()}
        namespace = opts["namespace"] or f"sglang/{model_name or 'model'}"
        if not isinstance(namespace, str):
            raise InvalidArgument(f"extra config namespace is a {type(namespace).__name__}; expected a string")
        if not is_mla_model and tp_size > 1:
            namespace += f"@tp{tp_rank}of{tp_size}"
        if pp_size > 1:
            namespace += f"@pp{pp_rank}of{pp_size}"
        if attn_cp_size > 1:
            namespace += f"@cp{attn_cp_rank}of{attn_cp_size}"
        socket = opts["socket"] if opts["socket"] is not None else os.environ.get("FLEXKV_SOCKET")
        if socket is not None and not isinstance(socket, str):
            raise InvalidArgument(f"extra config socket is a {type(socket).__name__}; expected a path")
        staging = opts["staging_pages"]
        if not isinstance(staging, int) or isinstance(staging, bool) or staging < 1:
            raise InvalidArgument(f"extra config staging_pages is {staging!r}; expected a whole number >= 1")
        seconds = {}
        for key in ("connect_timeout_s", "op_timeout_s", "backoff_initial_s", "backoff_max_s"):
            value = opts[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgument(f"extra config {key} is {value!r}; expected seconds > 0")
            seconds[key] = float(value)
        return cls(namespace=namespace, session_name=f"sglang-dp{dp_rank}-tp{tp_rank}-pp{pp_rank}", socket=socket,
                   staging_pages=staging, zero_copy_interface=bool(extra.get("interface_v1", 0)), **seconds)

    def open_store(self, pool: HostPoolLayout) -> PageStore:
        """The PageStore of this rank over `pool` (connects now; a daemon that is not up is retried later)."""
        return PageStore(pool, self.namespace, socket_path=self.socket, staging_pages=self.staging_pages,
                         name=self.session_name, connect_timeout_s=self.connect_timeout_s,
                         op_timeout_s=self.op_timeout_s, backoff_initial_s=self.backoff_initial_s,
                         backoff_max_s=self.backoff_max_s)


def __getattr__(name: str) -> Any:
    """FlexKVdStorage is built on first use, so that importing this module does not import SGLang."""
    if name == "FlexKVdStorage":
        cls = _backend_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _backend_class() -> type:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except ImportError as e:
        raise ImportError(
            "flexkvd.integrations.sglang.FlexKVdStorage is an SGLang HiCache storage backend and needs SGLang "
            f"(sglang.srt.mem_cache.hicache_storage), which could not be imported: {e}. Install SGLang in this "
            "environment; the backend's logic (BackendConfig, PageStore) works without it.") from e
    import numpy as np
    import torch

    def host_pool_layout(pool: Any) -> HostPoolLayout:
        kind = type(pool).__name__
        if kind not in _HOST_POOLS or getattr(pool, "kv_buffer", None) is None:
            raise InvalidArgument(f"flexkvd HiCache backend supports the host pools {', '.join(_HOST_POOLS)}; "
                                  f"got {kind} (hybrid, sparse and split-buffer pools are not supported)")
        kv = pool.kv_buffer
        kv_bytes = kv.view(torch.uint8).numpy()
        return HostPoolLayout(kv_bytes, pool.layout, pool.page_size, kind == "MLATokenToKVPoolHost",
                              kv.element_size())

    def as_bytes(t: Any) -> np.ndarray:
        if isinstance(t, torch.Tensor):
            return t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
        return np.asarray(t).reshape(-1).view(np.uint8)

    class FlexKVdStorage(HiCacheStorage):
        """SGLang's HiCacheStorage over flexkvd; each call goes to a PageStore (thread-safe, never raises for an
        unreachable daemon: misses instead)."""

        def __init__(self, storage_config: Any, kwargs: Optional[Dict[str, Any]] = None) -> None:
            self.config = BackendConfig.from_fields(
                tp_rank=storage_config.tp_rank, tp_size=storage_config.tp_size, pp_rank=storage_config.pp_rank,
                pp_size=storage_config.pp_size, attn_cp_rank=getattr(storage_config, "attn_cp_rank", 0),
                attn_cp_size=getattr(storage_config, "attn_cp_size", 1),
                dp_rank=getattr(storage_config, "dp_rank", 0), is_mla_model=storage_config.is_mla_model,
                model_name=storage_config.model_name, extra_config=storage_config.extra_config)
            if not self.config.zero_copy_interface:
                logger.warning("flexkvd HiCache backend: extra config has no \"interface_v1\": 1, so SGLang uses "
                               "the generic get/set path (one more copy per page); add it for batch_get_v1 / "
                               "batch_set_v1")
            self.store: Optional[PageStore] = None

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            super().register_mem_pool_host(mem_pool_host)
            if self.store is not None:
                self.store.close()
            self.store = self.config.open_store(host_pool_layout(mem_pool_host))

        def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
            return self.store.batch_exists(keys) if self.store is not None and keys else 0

        def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
            if self.store is None:
                return [False] * len(keys)
            return self.store.batch_get(keys, host_indices.cpu().numpy())

        def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
            if self.store is None:
                return [False] * len(keys)
            return self.store.batch_set(keys, host_indices.cpu().numpy())

        def exists(self, key: str) -> bool:
            return self.batch_exists([key]) == 1

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            return self.batch_get([key], None if target_location is None else [target_location])[0]

        def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
            if self.store is None:
                return [None] * len(keys)
            targets = list(target_locations) if target_locations is not None else [None] * len(keys)
            if any(isinstance(t, torch.Tensor) and (t.device.type != "cpu" or not t.is_contiguous())
                   for t in targets):
                raise InvalidArgument("get targets must be contiguous CPU tensors (SGLang's dummy flat pages)")
            arrays = [None if t is None else as_bytes(t) for t in targets]
            pages = self.store.get_flat(keys, arrays)
            out: List[Any] = []
            for t, page in zip(targets, pages):
                if page is None:
                    out.append(None)
                elif t is not None:
                    out.append(t)
                else:
                    out.append(torch.from_numpy(page).view(self.mem_pool_host.dtype))
            return out

        def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
            return value is not None and self.batch_set([key], [value])

        def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:
            if self.store is None or values is None or any(v is None for v in values):
                return False
            return all(self.store.set_flat(keys, [as_bytes(v) for v in values]))

        def clear(self) -> None:
            # A client cannot delete blocks: they belong to the cache domain, shared with every engine in it, and
            # leave by LRU eviction; an administrator drops a whole domain (flexkvctl drop-domain) once no engine
            # is attached.
            logger.warning("flexkvd HiCache backend: clear() keeps the blocks in flexkvd (namespace %r); they are "
                           "evicted by LRU, or dropped as a whole with `flexkvctl drop-domain` once no engine is "
                           "attached", self.config.namespace)

        def get_stats(self) -> Any:
            metrics = _storage_metrics()
            if self.store is not None:
                s = self.store.take_samples()
                metrics.prefetch_pgs.extend(s.prefetch_pgs)
                metrics.backup_pgs.extend(s.backup_pgs)
                metrics.prefetch_bandwidth.extend(s.prefetch_bandwidth)
                metrics.backup_bandwidth.extend(s.backup_bandwidth)
            return metrics

        def close(self) -> None:
            if self.store is not None:
                self.store.close()

    return FlexKVdStorage


class _SampledStorageMetrics:
    """What SGLang's collector reads of a backend's get_stats (StorageMetrics' lists), for an SGLang whose
    StorageMetrics this module cannot find."""

    def __init__(self) -> None:
        self.prefetch_pgs: List[int] = []
        self.backup_pgs: List[int] = []
        self.prefetch_bandwidth: List[float] = []
        self.backup_bandwidth: List[float] = []


def _storage_metrics() -> Any:
    """A new SGLang StorageMetrics: from sglang.srt.metrics.collector (before 0.5.15), else from the module that
    defines HiCacheStorage (which names it in its get_stats), else a stand-in with the same lists."""
    try:
        from sglang.srt.metrics.collector import StorageMetrics
        return StorageMetrics()
    except ImportError:
        pass
    import sys
    base = sys.modules.get("sglang.srt.mem_cache.hicache_storage")
    cls = getattr(base, "StorageMetrics", None) if base is not None else None
    if cls is not None:
        return cls()
    return _SampledStorageMetrics()
