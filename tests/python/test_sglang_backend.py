"""flexkvd.integrations.sglang against a real flexkvd: SGLang's HiCache storage calls, made in the order SGLang's
HiCacheController makes them, with real bytes in SGLang-shaped host pools (NumPy stands in for the pinned torch
tensors; SGLang and torch are not installable here).

The call sequences are written from sgl-project/sglang python/sglang/srt/managers/cache_controller.py:
  backup:   _page_backup walks operation.hash_value in batches of STORAGE_BATCH_SIZE (128) pages, calls
            batch_set_v1(batch_hashes, host_indices[i*page_size:(i+len(batch))*page_size], extra_info) through
            _page_set_zero_copy (all(...)), and stops at the first batch that is not all True;
  prefetch: _storage_hit_query calls batch_exists(batch_hashes, extra_info) per batch of 128 and stops at the first
            short answer; _page_transfer then calls batch_get_v1(batch_hashes, host_indices slice, extra_info)
            per batch (_page_get_zero_copy counts the leading True results and stops at the first False).
Page keys are SGLang's (mem_cache/utils.py get_hash_str: sha256 chained over the previous hash and the page's
tokens as little-endian uint32), host indices are token indices of whole pages.
"""
from __future__ import annotations

import hashlib
import importlib
import sys
import threading
import time
from typing import List, Optional, Sequence

import numpy as np
import pytest

import flexkvd
from flexkvd.integrations import sglang as backend
from flexkvd.integrations._sglang_layout import HostPoolLayout
from flexkvd.integrations._sglang_store import PageStore

STORAGE_BATCH_SIZE = 128  # sglang/srt/mem_cache/hicache_storage.py
PAGE = 16                  # tokens per page
LAYERS, HEADS, HEAD_DIM, DTYPE_BYTES = 2, 2, 64, 2   # 16 KiB pages (4 KiB per layer and plane)
MLA_DIM = 128              # MLA latent width in elements: 4 KiB per layer


# ---- SGLang stand-ins: keys, host pools, the controller's loops ----

def page_keys(seed: int, pages: int, prior: Optional[str] = None) -> List[str]:
    """SGLang page hashes of a prompt of `pages` pages (get_hash_str: chained sha256 hex)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 128000, size=pages * PAGE, dtype=np.uint32)
    keys, last = [], prior
    for p in range(pages):
        h = hashlib.sha256()
        if last:
            h.update(bytes.fromhex(last))
        h.update(tokens[p * PAGE:(p + 1) * PAGE].astype("<u4").tobytes())
        last = h.hexdigest()
        keys.append(last)
    return keys


def make_pool(layout: str, is_mla: bool, pages: int) -> np.ndarray:
    """A zeroed SGLang host pool buffer (bytes) of `pages` pages in `layout` (pool_host/mha.py, mla.py)."""
    L, H, B, T, N = LAYERS, HEADS, HEAD_DIM * DTYPE_BYTES, PAGE, pages * PAGE
    if is_mla:
        B = MLA_DIM * DTYPE_BYTES
        shape = {"layer_first": (L, N, 1, B), "page_first": (N, L, 1, B),
                 "page_first_direct": (pages, L, T, 1, B)}[layout]
    else:
        shape = {"layer_first": (2, L, N, H, B), "page_first": (2, N, L, H, B),
                 "page_first_direct": (2, pages, L, T, H, B), "page_head": (2, pages, H, T, L, B)}[layout]
    return np.zeros(shape, dtype=np.uint8)


def page_content(layout: HostPoolLayout, seed: int, i: int) -> np.ndarray:
    """Page i of prompt `seed`: random bytes in (layer, plane, token, head, byte) order."""
    return np.random.default_rng([seed, i]).integers(1, 256, size=layout.block_shape, dtype=np.uint8)


def host_indices(pages: Sequence[int]) -> np.ndarray:
    """SGLang's host indices of whole pages: page_size token indices per page."""
    return np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE, dtype=np.int64) for p in pages])


