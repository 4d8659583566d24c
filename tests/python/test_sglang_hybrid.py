"""flexkvd.integrations.sglang for hybrid models against a real flexkvd: the FlexKVdStorage class itself (built by
build_backend_class over stand-ins of SGLang's HiCacheStorage, PoolTransfer and host pools, NumPy in place of
torch), driven in the order SGLang's HybridCacheController calls it.

The stand-ins and call sequences are written from sgl-project/sglang (python/sglang/srt/mem_cache/hicache_storage.py,
managers/cache_controller.py, mem_cache/hybrid_cache/hybrid_cache_controller.py, mem_cache/pool_host/mamba.py):
  attach:   StorageBackendFactory builds the backend, register_mem_pool_host(anchor K/V host pool), then
            register_mem_host_pool_v2(entry.host_pool, entry.name) for every HostPoolGroup entry (anchor included);
  backup:   _page_backup: batch_set_v2(side-pool transfers) first, then the K/V pages through batch_set_v1 in batches
            of 128 pages;
  prefetch: _storage_hit_query: batch_exists_v2(all page keys, operation.pool_transfers) -> kv_hit_pages;
            _page_transfer: K/V by batch_get_v1 per 128-page batch (K/V-derived pools such as the indexer by
            batch_get_v2 with the batch's K/V host indices); then, only when every K/V page came, _sync_trailing_keys
            (a trailing pool's keys become the last n hit keys) and batch_get_v2 of the other side pools, whose hits
            are count_pool_hits (leading True).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytest

import flexkvd
from flexkvd.integrations import sglang as backend
from flexkvd.integrations._sglang_hybrid import ALL_PAGES, TRAILING_PAGES, PoolQuery, usable_prefix

from test_sglang_backend import page_keys

BATCH = 128            # STORAGE_BATCH_SIZE
PAGE = 16              # tokens per K/V page
LAYERS, HEADS, HEAD_DIM = 2, 2, 64
MAMBA_LAYERS, SSM_SHAPE, CONV_SHAPE = 3, (4, 8, 8), (24, 3)   # 3 x (1 KiB fp32 + 144 B bf16) per state


# ---- stand-ins of SGLang's storage interface ----

class PoolName(str, enum.Enum):
    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"

    def __str__(self) -> str:
        return self.value


class PoolHitPolicy(str, enum.Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclasses.dataclass
class PoolTransfer:
    name: PoolName
    host_indices: Optional[np.ndarray] = None
    device_indices: Optional[np.ndarray] = None
    keys: Optional[List[str]] = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    nodes_to_load: Optional[List[Any]] = None
    indices_from_pool: Optional[PoolName] = None


@dataclasses.dataclass
class PoolTransferResult:
    kv_hit_pages: int
    extra_pool_hit_pages: Dict[str, int]


@dataclasses.dataclass
class StorageConfig:  # HiCacheStorageConfig's fields the backend reads
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    model_name: str = "qwen3-next"
    extra_config: Optional[dict] = None


class HiCacheStorage:
    """SGLang's base class as far as a backend sees it: the registrations keep the pools, the v2 calls raise."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise NotImplementedError()

    def batch_get_v2(self, transfers, extra_info=None):
        raise NotImplementedError()

    def batch_set_v2(self, transfers, extra_info=None):
        raise NotImplementedError()


def count_pool_hits(results: Dict[Any, List[bool]]) -> Dict[Any, int]:
    return {name: (rs.index(False) if False in rs else len(rs)) for name, rs in results.items()}


class NumpyOps(backend.TensorOps):
    """TensorOps over NumPy arrays (the adapter's torch calls, with NumPy)."""

    def __init__(self) -> None:
        super().__init__(None)

    def buffer_bytes(self, t: np.ndarray) -> np.ndarray:
        return t.view(np.uint8)

    def element_size(self, t: np.ndarray) -> int:
        return t.itemsize

    def indices(self, t: Any) -> np.ndarray:
        return np.asarray(t)

    def flat_bytes(self, t: Any) -> np.ndarray:
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)

    def wrap_bytes(self, arr: np.ndarray) -> np.ndarray:
        return arr

    def is_flat_target(self, t: Any) -> bool:
        return True

    def page_tensor(self, page: np.ndarray, dtype: Any) -> np.ndarray:
        return page.view(dtype)


