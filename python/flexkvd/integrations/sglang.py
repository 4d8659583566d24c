"""flexkvd as an SGLang HiCache storage backend (the L3 tier under SGLang's host pool), loaded dynamically:

    python -m sglang.launch_server ... --page-size 64 --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "flexkvd", "module_path": "flexkvd.integrations.sglang", "class_name": "FlexKVdStorage",
          "interface_v1": 1, "socket": "/run/flexkvd/flexkvd.sock"}'

Importing this module needs neither SGLang nor torch; asking for FlexKVdStorage imports SGLang and raises
ImportError saying so when it is missing. The logic is in plain classes (BackendConfig and host_pool_view here,
PageStore, HostPoolLayout, FlatPagePool and HybridStores in _sglang_store.py, _sglang_layout.py, _sglang_hybrid.py)
that the FlexKVdStorage adapter calls; build_backend_class makes the adapter over any base class and tensor
conversion, so that it is tested with stand-ins of SGLang's HiCacheStorage and pools. How keys, copies, hybrid pools,
TP ranks and failures are handled is written there and in docs/integrations_sglang.md.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import numpy as np

from ..errors import Error, InvalidArgument
from ._sglang_hybrid import ALL_PAGES, KV_POOL, TRAILING_PAGES, HybridStores, PoolPages, PoolQuery
from ._sglang_layout import FlatPagePool, HostPoolLayout
from ._sglang_store import PageStore, PageStoreStats, page_block_key

# FlexKVdStorage (the SGLang class, built on first use by __getattr__) is not in __all__: `import *` must not need
# SGLang.
__all__ = ["BackendConfig", "FlatPagePool", "HostPoolLayout", "HybridStores", "PageStore", "PageStoreStats",
           "build_backend_class", "host_pool_view", "page_block_key"]

logger = logging.getLogger(__name__)

# Extra-config keys this backend reads, with their defaults (docs/integrations_sglang.md lists them).
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
    base_namespace: str   # the namespace before the rank suffixes
    tp_suffix: str        # "@tp<r>of<n>" with TP > 1, else ""
    other_suffix: str     # "@pp<r>of<n>@cp<r>of<n>" as they apply
    is_mla_model: bool
    socket: Optional[str]
    staging_pages: int
    connect_timeout_s: float
    op_timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float
    zero_copy_interface: bool  # SGLang calls batch_get_v1 / batch_set_v1 (extra config "interface_v1": 1)
    namespace_given: bool = False  # the operator named the namespace (extra config "namespace")

    def with_kv_dtype(self, dtype: str) -> "BackendConfig":
        """The default namespace names the KV dtype once the host pool is known ("sglang/<model>|<dtype>"): engines
        of one served model name in bf16 and fp16 (or fp8 e4m3 and e5m2) write other bytes for the same tokens and
        must not share pages (the daemon's geometry check sees only the element size). A namespace the operator
        gave is kept as given (it must then name everything that changes KV)."""
        if self.namespace_given or not dtype:
            return self
        base = f"{self.base_namespace}|{dtype.replace('torch.', '')}"
        namespace = base + ("" if self.is_mla_model else self.tp_suffix) + self.other_suffix
        return dataclasses.replace(self, base_namespace=base, namespace=namespace)

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
        base = namespace
        tp_suffix = f"@tp{tp_rank}of{tp_size}" if tp_size > 1 else ""
        other = (f"@pp{pp_rank}of{pp_size}" if pp_size > 1 else "") + \
            (f"@cp{attn_cp_rank}of{attn_cp_size}" if attn_cp_size > 1 else "")
        namespace = base + ("" if is_mla_model else tp_suffix) + other
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
                   base_namespace=base, tp_suffix=tp_suffix, other_suffix=other, is_mla_model=is_mla_model,
                   staging_pages=staging, zero_copy_interface=bool(extra.get("interface_v1", 0)),
                   namespace_given=bool(opts["namespace"]), **seconds)

    def pool_namespace(self, pool_name: str, tag: str = "") -> str:
        """The cache domain of side pool `pool_name` ("<namespace>#<pool><tag>" with this rank's suffixes; `tag`
        names a pool stored through its flat pages, whose bytes depend on its class and layout). A pool is per TP
        rank as K/V is, except beside replicated (MLA) K/V, where SGLang writes side pools from TP rank 0 only and
        every rank reads them - but for a Mamba state pool, which is sharded over TP ranks whatever the attention
        (SGLang backs it up on every rank)."""
        sharded = not self.is_mla_model or pool_name == "mamba"
        return f"{self.base_namespace}#{pool_name}{tag}" + (self.tp_suffix if sharded else "") + self.other_suffix

    def open_store(self, pool: Union[HostPoolLayout, FlatPagePool], namespace: Optional[str] = None,
                   pool_name: Optional[str] = None, staging_pages: Optional[int] = None) -> PageStore:
        """The PageStore of this rank over `pool`, in `namespace` (default: the K/V namespace) with `staging_pages`
        (default: the configured number); connects now, and a daemon that is not up is retried later."""
        name = self.session_name if pool_name is None else f"{self.session_name}-{pool_name}"
        return PageStore(pool, namespace or self.namespace, socket_path=self.socket,
                         staging_pages=staging_pages or self.staging_pages, name=name, connect_timeout_s=self.connect_timeout_s,
                         op_timeout_s=self.op_timeout_s, backoff_initial_s=self.backoff_initial_s,
                         backoff_max_s=self.backoff_max_s)


class TensorOps:
    """How the adapter turns SGLang's tensors into NumPy (torch here; the tests pass NumPy stand-ins)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def buffer_bytes(self, t: Any) -> np.ndarray:
        """A host pool buffer as a uint8 array over its memory, the last axis in bytes."""
        return t.view(self.torch.uint8).numpy()

    def element_size(self, t: Any) -> int:
        return int(t.element_size())

    def indices(self, t: Any) -> np.ndarray:
        return t.cpu().numpy()

    def flat_bytes(self, t: Any) -> np.ndarray:
        """A tensor's bytes as a 1-D uint8 array (a copy only where it is not contiguous on the CPU)."""
        if isinstance(t, self.torch.Tensor):
            return t.detach().cpu().contiguous().view(self.torch.uint8).numpy().reshape(-1)
        return np.asarray(t).reshape(-1).view(np.uint8)

    def wrap_bytes(self, arr: np.ndarray) -> Any:
        """A uint8 tensor over `arr`'s memory (for SGLang's set_from_flat_data_page, which copies from it)."""
        return self.torch.from_numpy(arr)

    def is_flat_target(self, t: Any) -> bool:
        return not isinstance(t, self.torch.Tensor) or (t.device.type == "cpu" and t.is_contiguous())

    def page_tensor(self, page: np.ndarray, dtype: Any) -> Any:
        return self.torch.from_numpy(page).view(dtype)


_FLAT_PAGE_CALLS = ("get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page")


def kv_pool_layout(pool: Any, ops: TensorOps) -> HostPoolLayout:
    """The anchor K/V pool (register_mem_pool_host): an MHA or MLA host pool; InvalidArgument naming what it is
    otherwise."""
    kind = type(pool).__name__
    if kind not in _HOST_POOLS or getattr(pool, "kv_buffer", None) is None:
        raise InvalidArgument(f"flexkvd HiCache backend stores K/V from the host pools {', '.join(_HOST_POOLS)}; "
                              f"SGLang registered {kind} as its K/V pool (a hybrid model's side pools - Mamba, SWA, "
                              "indexer - come through register_mem_host_pool_v2 and are stored there)")
    kv = pool.kv_buffer
    return HostPoolLayout(ops.buffer_bytes(kv), pool.layout, pool.page_size, kind == "MLATokenToKVPoolHost",
                          ops.element_size(kv))


def host_pool_view(pool: Any, name: str, ops: TensorOps) -> "tuple[Union[HostPoolLayout, FlatPagePool], str]":
    """How flexkvd stores side pool `name` (register_mem_host_pool_v2), with the namespace tag it needs: an MHA or
    MLA pool in flexkvd's block order (tag ""); any other pool through SGLang's flat-page calls, one page per block
    (tag ":<class>:<layout>", since its bytes follow the pool's layout). InvalidArgument naming the pool and what
    flexkvd needs for a pool it cannot store: one without the flat-page calls, a compressed pool whose pages do not
    each belong to one K/V page (slot_page_size != page_size: DeepSeek-V4's C4/C128 pools), an empty page."""
    kind = type(pool).__name__
    page_size = int(getattr(pool, "page_size", 0) or 0)
    slot_page = getattr(pool, "slot_page_size", None)
    if slot_page is not None and int(slot_page) != page_size:
        raise InvalidArgument(
            f"flexkvd HiCache backend cannot store SGLang host pool {name!r} ({kind}): its pages hold "
            f"{slot_page} slots for {page_size} tokens (a compressed pool), so a page is not one K/V page's and the "
            "page keys SGLang passes do not name its pages one to one; flexkvd needs pools whose pages each belong "
            "to one K/V page. Run this model without --hicache-storage-backend, or with a backend that stores "
            "compressed pools")
    if kind in _HOST_POOLS and getattr(pool, "kv_buffer", None) is not None:
        try:
            return kv_pool_layout(pool, ops), ""
        except InvalidArgument as e:
            if not all(hasattr(pool, c) for c in _FLAT_PAGE_CALLS):
                raise InvalidArgument(f"flexkvd HiCache backend cannot store SGLang host pool {name!r}: {e}") from e
    missing = [c for c in _FLAT_PAGE_CALLS if not callable(getattr(pool, c, None))]
    if missing or page_size < 1:
        what = f"has no {', '.join(missing)}" if missing else f"has page_size {page_size}"
        raise InvalidArgument(
            f"flexkvd HiCache backend cannot store SGLang host pool {name!r} ({kind}): it {what}; flexkvd stores a "
            "side pool through SGLang's flat-page calls (get_data_page(index, flat=True), set_from_flat_data_page, "
            "get_dummy_flat_data_page) with page_size >= 1")
    page_bytes = int(ops.flat_bytes(pool.get_dummy_flat_data_page()).size)
    if page_bytes < 1:
        raise InvalidArgument(f"flexkvd HiCache backend cannot store SGLang host pool {name!r} ({kind}): its flat "
                              "pages are empty")

    def read(index: int) -> np.ndarray:
        return ops.flat_bytes(pool.get_data_page(index, flat=True))

    def write(index: int, data: np.ndarray) -> None:
        pool.set_from_flat_data_page(index, ops.wrap_bytes(data))

    flat = FlatPagePool(name, page_size, int(pool.size), page_bytes, read, write)
    return flat, f":{kind}:{getattr(pool, 'layout', '-')}"


def _pool_name(name: Any) -> str:
    """SGLang's PoolName (a str Enum whose str() is its value) or a plain string, as a string."""
    value = getattr(name, "value", name)
    return str(value)


def _hit_policy(policy: Any) -> str:
    value = str(getattr(policy, "value", policy) or ALL_PAGES)
    return value if value in (ALL_PAGES, TRAILING_PAGES) else ALL_PAGES


def __getattr__(name: str) -> Any:
    """FlexKVdStorage is built on first use, so that importing this module does not import SGLang."""
    if name == "FlexKVdStorage":
        cls = _backend_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _backend_class() -> type:
    try:
        from sglang.srt.mem_cache import hicache_storage
    except ImportError as e:
        raise ImportError(
            "flexkvd.integrations.sglang.FlexKVdStorage is an SGLang HiCache storage backend and needs SGLang "
            f"(sglang.srt.mem_cache.hicache_storage), which could not be imported: {e}. Install SGLang in this "
            "environment; the backend's logic (BackendConfig, PageStore) works without it.") from e
    import torch

    return build_backend_class(hicache_storage.HiCacheStorage, TensorOps(torch),
                               getattr(hicache_storage, "PoolTransferResult", None))


def build_backend_class(base: type, ops: TensorOps, pool_transfer_result: Optional[Callable[..., Any]]) -> type:
    """The FlexKVdStorage class over SGLang's HiCacheStorage `base`, converting tensors with `ops`;
    `pool_transfer_result(kv_hit_pages, extra_pool_hit_pages)` builds batch_exists_v2's answer (SGLang's
    PoolTransferResult; None for an SGLang without the v2 interface)."""

    class FlexKVdStorage(base):  # type: ignore[misc, valid-type]
        """SGLang's HiCacheStorage over flexkvd; each call goes to a PageStore (thread-safe, never raises for an
        unreachable daemon: misses instead). A hybrid model's side pools (register_mem_host_pool_v2) each get a
        PageStore of their own and the v2 calls; see _sglang_hybrid.py."""

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
            self.pools = HybridStores()
            self._kv_pool_obj: Any = None

        @property
        def store(self) -> Optional[PageStore]:
            return self.pools.kv

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            super().register_mem_pool_host(mem_pool_host)
            self.config = self.config.with_kv_dtype(_dtype_name(getattr(mem_pool_host, "dtype", None)))
            layout = kv_pool_layout(mem_pool_host, ops)
            self._kv_pool_obj = mem_pool_host
            self.pools.set_kv(self.config.open_store(layout))

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            """A pool of a hybrid model (SGLang registers every entry of its HostPoolGroup, the K/V anchor
            included). Raises InvalidArgument naming the pool for one flexkvd cannot store: SGLang then fails to
            start (or to attach the backend) with that message instead of losing the pool's pages later."""
            name = _pool_name(host_pool_name)
            if pool_transfer_result is None:
                raise InvalidArgument("flexkvd HiCache backend: SGLang registers host pools for the v2 interface but "
                                      "its hicache_storage has no PoolTransferResult to answer batch_exists_v2 with")
            if name == KV_POOL or host_pool is self._kv_pool_obj:
                if self.pools.kv is None:
                    self.register_mem_pool_host(host_pool)
                parent = getattr(super(), "register_mem_host_pool_v2", None)
                if parent is not None:
                    parent(host_pool, host_pool_name)
                return
            view, tag = host_pool_view(host_pool, name, ops)
            store = self.config.open_store(view, self.config.pool_namespace(name, tag), pool_name=name,
                                           staging_pages=self._side_staging_pages(view))
            self.pools.add_pool(name, store)
            parent = getattr(super(), "register_mem_host_pool_v2", None)
            if parent is not None:
                parent(host_pool, host_pool_name)
            logger.info("flexkvd HiCache backend stores host pool %r (%s, %d-byte pages) in namespace %r", name,
                        type(host_pool).__name__, view.page_bytes, store.namespace)

        def _side_staging_pages(self, view: Union[HostPoolLayout, FlatPagePool]) -> int:
            """A side pool's staging blocks: as many as fit in the K/V staging area's bytes (at least 1, at most
            staging_pages): a Mamba state can be tens of MiB, and SGLang moves one per request."""
            kv = self.pools.kv
            budget = self.config.staging_pages * (kv.pool.page_bytes if kv is not None else 0)
            block = int(np.prod(view.block_shape))
            return max(1, min(self.config.staging_pages, budget // block))

        def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
            return self.store.batch_exists(keys) if self.store is not None and keys else 0

        def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
            return self._v1("batch_get_v1", keys, host_indices)

        def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
            return self._v1("batch_set_v1", keys, host_indices)

        def _v1(self, op: str, keys: List[str], host_indices: Any) -> List[bool]:
            """SGLang's prefetch and backup threads call these and do not expect an exception: host indices that
            do not fit the pool (a count that is not the keys' pages, an index outside it) are SGLang's bug, logged
            and answered all False, as the v2 calls are."""
            if self.store is None or not keys:
                return [False] * len(keys)
            try:
                indices = ops.indices(host_indices)
                if op == "batch_get_v1":
                    return self.store.batch_get(keys, indices)
                return self.store.batch_set(keys, indices)
            except Error as e:
                logger.error("flexkvd HiCache backend: %s of %d keys refused: %s; answered all False", op, len(keys),
                             e)
                return [False] * len(keys)

        def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
            queries = [PoolQuery(_pool_name(t.name), _hit_policy(getattr(t, "hit_policy", None)),
                                 max(1, len(t.keys or []))) for t in pool_transfers or []]
            final, counts = self.pools.exists_v2(list(keys), queries)
            by_name = {_pool_name(t.name): t.name for t in pool_transfers or []}
            return pool_transfer_result(final, {by_name.get(k, k): v for k, v in counts.items()})

        def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
            return self._v2(transfers, self.pools.get_v2)

        def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
            return self._v2(transfers, self.pools.set_v2)

        def _v2(self, transfers: Any, call: Callable[[List[PoolPages]], List[List[bool]]]) -> Dict[Any, List[bool]]:
            pages = [PoolPages(_pool_name(t.name), list(t.keys or []),
                               None if t.host_indices is None else ops.indices(t.host_indices))
                     for t in transfers or []]
            return {t.name: r for t, r in zip(transfers or [], call(pages))}

        def exists(self, key: str) -> bool:
            return self.batch_exists([key]) == 1

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            return self.batch_get([key], None if target_location is None else [target_location])[0]

        def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
            if self.store is None:
                return [None] * len(keys)
            targets = list(target_locations) if target_locations is not None else [None] * len(keys)
            if not all(ops.is_flat_target(t) for t in targets):
                raise InvalidArgument("get targets must be contiguous CPU tensors (SGLang's dummy flat pages)")
            arrays = [None if t is None else ops.flat_bytes(t) for t in targets]
            pages = self.store.get_flat(keys, arrays)
            out: List[Any] = []
            for t, page in zip(targets, pages):
                if page is None:
                    out.append(None)
                elif t is not None:
                    out.append(t)
                else:
                    out.append(ops.page_tensor(page, self.mem_pool_host.dtype))
            return out

        def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
            return value is not None and self.batch_set([key], [value])

        def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:
            if self.store is None or values is None or any(v is None for v in values):
                return False
            return all(self.store.set_flat(keys, [ops.flat_bytes(v) for v in values]))

        def clear(self) -> None:
            # A client cannot delete blocks: they belong to the cache domain, shared with every engine in it, and
            # leave by LRU eviction; an administrator drops a whole domain (flexkvctl drop-domain) once no engine
            # is attached.
            logger.warning("flexkvd HiCache backend: clear() keeps the blocks in flexkvd (namespace %r and its "
                           "side pools' %s); they are evicted by LRU, or dropped as a whole with `flexkvctl "
                           "drop-domain` once no engine is attached", self.config.namespace, self.pools.pool_names())

        def get_stats(self) -> Any:
            metrics = _storage_metrics()
            s = self.pools.take_samples()
            metrics.prefetch_pgs.extend(s.prefetch_pgs)
            metrics.backup_pgs.extend(s.backup_pgs)
            metrics.prefetch_bandwidth.extend(s.prefetch_bandwidth)
            metrics.backup_bandwidth.extend(s.backup_bandwidth)
            return metrics

        def close(self) -> None:
            self.pools.close()

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


def _dtype_name(dtype: Any) -> str:
    """A KV dtype as the namespace names it: "bfloat16" for torch.bfloat16, "float8_e4m3fn", "uint16" for a NumPy
    type; "" when the pool does not say."""
    if dtype is None:
        return ""
    name = dtype.__name__ if isinstance(dtype, type) else str(dtype)
    return name.replace("torch.", "")