def backup(store: PageStore, keys: List[str], idx: np.ndarray) -> int:
    """HiCacheController._page_backup with _page_set_zero_copy; returns the pages written (completed_tokens/page)."""
    done = 0
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i:i + STORAGE_BATCH_SIZE]
        if not all(store.batch_set(batch, idx[i * PAGE:(i + len(batch)) * PAGE])):
            break
        done += len(batch)
    return done


def hit_query(store: PageStore, keys: List[str]) -> List[str]:
    """HiCacheController._storage_hit_query: the leading keys storage holds, asked batch by batch."""
    hits: List[str] = []
    for start in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[start:start + STORAGE_BATCH_SIZE]
        n = store.batch_exists(batch)
        hits.extend(batch[:n])
        if n < len(batch):
            break
    return hits


def transfer(store: PageStore, keys: List[str], idx: np.ndarray) -> int:
    """HiCacheController._page_transfer with _page_get_zero_copy; returns the pages read."""
    completed = 0
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i:i + STORAGE_BATCH_SIZE]
        results = store.batch_get(batch, idx[i * PAGE:(i + len(batch)) * PAGE])
        inc = next((j for j, r in enumerate(results) if not r), len(batch))
        completed += inc
        if inc != len(batch):
            break
    return completed


def fill(layout: HostPoolLayout, seed: int, pages: Sequence[int]) -> None:
    for i, p in enumerate(pages):
        layout.page_view(p)[...] = page_content(layout, seed, i)


def open_store(daemon, layout: HostPoolLayout, namespace: str = "sglang/test", **kw) -> PageStore:
    kw.setdefault("staging_pages", 8)
    kw.setdefault("op_timeout_s", 10.0)
    return PageStore(layout, namespace, socket_path=daemon.socket, **kw)


LAYOUTS = [(l, False) for l in ("layer_first", "page_first", "page_first_direct", "page_head")] + \
          [(l, True) for l in ("layer_first", "page_first", "page_first_direct")]


# ---- tests ----

@pytest.mark.parametrize("layout_name,is_mla", LAYOUTS, ids=[f"{'mla' if m else 'mha'}-{l}" for l, m in LAYOUTS])
def test_backup_then_prefetch_is_byte_exact(daemon, layout_name: str, is_mla: bool) -> None:
    # 150 pages cross SGLang's 128-page batch and the 8-page staging area; read back into other host pages.
    n = 150
    pool = HostPoolLayout(make_pool(layout_name, is_mla, 2 * n), layout_name, PAGE, is_mla, DTYPE_BYTES)
    keys = page_keys(1, n)
    src, dst = list(range(n)), list(range(n, 2 * n))
    fill(pool, 1, src)
    with open_store(daemon, pool) as store:
        assert hit_query(store, keys) == []
        assert backup(store, keys, host_indices(src)) == n
        assert hit_query(store, keys) == keys
        assert transfer(store, keys, host_indices(dst)) == n
        for i, p in enumerate(dst):
            assert np.array_equal(pool.page_view(p), page_content(pool, 1, i)), f"page {i}"
        s = store.stats()
        assert (s.set_done, s.get_hits, s.bytes_stored, s.bytes_loaded) == (n, n, n * pool.page_bytes,
                                                                            n * pool.page_bytes)
        # A second backup of the same pages is answered True (already there) and stores nothing new.
        assert backup(store, keys, host_indices(src)) == n
        assert store.stats().bytes_stored == n * pool.page_bytes


def sglang_element(raw: np.ndarray, layout: str, is_mla: bool, layer: int, plane: int, token: int, head: int
                   ) -> np.ndarray:
    """The bytes of one head of one token as SGLang indexes its host buffer (mha.py / mla.py: k_buffer =
    kv_buffer[0], v_buffer = kv_buffer[1]; page_first_direct and page_head index [page][..][token in page])."""
    p, t = divmod(token, PAGE)
    if is_mla:
        return {"layer_first": lambda: raw[layer, token, 0], "page_first": lambda: raw[token, layer, 0],
                "page_first_direct": lambda: raw[p, layer, t, 0]}[layout]()
    return {"layer_first": lambda: raw[plane, layer, token, head], "page_first": lambda: raw[plane, token, layer, head],
            "page_first_direct": lambda: raw[plane, p, layer, t, head],
            "page_head": lambda: raw[plane, p, head, t, layer]}[layout]()