FlexKVdStorage = backend.build_backend_class(HiCacheStorage, NumpyOps(), PoolTransferResult)


# ---- stand-ins of SGLang's host pools ----

class MHATokenToKVPoolHost:
    """pool_host/mha.py, page_first: kv_buffer (2, tokens, layers, heads, head_dim) of bf16 (here uint16)."""

    def __init__(self, pages: int, layers: int = LAYERS, page_size: int = PAGE) -> None:
        self.page_size, self.layout, self.size = page_size, "page_first", pages * page_size
        self.kv_buffer = np.zeros((2, self.size, layers, HEADS, HEAD_DIM), np.uint16)
        self.dtype = np.uint16

    def fill(self, seed: int, page: int) -> None:
        t = slice(page * self.page_size, (page + 1) * self.page_size)
        shape = self.kv_buffer[:, t].shape
        self.kv_buffer[:, t] = np.random.default_rng([seed, page]).integers(1, 65535, size=shape, dtype=np.uint16)

    def page(self, page: int) -> np.ndarray:
        return self.kv_buffer[:, page * self.page_size:(page + 1) * self.page_size]


class MambaPoolHost:
    """pool_host/mamba.py, page_first: page_size 1 (a slot is one state), temporal_buffer (size, layers, 1, *ssm)
    and conv_buffer [(size, layers, 1, *conv)]; a flat page is the slot's temporal bytes, then its conv bytes."""

    def __init__(self, slots: int, ssm_shape: Sequence[int] = SSM_SHAPE) -> None:
        self.page_size, self.layout, self.size = 1, "page_first", slots
        self.temporal_buffer = np.zeros((slots, MAMBA_LAYERS, 1) + tuple(ssm_shape), np.float32)
        self.conv_buffer = [np.zeros((slots, MAMBA_LAYERS, 1) + CONV_SHAPE, np.uint16)]
        self.size_per_token = self.temporal_buffer[0].nbytes + sum(c[0].nbytes for c in self.conv_buffer)

    def _tensors(self, index: int) -> List[np.ndarray]:
        return [self.temporal_buffer[index]] + [c[index] for c in self.conv_buffer]

    def get_data_page(self, index: int, flat: bool = True) -> np.ndarray:
        return np.concatenate([t.reshape(-1).view(np.uint8) for t in self._tensors(index)])

    def get_dummy_flat_data_page(self) -> np.ndarray:
        return np.zeros(self.page_size * self.size_per_token, np.uint8)

    def set_from_flat_data_page(self, index: int, data_page: np.ndarray) -> None:
        flat, start = np.asarray(data_page).reshape(-1).view(np.uint8), 0
        for t in self._tensors(index):
            t[...] = flat[start:start + t.nbytes].view(t.dtype).reshape(t.shape)
            start += t.nbytes

    def fill(self, seed: int, index: int) -> None:
        rng = np.random.default_rng([seed, index])
        self.temporal_buffer[index] = rng.standard_normal(self.temporal_buffer[index].shape, dtype=np.float32)
        self.conv_buffer[0][index] = rng.integers(0, 65535, self.conv_buffer[0][index].shape, dtype=np.uint16)


class IndexerPoolHost(MambaPoolHost):
    """A side pool with K/V pages (page_size 16) seen only through flat pages, as an NSA indexer pool: 16 tokens x
    132 bytes a page."""

    def __init__(self, pages: int) -> None:
        self.page_size, self.layout, self.size = PAGE, "page_first", pages * PAGE
        self.buf = np.zeros((self.size, 132), np.uint8)
        self.size_per_token = 132

    def _tensors(self, index: int) -> List[np.ndarray]:
        return [self.buf[index:index + self.page_size]]

    def fill(self, seed: int, page: int) -> None:
        t = slice(page * PAGE, (page + 1) * PAGE)
        self.buf[t] = np.random.default_rng([seed, page]).integers(1, 255, self.buf[t].shape, dtype=np.uint8)


@dataclasses.dataclass
class PoolEntry:
    name: PoolName
    host_pool: Any


