"""A hybrid model's HiCache pools in flexkvd: SGLang's batch_exists_v2 / batch_get_v2 / batch_set_v2 with plain
arguments (pool names, page keys, NumPy host indices), so it runs and is tested without SGLang.

SGLang keeps a hybrid model's cache in several host pools (hicache_storage.PoolName): the anchor K/V pool of the
full-attention layers ("kv"), and side pools - a Mamba / linear-attention state pool ("mamba", one state per slot),
a sliding-window K/V pool ("swa"), an NSA indexer pool ("indexer"), draft-model pools. Every page of every pool is
named by the page key of the K/V page it belongs to. HybridStores keeps one PageStore per pool, each in a cache
domain of its own ("<namespace>#<pool>", see BackendConfig.pool_namespace), each page stored under the root as
for K/V (docs/integrations_sglang.md, "Hybrid models").

The hit rule is SGLang's (PoolTransfer.hit_policy), applied here: a prefix of e pages is usable when
  - the K/V pages [0, e) are there,
  - for each "all_pages" pool (the indexer): its pages [0, e),
  - for each "trailing_pages" pool, with n = the number of keys its transfer names (1 for a Mamba state, the window
    in pages for SWA): its pages [max(0, e - n), e) - the state taken at the prefix's end, the window before it.
exists_v2 answers the longest such e (0 when there is none): a prefix whose K/V is there but whose state or window
is not is not a hit of that length, a shorter one may be. flexkvd evicts each domain's pages by LRU on its own, so
a page may go between exists_v2 and get_v2; get_v2 then answers False from that page on and writes nothing there,
and SGLang drops the prefetch of that pool.

Never raises into SGLang's storage threads for a runtime failure: an unreachable daemon answers misses (PageStore),
a transfer naming a pool that was never registered or carrying the wrong number of host indices is logged and
answered all False.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import Error
from ._sglang_store import PageStore, PageStoreStats

logger = logging.getLogger(__name__)

KV_POOL = "kv"                  # PoolName.KV: the anchor K/V pool (batch_*_v1)
ALL_PAGES = "all_pages"         # PoolHitPolicy.ALL_PAGES
TRAILING_PAGES = "trailing_pages"  # PoolHitPolicy.TRAILING_PAGES


@dataclasses.dataclass(frozen=True)
class PoolQuery:
    """One side pool of a batch_exists_v2: its name, hit policy and, for trailing_pages, how many trailing pages
    a prefix end needs (at least 1)."""

    name: str
    hit_policy: str = ALL_PAGES
    trailing_pages: int = 1


@dataclasses.dataclass(frozen=True)
class PoolPages:
    """One PoolTransfer of a batch_get_v2 / batch_set_v2: pool keys[i] is the page at host index
    host_indices[i * page_size] of the pool `name` (None: SGLang passed no indices)."""

    name: str
    keys: Sequence[str]
    host_indices: Optional[np.ndarray]


def usable_prefix(kv_pages: int, pools: Sequence[Tuple[PoolQuery, Sequence[bool]]]) -> Tuple[int, Dict[str, int]]:
    """The hit rule: (the longest usable prefix e, each pool's own boundary). `kv_pages` is the leading K/V hit count;
    each pool comes with whether it holds each page [0, kv_pages). A pool's boundary is the longest prefix that pool
    alone allows (reported to SGLang as its extra_pool_hit_pages, 0 left out); e is the longest prefix all allow at
    once."""
    limit = kv_pages
    boundaries: Dict[str, int] = {}
    trailing: List[Tuple[int, Sequence[bool]]] = []
    for query, present in pools:
        if len(present) < kv_pages:
            raise ValueError(f"pool {query.name!r}: {len(present)} presence flags for {kv_pages} pages")
        if query.hit_policy == TRAILING_PAGES:
            n = max(1, query.trailing_pages)
            boundaries[query.name] = next((e for e in range(kv_pages, 0, -1) if _covers(present, e, n)), 0)
            trailing.append((n, present))
        else:
            boundaries[query.name] = next((i for i in range(kv_pages) if not present[i]), kv_pages)
            limit = min(limit, boundaries[query.name])
    final = next((e for e in range(limit, 0, -1) if all(_covers(p, e, n) for n, p in trailing)), 0)
    return final, boundaries


def _covers(present: Sequence[bool], end: int, n: int) -> bool:
    return all(present[max(0, end - n):end])


class HybridStores:
    """The K/V PageStore of one SGLang rank and the PageStores of its side pools, by pool name. Thread-safe: SGLang's
    prefetch, prefetch-IO and backup threads call it at once (register is called from SGLang's scheduler)."""

    def __init__(self, kv: Optional[PageStore] = None) -> None:
        self._lock = threading.Lock()
        self._kv = kv
        self._pools: Dict[str, PageStore] = {}
        self._warned: set = set()

    @property
    def kv(self) -> Optional[PageStore]:
        return self._kv

    def set_kv(self, store: PageStore) -> None:
        with self._lock:
            old, self._kv = self._kv, store
        if old is not None and old is not store:
            old.close()

    def add_pool(self, name: str, store: PageStore) -> None:
        """Registers (or replaces) side pool `name`."""
        with self._lock:
            old = self._pools.get(name)
            self._pools[name] = store
            self._warned.discard(name)
        if old is not None and old is not store:
            old.close()

    def pool(self, name: str) -> Optional[PageStore]:
        with self._lock:
            return self._kv if name == KV_POOL else self._pools.get(name)

    def pool_names(self) -> List[str]:
        with self._lock:
            return sorted(self._pools)

    def stores(self) -> List[PageStore]:
        with self._lock:
            return ([self._kv] if self._kv is not None else []) + list(self._pools.values())

    def close(self) -> None:
        for s in self.stores():
            s.close()

    def take_samples(self) -> PageStoreStats:
        """The per-call samples of every pool since the last call (SGLang's get_stats)."""
        out = PageStoreStats()
        for s in self.stores():
            t = s.take_samples()
            out.prefetch_pgs += t.prefetch_pgs
            out.backup_pgs += t.backup_pgs
            out.prefetch_bandwidth += t.prefetch_bandwidth
            out.backup_bandwidth += t.backup_bandwidth
        return out

    # ---- SGLang's v2 calls ----

    def exists_v2(self, keys: Sequence[str], queries: Sequence[PoolQuery]) -> Tuple[int, Dict[str, int]]:
        """(kv_hit_pages, extra_pool_hit_pages) of batch_exists_v2: the usable prefix under the hit rule, and the
        K/V leading count ("kv") and each pool's own boundary, those above 0."""
        kv = self._kv.batch_exists(keys) if self._kv is not None and keys else 0
        counts: Dict[str, int] = {KV_POOL: kv} if kv else {}
        if kv == 0:
            return 0, counts
        side = [(q, self._side_pool(q.name, "batch_exists_v2")) for q in queries if q.name != KV_POOL]
        pools: List[Tuple[PoolQuery, Sequence[bool]]] = []
        # The common case first: every trailing pool has its pages at the K/V prefix's own end (the state and window
        # stored there), so only those are asked for; all_pages pools are asked for every page.
        for q, store in side:
            first = max(0, kv - max(1, q.trailing_pages)) if q.hit_policy == TRAILING_PAGES else 0
            found = store.batch_present(keys[first:kv]) if store is not None else [False] * (kv - first)
            pools.append((q, [False] * first + found))
        final, boundaries = usable_prefix(kv, pools)
        if final < kv and any(q.hit_policy == TRAILING_PAGES for q, _ in side):
            # A shorter end may be usable: ask the trailing pools for every page.
            pools = [(q, p if q.hit_policy != TRAILING_PAGES else
                      (store.batch_present(keys[:kv]) if store is not None else [False] * kv))
                     for (q, p), (_, store) in zip(pools, side)]
            final, boundaries = usable_prefix(kv, pools)
        counts.update({name: b for name, b in boundaries.items() if b})
        return final, counts

    def get_v2(self, transfers: Sequence[PoolPages]) -> List[List[bool]]:
        """batch_get_v2: per transfer, True for the leading pages read into its pool; False from the first page
        that is not there on (its host memory untouched)."""
        return [self._io(t, "batch_get_v2") for t in transfers]

    def set_v2(self, transfers: Sequence[PoolPages]) -> List[List[bool]]:
        """batch_set_v2: per transfer, True for each page flexkvd holds afterwards."""
        return [self._io(t, "batch_set_v2") for t in transfers]

    def _io(self, t: PoolPages, op: str) -> List[bool]:
        n = len(t.keys)
        if n == 0:
            return []
        store = self.pool(t.name) if t.name == KV_POOL else self._side_pool(t.name, op)
        if store is None:
            return [False] * n
        want = n * store.pool.page_size
        got = 0 if t.host_indices is None else int(np.asarray(t.host_indices).size)
        if got != want:
            logger.error("flexkvd HiCache backend: %s for pool %r has %d host indices for %d keys; expected %d "
                         "(page_size %d per key): answered all False", op, t.name, got, n, want,
                         store.pool.page_size)
            return [False] * n
        try:
            if op == "batch_get_v2":
                return store.batch_get(t.keys, t.host_indices)
            return store.batch_set(t.keys, t.host_indices)
        except Error as e:  # a host index outside the pool, a page of the wrong size: SGLang's bug, logged
            logger.error("flexkvd HiCache backend: %s for pool %r refused: %s; answered all False", op, t.name, e)
            return [False] * n

    def _side_pool(self, name: str, op: str) -> Optional[PageStore]:
        with self._lock:
            store = self._pools.get(name)
            if store is None and name not in self._warned:
                self._warned.add(name)
                logger.error("flexkvd HiCache backend: %s names host pool %r, which was never registered "
                             "(register_mem_host_pool_v2); its pages are answered as missing", op, name)
            return store