@pytest.mark.parametrize("layout_name,is_mla", LAYOUTS, ids=[f"{'mla' if m else 'mha'}-{l}" for l, m in LAYOUTS])
def test_page_views_follow_sglang_indexing(layout_name: str, is_mla: bool) -> None:
    raw = make_pool(layout_name, is_mla, 3)
    raw[...] = np.random.default_rng(0).integers(0, 256, size=raw.shape, dtype=np.uint8)
    pool = HostPoolLayout(raw, layout_name, PAGE, is_mla, DTYPE_BYTES)
    page = 2
    view = pool.page_view(page)
    assert np.shares_memory(view, raw)
    L, P, T, H, _ = pool.block_shape
    for layer in range(L):
        for plane in range(P):
            for t in range(T):
                for head in range(H):
                    assert np.array_equal(view[layer, plane, t, head],
                                          sglang_element(raw, layout_name, is_mla, layer, plane, page * PAGE + t, head))


def test_pages_stored_from_one_layout_read_into_another(daemon) -> None:
    # flexkvd keeps a page in one order whatever the engine's layout: two engines of one model share pages.
    n = 6
    keys = page_keys(13, n)
    a = HostPoolLayout(make_pool("layer_first", False, n), "layer_first", PAGE, False, DTYPE_BYTES)
    b_raw = make_pool("page_head", False, n)
    b = HostPoolLayout(b_raw, "page_head", PAGE, False, DTYPE_BYTES)
    fill(a, 13, range(n))
    with open_store(daemon, a) as sa, open_store(daemon, b) as sb:
        assert backup(sa, keys, host_indices(range(n))) == n
        assert transfer(sb, keys, host_indices(range(n))) == n
    for i in range(n):
        for layer in range(LAYERS):
            for plane in range(2):
                for t in range(PAGE):
                    for head in range(HEADS):
                        assert np.array_equal(sglang_element(b_raw, "page_head", False, layer, plane, i * PAGE + t,
                                                             head), sglang_element(a.kv, "layer_first", False, layer,
                                                                                   plane, i * PAGE + t, head))


def test_partial_prefix_counts_and_reads_only_the_leading_pages(daemon) -> None:
    pool = HostPoolLayout(make_pool("page_first", False, 64), "page_first", PAGE, False, DTYPE_BYTES)
    keys = page_keys(2, 20)
    fill(pool, 2, range(20))
    with open_store(daemon, pool) as store:
        assert backup(store, keys[:12], host_indices(range(12))) == 12
        assert store.batch_exists(keys) == 12
        assert store.batch_exists(keys[12:]) == 0
        dst = list(range(32, 52))
        before = [pool.page_view(p).copy() for p in dst]
        results = store.batch_get(keys, host_indices(dst))
        assert results == [True] * 12 + [False] * 8
        for i, p in enumerate(dst):
            expected = page_content(pool, 2, i) if i < 12 else before[i]
            assert np.array_equal(pool.page_view(p), expected), f"page {i}"
        # A prompt that shares the first 12 pages and goes on differently: the shared pages hit, the rest miss.
        other = keys[:12] + page_keys(3, 8, prior=keys[11])
        assert store.batch_exists(other) == 12