def attach(daemon, entries: List[PoolEntry], **config) -> Any:
    """HiCacheController.attach_storage_backend + HybridCacheController's registration of every entry."""
    extra = {"socket": daemon.socket, "staging_pages": 8, "op_timeout_s": 10.0, "interface_v1": 1}
    extra.update(config.pop("extra", {}))
    storage = FlexKVdStorage(StorageConfig(extra_config=extra, **config))
    storage.register_mem_pool_host(entries[0].host_pool)
    for e in entries:
        storage.register_mem_host_pool_v2(e.host_pool, e.name)
    return storage


def kv_indices(pages: Sequence[int]) -> np.ndarray:
    return np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE, dtype=np.int64) for p in pages])


def backup(storage, keys: List[str], kv_pages: Sequence[int], sidecars: List[PoolTransfer]) -> int:
    """HybridCacheController._page_backup: the side pools first, then K/V batch by batch; K/V pages written."""
    if sidecars:
        results = storage.batch_set_v2(sidecars)
        assert set(results) == {t.name for t in sidecars}
    idx, done = kv_indices(kv_pages), 0
    for i in range(0, len(keys), BATCH):
        batch = keys[i:i + BATCH]
        if not all(storage.batch_set_v1(batch, idx[i * PAGE:(i + len(batch)) * PAGE])):
            break
        done += len(batch)
    return done


def prefetch(storage, keys: List[str], kv_pages: Sequence[int], transfers: List[PoolTransfer]):
    """The prefetch thread's hit query and the prefetch-IO thread's transfer: (hit pages, K/V pages read, pool hits
    of the side pools read after the K/V)."""
    hit = storage.batch_exists_v2(keys, transfers)
    hashes = keys[:hit.kv_hit_pages]
    idx = kv_indices(kv_pages)
    derived = [t for t in transfers if t.indices_from_pool == PoolName.KV]
    completed = 0
    for i in range(0, len(hashes), BATCH):
        batch = hashes[i:i + BATCH]
        host = idx[i * PAGE:(i + len(batch)) * PAGE]
        r = storage.batch_get_v1(batch, host)
        hits = [next((j for j, ok in enumerate(r) if not ok), len(batch))]
        if derived:
            got = storage.batch_get_v2([PoolTransfer(t.name, host_indices=host, keys=batch) for t in derived])
            hits += list(count_pool_hits(got).values())
        completed += min(hits)
        if min(hits) != len(batch):
            break
    pool_hits: Dict[Any, int] = {}
    others = [t for t in transfers if t.indices_from_pool != PoolName.KV]
    if others and completed == len(hashes) and completed:
        for t in others:  # _sync_trailing_keys
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                n = len(t.keys) if t.keys else 1
                t.keys = hashes[max(0, completed - n):completed]
                t.host_indices = t.host_indices[:len(t.keys) * storage.pools.pool(str(t.name)).pool.page_size]
        pool_hits = count_pool_hits(storage.batch_get_v2(others))
    return hit, completed, pool_hits


def mamba_at(pool: MambaPoolHost, slot: int, key: str) -> PoolTransfer:
    return PoolTransfer(PoolName.MAMBA, host_indices=np.array([slot]), keys=[key],
                        hit_policy=PoolHitPolicy.TRAILING_PAGES)


# ---- the hit rule ----

@pytest.mark.parametrize("kv,pools,expected", [
    (8, [], (8, {})),
    (8, [("m", TRAILING_PAGES, 1, "00010001")], (8, {"m": 8})),
    (8, [("m", TRAILING_PAGES, 1, "00010000")], (4, {"m": 4})),
    (8, [("m", TRAILING_PAGES, 1, "00000000")], (0, {"m": 0})),
    (8, [("w", TRAILING_PAGES, 2, "00110011")], (8, {"w": 8})),
    (8, [("w", TRAILING_PAGES, 2, "00110001")], (4, {"w": 4})),
    (1, [("w", TRAILING_PAGES, 2, "1")], (1, {"w": 1})),            # a window longer than the prefix
    (8, [("i", ALL_PAGES, 1, "11111011")], (5, {"i": 5})),
    # each pool alone allows more than all of them at once: states at 6 and 8, windows up to 7, the indexer up to 7
    (8, [("m", TRAILING_PAGES, 1, "00000101"), ("w", TRAILING_PAGES, 2, "00011110"),
         ("i", ALL_PAGES, 1, "11111110")], (6, {"m": 8, "w": 7, "i": 7})),
])
def test_usable_prefix_is_where_every_pool_has_what_the_end_needs(kv, pools, expected) -> None:
    args = [(PoolQuery(n, policy, t), [c == "1" for c in present]) for n, policy, t, present in pools]
    assert usable_prefix(kv, args) == expected


# ---- FlexKVdStorage over a real flexkvd ----

def test_mamba_hybrid_round_trip_is_byte_exact_and_hits_only_where_a_state_is(make_daemon) -> None:
    daemon = make_daemon(["--max-domains", "2"])
    n = 10
    keys = page_keys(21, n)
    kv_a, mamba_a = MHATokenToKVPoolHost(2 * n), MambaPoolHost(8)
    for p in range(n):
        kv_a.fill(21, p)
    mamba_a.fill(21, 2)
    mamba_a.fill(21, 5)
    a = attach(daemon, [PoolEntry(PoolName.KV, kv_a), PoolEntry(PoolName.MAMBA, mamba_a)])
    try:
        assert a.config.pool_namespace("mamba", ":MambaPoolHost:page_first") == \
            a.pools.pool("mamba").namespace == "sglang/qwen3-next|uint16#mamba:MambaPoolHost:page_first"
        # Two nodes of a chunked prefill: pages 0-3 with the state after page 3, pages 4-9 with the state after 9.
        assert backup(a, keys[:4], range(4), [mamba_at(mamba_a, 2, keys[3])]) == 4
        assert backup(a, keys[4:], range(4, n), [mamba_at(mamba_a, 5, keys[9])]) == 6
    finally:
        a.close()

    # Another engine (its own pools, other host slots) reads the prefix.
    kv_b, mamba_b = MHATokenToKVPoolHost(2 * n), MambaPoolHost(8)
    b = attach(daemon, [PoolEntry(PoolName.KV, kv_b), PoolEntry(PoolName.MAMBA, mamba_b)])
    try:
        hit, completed, pool_hits = prefetch(b, keys, range(n, 2 * n), [mamba_at(mamba_b, 7, "placeholder")])
        assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (n, {PoolName.KV: n, PoolName.MAMBA: n})
        assert completed == n and pool_hits == {PoolName.MAMBA: 1}
        asked = b.pools.pool("mamba").stats().exists_pages
        assert asked == 1, "a state at the K/V prefix's end: only that page is asked for"
        for p in range(n):
            assert np.array_equal(kv_b.page(n + p), kv_a.page(p)), f"K/V page {p}"
        assert mamba_b.get_data_page(7).tobytes() == mamba_a.get_data_page(5).tobytes()
        assert np.array_equal(mamba_b.temporal_buffer[7], mamba_a.temporal_buffer[5])

        # A prompt sharing the first 6 pages: K/V hits 6, but the only state inside them is after page 3.
        other = keys[:6] + page_keys(22, 3, prior=keys[5])
        hit, completed, pool_hits = prefetch(b, other, range(n, n + 9), [mamba_at(mamba_b, 6, "placeholder")])
        assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (4, {PoolName.KV: 6, PoolName.MAMBA: 4})
        assert b.pools.pool("mamba").stats().exists_pages == asked + 1 + 6  # the end, then every page
        assert completed == 4 and pool_hits == {PoolName.MAMBA: 1}
        assert np.array_equal(mamba_b.temporal_buffer[6], mamba_a.temporal_buffer[2])
        # The K/V of a prompt whose only stored state is past its end: no hit at all.
        assert b.batch_exists_v2(keys[:3], [mamba_at(mamba_b, 6, "x")]).kv_hit_pages == 0
        assert b.batch_exists(keys[:3]) == 3  # the v1 path (no side pool asked) still sees the K/V
    finally:
        b.close()