def test_a_get_of_evicted_pages_answers_false_and_writes_nothing(make_daemon) -> None:
    daemon = make_daemon(pool_size="2MiB")  # about 120 pages of 16 KiB
    pool = HostPoolLayout(make_pool("layer_first", False, 512), "layer_first", PAGE, False, DTYPE_BYTES)
    first, flood = page_keys(4, 20), page_keys(5, 300)
    fill(pool, 4, range(20))
    fill(pool, 5, range(20, 320))
    with open_store(daemon, pool) as store:
        assert backup(store, first, host_indices(range(20))) == 20
        assert hit_query(store, first) == first
        # Between SGLang's batch_exists and its batch_get other requests fill the pool: `first` is evicted (LRU).
        backup(store, flood, host_indices(range(20, 320)))
        dst = list(range(400, 420))
        for p in dst:
            pool.page_view(p)[...] = 0
        results = store.batch_get(first, host_indices(dst))
        hits = next((i for i, r in enumerate(results) if not r), len(results))
        assert hits < len(first), "the flood should have evicted some of the first prompt's pages"
        assert not any(results[hits:])
        for i, p in enumerate(dst):
            if i < hits:
                assert np.array_equal(pool.page_view(p), page_content(pool, 4, i))
            else:
                assert not pool.page_view(p).any(), f"page {i} was reported missing but written"
        assert store.connected


def test_two_tp_ranks_keep_their_shards_apart(make_daemon) -> None:
    daemon = make_daemon(["--max-domains", "2"])
    n = 24
    keys = page_keys(6, n)
    configs = [backend.BackendConfig.from_fields(tp_rank=r, tp_size=2, model_name="m", extra_config={
        "socket": daemon.socket, "staging_pages": 4}) for r in range(2)]
    assert [c.namespace for c in configs] == ["sglang/m@tp0of2", "sglang/m@tp1of2"]
    pools = [HostPoolLayout(make_pool("page_first_direct", False, 2 * n), "page_first_direct", PAGE, False,
                            DTYPE_BYTES) for _ in range(2)]
    for r in range(2):
        fill(pools[r], 10 + r, range(n))  # each rank's own heads
    stores = [configs[r].open_store(pools[r]) for r in range(2)]
    try:
        # Rank 1 backs up only the first half: SGLang's MIN over the ranks' hit counts then gives 12.
        assert backup(stores[0], keys, host_indices(range(n))) == n
        assert backup(stores[1], keys[:12], host_indices(range(12))) == 12
        assert [len(hit_query(s, keys)) for s in stores] == [n, 12]
        for r in range(2):
            got = transfer(stores[r], keys[:12], host_indices(range(n, n + 12)))
            assert got == 12
            for i in range(12):
                assert np.array_equal(pools[r].page_view(n + i), page_content(pools[r], 10 + r, i))
    finally:
        for s in stores:
            s.close()


def test_mla_ranks_share_one_namespace_written_by_rank_0(daemon) -> None:
    n = 10
    keys = page_keys(7, n)
    configs = [backend.BackendConfig.from_fields(tp_rank=r, tp_size=2, is_mla_model=True, model_name="ds",
                                                 extra_config={"socket": daemon.socket}) for r in range(2)]
    assert configs[0].namespace == configs[1].namespace == "sglang/ds"
    pools = [HostPoolLayout(make_pool("layer_first", True, 2 * n), "layer_first", PAGE, True, DTYPE_BYTES)
             for _ in range(2)]
    fill(pools[0], 7, range(n))
    stores = [c.open_store(p) for c, p in zip(configs, pools)]
    try:
        assert backup(stores[0], keys, host_indices(range(n))) == n  # SGLang skips the backup on rank 1 (MLA)
        assert hit_query(stores[1], keys) == keys
        assert transfer(stores[1], keys, host_indices(range(n, 2 * n))) == n
        for i in range(n):
            assert np.array_equal(pools[1].page_view(n + i), page_content(pools[0], 7, i))
    finally:
        for s in stores:
            s.close()


def test_prefetch_io_and_backup_threads_share_one_backend(daemon) -> None:
    # SGLang calls one backend from its prefetch thread (batch_exists), prefetch-IO thread (batch_get_v1) and
    # backup thread (batch_set_v1) at once (cache_controller.py, _start_storage_threads). A 4-page staging area
    # makes them take turns with its blocks; every page read must still be the one its key names.
    prompts, n = 6, 12
    pool = HostPoolLayout(make_pool("page_first_direct", False, 2 * prompts * n), "page_first_direct", PAGE, False,
                          DTYPE_BYTES)
    keys = [page_keys(100 + j, n) for j in range(prompts)]
    for j in range(prompts):
        fill(pool, 100 + j, range(j * n, (j + 1) * n))
    errors: List[BaseException] = []
    read = [0] * prompts

    def backup_thread() -> None:
        for j in range(prompts):
            assert backup(store, keys[j], host_indices(range(j * n, (j + 1) * n))) == n

    def prefetch_thread(j: int) -> None:
        deadline = time.monotonic() + 30
        while hit_query(store, keys[j]) != keys[j]:  # SGLang would prefill; this test waits for the backup
            assert time.monotonic() < deadline, f"prompt {j} never fully backed up"
            time.sleep(0.001)
        base = (prompts + j) * n
        read[j] = transfer(store, keys[j], host_indices(range(base, base + n)))

    def run(fn, *a) -> None:
        try:
            fn(*a)
        except BaseException as e:  # noqa: B902 - reported below
            errors.append(e)

    with open_store(daemon, pool, staging_pages=4) as store:
        threads = [threading.Thread(target=run, args=(backup_thread,), daemon=True)] + \
                  [threading.Thread(target=run, args=(prefetch_thread, j), daemon=True) for j in range(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and not errors, errors
    assert read == [n] * prompts
    for j in range(prompts):
        for i in range(n):
            assert np.array_equal(pool.page_view((prompts + j) * n + i), page_content(pool, 100 + j, i))


def test_daemon_killed_and_restarted_mid_run(daemon) -> None:
    pool = HostPoolLayout(make_pool("page_first", False, 64), "page_first", PAGE, False, DTYPE_BYTES)
    keys, later = page_keys(8, 10), page_keys(9, 6)
    fill(pool, 8, range(10))
    fill(pool, 9, range(10, 16))
    with open_store(daemon, pool, backoff_initial_s=0.05, backoff_max_s=0.2, connect_timeout_s=0.2) as store:
        assert backup(store, keys, host_indices(range(10))) == 10
        daemon.kill()
        # Every call answers "not there" and returns; nothing waits on the dead daemon.
        assert store.batch_exists(keys) == 0
        assert store.batch_get(keys, host_indices(range(20, 30))) == [False] * 10
        assert store.batch_set(later, host_indices(range(10, 16))) == [False] * 6
        assert not store.connected
        assert store.stats().disconnects == 1
        daemon.restart()
        # The next calls after the backoff reconnect; the pages committed before the kill survived the restart.
        for _ in range(200):
            if store.batch_exists(keys) == 10:
                break
            time.sleep(0.02)
        assert store.connected and store.stats().reconnects == 1
        assert transfer(store, keys, host_indices(range(20, 30))) == 10
        for i in range(10):
            assert np.array_equal(pool.page_view(20 + i), page_content(pool, 8, i))
        assert backup(store, later, host_indices(range(10, 16))) == 6
        assert store.batch_exists(later) == 6


def test_a_hung_daemon_costs_one_timeout_then_misses(daemon) -> None:
    # A daemon that stops answering (SIGSTOP here): the call in flight ends after op_timeout_s, the connection is
    # dropped, and the calls after it answer misses while a reconnect waits in the background; once the daemon
    # answers again the backend is back.
    pool = HostPoolLayout(make_pool("page_first", False, 16), "page_first", PAGE, False, DTYPE_BYTES)
    keys = page_keys(14, 4)
    fill(pool, 14, range(4))
    with open_store(daemon, pool, op_timeout_s=0.3, backoff_initial_s=0.05, backoff_max_s=0.1,
                    connect_timeout_s=0.3) as store:
        assert backup(store, keys, host_indices(range(4))) == 4
        daemon.freeze()
        try:
            assert store.batch_exists(keys) == 0
            time.sleep(0.1)  # past the backoff: the next calls start a reconnect, which hangs on the frozen daemon
            assert store.batch_get(keys, host_indices(range(8, 12))) == [False] * 4
            assert store.batch_set(keys, host_indices(range(4))) == [False] * 4
            assert store.batch_exists(keys) == 0 and not store.connected
        finally:
            daemon.thaw()
        for _ in range(600):
            if store.batch_exists(keys) == 4:
                break
            time.sleep(0.05)
        assert store.stats().disconnects == 1 and store.connected
        assert transfer(store, keys, host_indices(range(8, 12))) == 4
        for i in range(4):
            assert np.array_equal(pool.page_view(8 + i), page_content(pool, 14, i))


def test_no_daemon_answers_misses_without_raising(tmp_path) -> None:
    pool = HostPoolLayout(make_pool("layer_first", False, 4), "layer_first", PAGE, False, DTYPE_BYTES)
    store = PageStore(pool, "sglang/none", socket_path=str(tmp_path / "absent.sock"), connect_timeout_s=0.05)
    try:
        keys = page_keys(1, 2)
        assert store.batch_exists(keys) == 0
        assert store.batch_get(keys, host_indices([0, 1])) == [False, False]
        assert store.batch_set(keys, host_indices([0, 1])) == [False, False]
        assert not store.connected
    finally:
        store.close()


def test_generic_flat_pages_round_trip(daemon) -> None:
    # SGLang's non-v1 path: batch_set(keys, [get_data_page(i, flat=True)]) and batch_get(keys, dummy flat pages).
    raw = make_pool("page_first", False, 8)
    pool = HostPoolLayout(raw, "page_first", PAGE, False, DTYPE_BYTES)
    fill(pool, 12, range(3))
    flat = [raw[:, p * PAGE:(p + 1) * PAGE].copy().reshape(-1) for p in range(3)]  # get_data_page(flat=True)
    keys = page_keys(12, 4)
    with open_store(daemon, pool) as store:
        assert store.set_flat(keys[:3], flat) == [True] * 3
        targets = [np.zeros(pool.page_bytes, np.uint8) for _ in range(4)]
        got = store.get_flat(keys, targets)
        assert got[3] is None
        for i in range(3):
            assert got[i] is targets[i] and np.array_equal(got[i], flat[i])


def test_host_pool_layouts_are_checked() -> None:
    with pytest.raises(flexkvd.InvalidArgument, match="page_first_kv_split"):
        HostPoolLayout(make_pool("layer_first", True, 2), "page_first_kv_split", PAGE, True, DTYPE_BYTES)
    with pytest.raises(flexkvd.InvalidArgument, match="page_head.*MLA|MLA.*page_head|expected one of"):
        HostPoolLayout(make_pool("layer_first", True, 2), "page_head", PAGE, True, DTYPE_BYTES)
    with pytest.raises(flexkvd.InvalidArgument, match="power of two"):
        HostPoolLayout(np.zeros((2, 2, 24, 2, 128), np.uint8), "layer_first", 24, False, DTYPE_BYTES)
    with pytest.raises(flexkvd.InvalidArgument, match="axes"):
        HostPoolLayout(np.zeros((2, 2, 32, 128), np.uint8), "layer_first", PAGE, False, DTYPE_BYTES)
    pool = HostPoolLayout(make_pool("page_head", False, 2), "page_head", PAGE, False, DTYPE_BYTES)
    g = pool.geometry()
    assert (g.tokens_per_block, g.num_layers, g.kv_planes, g.kv_heads_per_rank, g.head_dim, g.tp_size) == \
        (PAGE, LAYERS, 2, HEADS, HEAD_DIM, 1)
    assert g.host_block_bytes == pool.page_bytes
    mla = HostPoolLayout(make_pool("page_first_direct", True, 2), "page_first_direct", PAGE, True, DTYPE_BYTES)
    assert (mla.geometry().kv_planes, mla.geometry().head_dim) == (1, MLA_DIM)
    with pytest.raises(flexkvd.InvalidArgument, match="not the start of a page"):
        pool.page_of(3)


def test_host_indices_must_be_whole_pages(daemon) -> None:
    pool = HostPoolLayout(make_pool("layer_first", False, 4), "layer_first", PAGE, False, DTYPE_BYTES)
    with open_store(daemon, pool) as store:
        with pytest.raises(flexkvd.InvalidArgument, match="host indices"):
            store.batch_set(page_keys(1, 2), np.arange(PAGE))
        with pytest.raises(flexkvd.InvalidArgument, match="not the start of a page"):
            store.batch_get(page_keys(1, 1), np.arange(1, PAGE + 1))


def test_backend_config_from_sglang_fields() -> None:
    c = backend.BackendConfig.from_fields(model_name="meta/llama", extra_config={
        "backend_name": "flexkvd", "module_path": "flexkvd.integrations.sglang", "class_name": "FlexKVdStorage",
        "interface_v1": 1, "namespace": "prod-llama", "staging_pages": 16})
    assert (c.namespace, c.staging_pages, c.zero_copy_interface) == ("prod-llama", 16, True)
    c = backend.BackendConfig.from_fields(tp_rank=1, tp_size=4, pp_rank=1, pp_size=2, model_name="m")
    assert c.namespace == "sglang/m@tp1of4@pp1of2" and not c.zero_copy_interface
    for bad in ({"staging_pages": 0}, {"op_timeout_s": "soon"}, {"socket": 3}, {"namespace": 1}):
        with pytest.raises(flexkvd.InvalidArgument, match=next(iter(bad))):
            backend.BackendConfig.from_fields(extra_config=bad)


def test_adapter_imports_without_sglang_and_says_so_when_its_class_is_requested() -> None:
    module = importlib.reload(backend)
    assert module.BackendConfig is not None  # the plain classes import without SGLang
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    with pytest.raises(ImportError, match="needs SGLang"):
        module.FlexKVdStorage
    # SGLang's loader does getattr(module, class_name) and reports the ImportError it gets.
    with pytest.raises(ImportError, match="sglang.srt.mem_cache.hicache_storage"):
        getattr(sys.modules["flexkvd.integrations.sglang"], "FlexKVdStorage")


def test_storage_metrics_are_found_where_the_running_sglang_keeps_them(monkeypatch):
    """get_stats' StorageMetrics: SGLang moved it out of sglang.srt.metrics.collector (0.5.15); the backend takes it
    from the old module, else from the module that defines HiCacheStorage, else returns the same lists itself."""
    import types

    monkeypatch.setitem(sys.modules, "sglang.srt.metrics.collector", None)  # not importable
    monkeypatch.setitem(sys.modules, "sglang.srt.mem_cache.hicache_storage", None)
    fallback = backend._storage_metrics()
    for field in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
        assert getattr(fallback, field) == []

    class StorageMetrics:  # as the module defining HiCacheStorage would have it
        def __init__(self):
            self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth = [], [], [], []

    moved = types.ModuleType("sglang.srt.mem_cache.hicache_storage")
    moved.StorageMetrics = StorageMetrics
    monkeypatch.setitem(sys.modules, "sglang.srt.mem_cache.hicache_storage", moved)
    assert isinstance(backend._storage_metrics(), StorageMetrics)


def test_the_default_namespace_names_the_kv_dtype_and_an_operators_namespace_is_kept():
    """bf16 and fp16 engines of one served model write other bytes for the same tokens: they must not share pages."""
    base = backend.BackendConfig.from_fields(tp_rank=1, tp_size=2, model_name="m")
    bf16, fp16 = base.with_kv_dtype("torch.bfloat16"), base.with_kv_dtype("torch.float16")
    assert bf16.namespace == "sglang/m|bfloat16@tp1of2" and fp16.namespace == "sglang/m|float16@tp1of2"
    assert bf16.pool_namespace("swa") == "sglang/m|bfloat16#swa@tp1of2"
    assert base.with_kv_dtype("").namespace == "sglang/m@tp1of2"  # a pool that does not say: as before
    given = backend.BackendConfig.from_fields(model_name="m", extra_config={"namespace": "mine"})
    assert given.with_kv_dtype("torch.bfloat16").namespace == "mine"