def test_swa_window_and_indexer_pools(make_daemon) -> None:
    # gpt-oss / DeepSeek-like: a sliding-window pool (MHA, 2-page window, stored in flexkvd's block order) and an
    # indexer pool read with the K/V host indices (all pages, through flat pages).
    daemon = make_daemon(["--max-domains", "3"])
    n = 8
    keys = page_keys(31, n)
    kv, swa, idx = MHATokenToKVPoolHost(2 * n), MHATokenToKVPoolHost(2 * n, layers=1), IndexerPoolHost(2 * n)
    for p in range(n):
        kv.fill(31, p)
        swa.fill(32, p)
        idx.fill(33, p)
    entries = [PoolEntry(PoolName.KV, kv), PoolEntry(PoolName.SWA, swa), PoolEntry(PoolName.INDEXER, idx)]
    s = attach(daemon, entries)
    try:
        assert s.pools.pool("swa").namespace == "sglang/qwen3-next|uint16#swa"
        assert s.pools.pool("indexer").namespace == "sglang/qwen3-next|uint16#indexer:IndexerPoolHost:page_first"

        def side(window_pages: Sequence[int], pages: Sequence[int]) -> List[PoolTransfer]:
            return [PoolTransfer(PoolName.SWA, host_indices=kv_indices(window_pages),
                                 keys=[keys[p] for p in window_pages], hit_policy=PoolHitPolicy.TRAILING_PAGES),
                    PoolTransfer(PoolName.INDEXER, host_indices=kv_indices(pages), keys=[keys[p] for p in pages],
                                 indices_from_pool=PoolName.KV)]

        # Node 1: pages 0-4 with the window [3, 4]; node 2: pages 5-7 with the window [6, 7].
        assert backup(s, keys[:5], range(5), side([3, 4], range(5))) == 5
        assert backup(s, keys[5:], range(5, n), side([6, 7], range(5, n))) == 3

        def transfers(dst: int) -> List[PoolTransfer]:
            return [PoolTransfer(PoolName.SWA, host_indices=kv_indices([dst, dst + 1]), keys=["w0", "w1"],
                                 hit_policy=PoolHitPolicy.TRAILING_PAGES),
                    PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV)]

        hit, completed, pool_hits = prefetch(s, keys, range(n, 2 * n), transfers(n))
        assert hit.kv_hit_pages == n and completed == n and pool_hits == {PoolName.SWA: 2}
        for p in range(n):
            assert np.array_equal(kv.page(n + p), kv.page(p)) and np.array_equal(idx.get_data_page(n * PAGE + p * PAGE),
                                                                                   idx.get_data_page(p * PAGE))
        for j, p in enumerate([6, 7]):
            assert np.array_equal(swa.page(n + j), swa.page(p)), f"window page {p}"
        # A prefix ending at 6 needs the window [4, 5]: page 5's window entry was never stored, so the longest
        # usable prefix inside 6 pages is 5 (window [3, 4]).
        assert s.batch_exists_v2(keys[:6], transfers(n)).kv_hit_pages == 5
    finally:
        s.close()


def test_a_state_evicted_after_exists_reads_false_and_writes_nothing(make_daemon) -> None:
    # Between SGLang's batch_exists_v2 and its batch_get_v2 the state goes (here: another engine's states fill the
    # small state domain); the get answers False and the host slot keeps what it had.
    daemon = make_daemon(["--max-domains", "2"], pool_size="4MiB")
    keys = page_keys(41, 2)
    kv, mamba = MHATokenToKVPoolHost(8), MambaPoolHost(64)
    for p in range(2):
        kv.fill(41, p)
    mamba.fill(41, 0)
    s = attach(daemon, [PoolEntry(PoolName.KV, kv), PoolEntry(PoolName.MAMBA, mamba)])
    try:
        assert backup(s, keys, range(2), [mamba_at(mamba, 0, keys[1])]) == 2
        assert s.batch_exists_v2(keys, [mamba_at(mamba, 1, "x")]).kv_hit_pages == 2
        flood = page_keys(42, 3000)  # 10 MiB of states through a 4 MiB pool (a Match would keep keys[1] warm)
        for i in range(0, len(flood), 50):
            s.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=np.arange(50) % 8, keys=flood[i:i + 50])])
        assert s.pools.pool("mamba").batch_present([keys[1]]) == [False], "the flood should have evicted the state"
        mamba.temporal_buffer[9] = 7.0
        before = mamba.get_data_page(9).copy()
        got = s.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=np.array([9]), keys=[keys[1]],
                                           hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert got == {PoolName.MAMBA: [False]}
        assert np.array_equal(mamba.get_data_page(9), before)
        assert s.batch_exists_v2(keys, [mamba_at(mamba, 1, "x")]).kv_hit_pages == 0
    finally:
        s.close()


def test_large_states_get_a_staging_area_of_the_kv_areas_bytes(make_daemon) -> None:
    # A state of 384 KiB beside 16 KiB K/V pages and 8 staging pages (128 KiB): one staging block for the state pool,
    # through which a call of 3 states runs in parts.
    daemon = make_daemon(["--max-domains", "2"])
    kv, mamba = MHATokenToKVPoolHost(4), MambaPoolHost(8, ssm_shape=(32, 32, 32))
    s = attach(daemon, [PoolEntry(PoolName.KV, kv), PoolEntry(PoolName.MAMBA, mamba)])
    keys = page_keys(71, 3)
    try:
        assert s.pools.pool("mamba").staging_pages == 1
        assert s.pools.pool("mamba").pool.page_bytes == mamba.size_per_token
        for i in range(3):
            mamba.fill(71, i)
        assert s.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=np.arange(3), keys=keys)]) == \
            {PoolName.MAMBA: [True] * 3}
        assert s.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=np.arange(4, 7), keys=keys)]) == \
            {PoolName.MAMBA: [True] * 3}
        for i in range(3):
            assert mamba.get_data_page(4 + i).tobytes() == mamba.get_data_page(i).tobytes()
    finally:
        s.close()


def test_pools_flexkvd_cannot_store_are_refused_at_registration(daemon) -> None:
    s = FlexKVdStorage(StorageConfig(extra_config={"socket": daemon.socket}))
    try:
        with pytest.raises(flexkvd.InvalidArgument, match="K/V pool.*register_mem_host_pool_v2"):
            s.register_mem_pool_host(MambaPoolHost(4))
        s.register_mem_pool_host(MHATokenToKVPoolHost(4))

        class DeepSeekV4CompressedPoolHost(IndexerPoolHost):
            slot_page_size = 4

        with pytest.raises(flexkvd.InvalidArgument, match="'deepseek_v4_c4'.*4 slots for 16 tokens"):
            s.register_mem_host_pool_v2(DeepSeekV4CompressedPoolHost(4), PoolName.DEEPSEEK_V4_C4)

        class OpaquePoolHost:
            page_size, layout, size = 1, "page_first", 4

        with pytest.raises(flexkvd.InvalidArgument, match="'mamba' \\(OpaquePoolHost\\).*no get_data_page"):
            s.register_mem_host_pool_v2(OpaquePoolHost(), PoolName.MAMBA)
        assert s.pools.pool_names() == []
    finally:
        s.close()


def test_v2_calls_never_raise_into_sglang_threads(daemon, caplog) -> None:
    kv = MHATokenToKVPoolHost(4)
    s = attach(daemon, [PoolEntry(PoolName.KV, kv)])
    keys = page_keys(51, 2)
    try:
        assert backup(s, keys, range(2), []) == 2
        with caplog.at_level(logging.ERROR):
            # A pool that was never registered: misses, one error logged.
            unregistered = PoolTransfer(PoolName.MAMBA, host_indices=np.array([0]), keys=[keys[1]],
                                        hit_policy=PoolHitPolicy.TRAILING_PAGES)
            r = s.batch_exists_v2(keys, [unregistered])
            assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {PoolName.KV: 2})
            assert s.batch_get_v2([unregistered]) == {PoolName.MAMBA: [False]}
            assert s.batch_set_v2([unregistered]) == {PoolName.MAMBA: [False]}
            assert "never registered" in caplog.text
            # Host indices that are not one page per key, or outside the pool.
            s.register_mem_host_pool_v2(MambaPoolHost(4), PoolName.MAMBA)
            wrong = PoolTransfer(PoolName.MAMBA, host_indices=np.array([0, 1]), keys=[keys[1]])
            assert s.batch_set_v2([wrong]) == {PoolName.MAMBA: [False]}
            assert "2 host indices for 1 keys" in caplog.text
            outside = PoolTransfer(PoolName.MAMBA, host_indices=np.array([9]), keys=[keys[1]])
            assert s.batch_set_v2([outside]) == {PoolName.MAMBA: [False]}
            assert "not the start of a page" in caplog.text
            assert s.batch_get_v2([PoolTransfer(PoolName.MAMBA, keys=[keys[0]])]) == {PoolName.MAMBA: [False]}
            assert s.batch_get_v2([]) == {} and s.batch_set_v2([PoolTransfer(PoolName.MAMBA, keys=[])]) == \
                {PoolName.MAMBA: []}
            # The v1 zero-copy calls likewise: too few host indices, an index outside the pool.
            assert s.batch_get_v1(keys, kv_indices([0])) == [False, False]
            assert s.batch_set_v1(keys[:1], np.array([10 ** 6] * PAGE, dtype=np.int64)) == [False]
            assert "batch_get_v1 of 2 keys refused" in caplog.text and "batch_set_v1 of 1 keys refused" in caplog.text
    finally:
        s.close()


def test_daemon_restarted_mid_use_with_hybrid_pools(make_daemon) -> None:
    daemon = make_daemon(["--max-domains", "2"])
    n = 6
    keys, later = page_keys(61, n), page_keys(62, 2)
    kv, mamba = MHATokenToKVPoolHost(3 * n), MambaPoolHost(8)
    for p in range(n + 2):
        kv.fill(61, p)
    mamba.fill(61, 0)
    mamba.fill(61, 1)
    s = attach(daemon, [PoolEntry(PoolName.KV, kv), PoolEntry(PoolName.MAMBA, mamba)],
               extra={"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "connect_timeout_s": 0.2})
    try:
        assert backup(s, keys, range(n), [mamba_at(mamba, 0, keys[-1])]) == n
        daemon.kill()
        # Misses, at once, from every call; nothing raises.
        assert s.batch_exists_v2(keys, [mamba_at(mamba, 3, "x")]).kv_hit_pages == 0
        assert s.batch_get_v2([mamba_at(mamba, 3, keys[-1])]) == {PoolName.MAMBA: [False]}
        assert s.batch_set_v2([mamba_at(mamba, 1, later[-1])]) == {PoolName.MAMBA: [False]}
        assert s.batch_get_v1(keys, kv_indices(range(n, 2 * n))) == [False] * n
        daemon.restart()
        for _ in range(300):
            if s.batch_exists_v2(keys, [mamba_at(mamba, 3, "x")]).kv_hit_pages == n:
                break
            time.sleep(0.02)
        assert all(p.stats().reconnects == 1 for p in s.pools.stores())
        hit, completed, pool_hits = prefetch(s, keys, range(n, 2 * n), [mamba_at(mamba, 3, "x")])
        assert (hit.kv_hit_pages, completed, pool_hits) == (n, n, {PoolName.MAMBA: 1})
        for p in range(n):
            assert np.array_equal(kv.page(n + p), kv.page(p))
        assert mamba.get_data_page(3).tobytes() == mamba.get_data_page(0).tobytes()
        # Stores work again after the restart.
        assert backup(s, later, range(n, n + 2), [mamba_at(mamba, 1, later[-1])]) == 2
        assert s.batch_exists_v2(later, [mamba_at(mamba, 3, "x")]).kv_hit_pages == 2
    finally:
        s.close()


def test_side_pool_namespaces_follow_how_sglang_shards_them() -> None:
    mha = [backend.BackendConfig.from_fields(tp_rank=r, tp_size=2, model_name="m") for r in range(2)]
    assert [c.pool_namespace("swa") for c in mha] == ["sglang/m#swa@tp0of2", "sglang/m#swa@tp1of2"]
    assert [c.pool_namespace("mamba") for c in mha] == ["sglang/m#mamba@tp0of2", "sglang/m#mamba@tp1of2"]
    # Beside MLA K/V (replicated: rank 0 writes, all read) side pools are shared, but a Mamba state is sharded.
    mla = backend.BackendConfig.from_fields(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, is_mla_model=True,
                                            model_name="k", extra_config={"namespace": "kimi"})
    assert mla.namespace == "kimi@pp1of2"
    assert mla.pool_namespace("indexer", ":X:page_first") == "kimi#indexer:X:page_first@pp1of2"
    assert mla.pool_namespace("mamba") == "kimi#mamba@tp1of2@pp1of2"
