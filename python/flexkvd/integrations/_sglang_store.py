"""PageStore: SGLang HiCache pages kept in flexkvd, the logic behind flexkvd.integrations.sglang with plain arguments
(string page keys, host token indices, NumPy arrays), so it runs and is tested without SGLang.

Keys. SGLang names a page by a chained hash string (sha256 over the page's tokens and the previous page's hash), so
one key already names its whole prefix. flexkvd keeps a prefix tree and its Load copies a match's blocks from the
root; SGLang reads pages that follow a prefix it already holds in host memory, so hanging page i under page i-1
would make every read copy the whole prefix again. Each page is therefore stored as a one-block prompt under the
root (BlockKey = BLAKE2b-128 of the key's UTF-8 bytes): exists, get and set need no parent, SGLang's prefix_keys are
not needed, and a page evicted from the middle of a prefix makes the leading count stop there, which is what
SGLang's batch_exists and batch_get_v1 expect. Requests are pipelined: one ring request per page, all submitted
before the first wait.

Copies. SGLang allocates its host pool itself (pinned torch tensors); a dynamic backend cannot provide that memory
(pool_host/common.py, get_allocator_from_storage, knows only mooncake, mori and shm). flexkvd copies only into
memory it shares with the client (create_host_kv), so this class keeps a staging area of `staging_pages` blocks
there: batch_set copies each page from the pool into staging (one NumPy copy, strided per layout) and flexkvd copies
staging into its pool; batch_get is the reverse. That is one memcpy per page in the engine beyond what a zero-copy
backend does, and it is counted (copy_seconds in stats()).

Failures. Every wait is bounded by op_timeout_s. When the daemon is unreachable (Unavailable, a lost session, a
timeout) the connection is dropped and every call answers "not there" (exists 0, get False, set False) at once
until a reconnect succeeds. A call made without a connection starts a reconnect in a background thread once the
backoff has passed (it doubles from backoff_initial_s to backoff_max_s) and answers at once. A page that cannot be
read is reported False, never filled with other bytes.

Thread safety: all methods may be called from several threads at once (SGLang's prefetch, prefetch-IO and backup
threads do); staging blocks are handed out under a lock, so concurrent calls copy disjoint blocks.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import client as _client
from ..errors import Error, InvalidArgument, StatusCode
from ..geometry import Layout
from ..keys import BlockKeys
from ._sglang_layout import FlatPagePool, HostPoolLayout

# Fills a staging block (a page into it) or drains one (it into a page).
_BlockCopy = Callable[[np.ndarray], None]

logger = logging.getLogger(__name__)

# Errors that end one request and say nothing about the session: the pool full of pinned blocks, another store of
# the block in progress, a handle or block gone. Any other error (Unavailable, FailedPrecondition for a lost
# session or lapsed pins, DeadlineExceeded) drops the connection.
_PER_REQUEST_CODES = frozenset({StatusCode.RESOURCE_EXHAUSTED, StatusCode.ABORTED, StatusCode.NOT_FOUND,
                                StatusCode.OUT_OF_RANGE})


def page_block_key(key: str) -> Tuple[int, int]:
    """The flexkvd BlockKey (lo, hi) of an SGLang page key: BLAKE2b with a 16-byte digest, little-endian halves.
    The all-zero key, which flexkvd refuses, is moved to (1, 0)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    lo, hi = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")
    return (lo, hi) if lo or hi else (1, 0)


@dataclasses.dataclass
class PageStoreStats:
    """Counters since the store was made (pages, bytes, seconds), and the per-call samples SGLang's
    StorageMetrics takes, drained by take_samples()."""

    exists_calls: int = 0
    exists_pages: int = 0
    exists_hits: int = 0
    get_pages: int = 0
    get_hits: int = 0
    set_pages: int = 0
    set_done: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    copy_seconds: float = 0.0     # the engine-side copies between SGLang's pool and the staging area
    errors: int = 0               # requests that ended with an error other than "not cached"
    disconnects: int = 0
    reconnects: int = 0
    connected: bool = False
    prefetch_pgs: List[int] = dataclasses.field(default_factory=list)
    backup_pgs: List[int] = dataclasses.field(default_factory=list)
    prefetch_bandwidth: List[float] = dataclasses.field(default_factory=list)  # GB/s
    backup_bandwidth: List[float] = dataclasses.field(default_factory=list)


class _Unreachable(Exception):
    """The daemon is not reachable now (down, backing off, or the session was lost during the call)."""


class _Connection:
    """One attached session and its staging area; replaced as a whole on reconnect."""

    def __init__(self, client: "_client.Client", staging: np.ndarray) -> None:
        self.client = client
        self.staging = staging  # (blocks, layer, plane, token, head, byte), in memory shared with flexkvd
        self.free = list(range(staging.shape[0]))


class PageStore:
    """SGLang pages in flexkvd for one engine process (one TP rank); see the module docstring.

    socket_path: flexkvd's socket (None: $FLEXKV_SOCKET, else the default). namespace: the cache domain (sessions
    share pages within it). pool: the SGLang host pool the v1 calls copy from and to (a K/V pool's layout, or a
    hybrid model's side pool seen through its flat pages). staging_pages: blocks of the
    staging area (a call with more pages runs in parts). name: the session name flexkvctl shows.
    The first connection is made here (failures are logged and retried later, never raised); close() ends it.
    """

    def __init__(self, pool: Union[HostPoolLayout, FlatPagePool], namespace: str, socket_path: Optional[str] = None,
                 staging_pages: int = 64, name: str = "sglang", connect_timeout_s: float = 1.0,
                 op_timeout_s: float = 30.0, backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if staging_pages < 1:
            raise InvalidArgument(f"staging_pages {staging_pages}; expected at least 1")
        self.pool = pool
        self.geometry = pool.geometry()
        self.namespace = namespace
        self.socket_path = socket_path
        self.staging_pages = staging_pages
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.op_timeout_s = op_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._staging_freed = threading.Condition(self._lock)
        self._conn: Optional[_Connection] = None
        self._retry_at = 0.0
        self._backoff = backoff_initial_s
        self._closed = False
        self._stats = PageStoreStats()
        self._reconnecting: Optional[threading.Thread] = None
        self._connect_if_due()  # the first attempt in the caller's thread: the store is usable when made

    # ---- lifetime ----

    def close(self) -> None:
        """Ends the session (idempotent); later calls answer "not there"."""
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
            self._stats.connected = False
            self._staging_freed.notify_all()
        if conn is not None:
            conn.client.close()

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._conn is not None

    # ---- the HiCache operations ----

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading pages of `keys` flexkvd holds (0 while it is unreachable)."""
        hits = _leading(self._present(keys))
        with self._lock:
            self._stats.exists_calls += 1
            self._stats.exists_pages += len(keys)
            self._stats.exists_hits += hits
        return hits

    def batch_present(self, keys: Sequence[str]) -> List[bool]:
        """Whether flexkvd holds each page of `keys` (all False while it is unreachable); for a hybrid model's side
        pools, whose hit rule looks at pages past a missing one."""
        found = self._present(keys)
        with self._lock:
            self._stats.exists_calls += 1
            self._stats.exists_pages += len(keys)
            self._stats.exists_hits += sum(found)
        return found

    def _present(self, keys: Sequence[str]) -> List[bool]:
        if not keys:
            return []
        try:
            conn = self._connection()
            tickets = [conn.client.match(BlockKeys([page_block_key(k)])) for k in keys]
            # Every result is taken, also after the first miss: libflexkv keeps a result until it is waited for.
            return [self._wait(conn, t).matched_blocks == 1 for t in tickets]
        except _Unreachable:
            return [False] * len(keys)

    def batch_get(self, keys: Sequence[str], host_indices: Sequence[int]) -> List[bool]:
        """Reads pages keys[i] into the pool's page starting at host token index host_indices[i * page_size].
        True for the leading pages read; False from the first page that is not cached (or not readable) on, and
        those pages' host memory is left as it was."""
        pages = self._pages(keys, host_indices)
        sinks = [self._page_sink(p) for p in pages]
        results = [False] * len(keys)
        start = time.perf_counter()
        done = 0
        try:
            while done < len(keys):
                n = self._get_part(keys[done:], sinks[done:], results, done)
                done += n
                if not all(results[:done]):
                    break
        except _Unreachable:
            pass
        hits = _leading(results)
        self._record_transfer("get", len(keys), hits, start)
        return results

    def batch_set(self, keys: Sequence[str], host_indices: Sequence[int]) -> List[bool]:
        """Stores the pool's pages (host token indices host_indices[i * page_size]) as keys[i]. True for each page
        flexkvd holds afterwards (newly stored or already there); False for the others."""
        pages = self._pages(keys, host_indices)
        results = [False] * len(keys)
        start = time.perf_counter()
        done = 0
        try:
            while done < len(keys):
                done += self._set_part(keys[done:], [self._page_source(p) for p in pages[done:]], results, done)
        except _Unreachable:
            pass
        self._record_transfer("set", len(keys), sum(results), start)
        return results

    def get_flat(self, keys: Sequence[str], targets: Sequence[Optional[np.ndarray]]) -> List[Optional[np.ndarray]]:
        """The generic (non-v1) read: each page as SGLang's flat data page, written into targets[i] when given (a
        flat array of one page's bytes) or a new uint8 array. None from the first page that is not cached on."""
        if not isinstance(self.pool, HostPoolLayout):
            raise InvalidArgument("flat pages are read only from a K/V host pool")
        out: List[Optional[np.ndarray]] = [None] * len(keys)
        sinks: List[_BlockCopy] = []
        for i, target in enumerate(targets):
            arr = np.zeros(self.pool.page_bytes, np.uint8) if target is None else target
            out[i] = arr
            sinks.append(_copy_into(self.pool.flat_page_view(arr)))
        results = [False] * len(keys)
        start = time.perf_counter()
        try:
            done = 0
            while done < len(keys):
                done += self._get_part(keys[done:], sinks[done:], results, done)
                if not all(results[:done]):
                    break
        except _Unreachable:
            pass
        hits = _leading(results)
        self._record_transfer("get", len(keys), hits, start)
        return [out[i] if i < hits else None for i in range(len(keys))]

    def set_flat(self, keys: Sequence[str], values: Sequence[np.ndarray]) -> List[bool]:
        """The generic (non-v1) write: values[i] is page keys[i] as SGLang's flat data page."""
        if not isinstance(self.pool, HostPoolLayout):
            raise InvalidArgument("flat pages are written only from a K/V host pool")
        views = [self.pool.flat_page_view(v) for v in values]
        if len(views) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys and {len(views)} values; expected one value per key")
        results = [False] * len(keys)
        start = time.perf_counter()
        try:
            done = 0
            while done < len(keys):
                done += self._set_part(keys[done:], [_copy_from(v) for v in views[done:]], results, done)
        except _Unreachable:
            pass
        self._record_transfer("set", len(keys), sum(results), start)
        return results

    def stats(self) -> PageStoreStats:
        """A copy of the counters (samples included, not drained)."""
        with self._lock:
            return dataclasses.replace(self._stats, prefetch_pgs=list(self._stats.prefetch_pgs),
                                       backup_pgs=list(self._stats.backup_pgs),
                                       prefetch_bandwidth=list(self._stats.prefetch_bandwidth),
                                       backup_bandwidth=list(self._stats.backup_bandwidth))

    def take_samples(self) -> PageStoreStats:
        """The counters, with the per-call samples since the last take_samples() (which are then dropped)."""
        with self._lock:
            s = self._stats
            taken = dataclasses.replace(s)
            s.prefetch_pgs, s.backup_pgs, s.prefetch_bandwidth, s.backup_bandwidth = [], [], [], []
            return taken

    # ---- one part of a call: at most as many pages as staging blocks can be had ----

    def _page_source(self, page: int) -> _BlockCopy:
        return lambda block: self.pool.copy_to_block(page, block)

    def _page_sink(self, page: int) -> _BlockCopy:
        return lambda block: self.pool.copy_from_block(block, page)

    def _get_part(self, keys: Sequence[str], sinks: Sequence[_BlockCopy], results: List[bool], offset: int) -> int:
        """Reads the leading pages of `keys` that fit in the staging blocks it gets, draining staging block i through
        sinks[i]; returns how many it handled (results[offset + i] set for each). Raises _Unreachable."""
        conn, blocks = self._take_staging(len(keys))
        n = len(blocks)
        try:
            handles: List[int] = []  # every pin taken, released below whatever happens
            try:
                matches = [conn.client.match(BlockKeys([page_block_key(k)]), pin=True) for k in keys[:n]]
                hit_handles: List[int] = []  # the leading pages' pins
                for t in matches:
                    r = self._wait(conn, t, not_cached_ok=True)
                    if r is not None and r.match_handle:
                        handles.append(r.match_handle)
                        if len(hit_handles) == len(handles) - 1 and r.matched_blocks == 1:
                            hit_handles.append(r.match_handle)
                loads = [conn.client.load(h, [blocks[i]]) for i, h in enumerate(hit_handles)]
                # Every load is waited for, also after a failed one: a staging block goes back to the free list
                # only once no copy into it is in flight.
                landed = [r is not None and r.done_blocks == 1
                          for r in [self._wait(conn, t, not_cached_ok=True) for t in loads]]
                loaded = _leading(landed)
            finally:
                self._release(conn, handles)
            copy_start = time.perf_counter()
            for i in range(loaded):
                sinks[i](_staging_block(conn, blocks[i]))
                results[offset + i] = True
            with self._lock:
                self._stats.copy_seconds += time.perf_counter() - copy_start
                self._stats.bytes_loaded += loaded * self.pool.page_bytes
            return n
        finally:
            self._give_staging(conn, blocks)

    def _set_part(self, keys: Sequence[str], sources: Sequence[_BlockCopy], results: List[bool], offset: int) -> int:
        """Stores the leading pages of `keys` that fit in the staging blocks it gets, sources[i] filling staging
        block i; returns how many it handled. Raises _Unreachable."""
        conn, blocks = self._take_staging(len(keys))
        n = len(blocks)
        try:
            copy_start = time.perf_counter()
            for i in range(n):
                sources[i](_staging_block(conn, blocks[i]))
            with self._lock:
                self._stats.copy_seconds += time.perf_counter() - copy_start
            stores = [conn.client.store(BlockKeys([page_block_key(keys[i])]), [blocks[i]]) for i in range(n)]
            stored = 0
            for i, t in enumerate(stores):
                r = self._wait(conn, t, not_cached_ok=True)
                if r is not None and (r.matched_blocks == 1 or r.done_blocks == 1):
                    results[offset + i] = True
                    stored += r.done_blocks
            with self._lock:
                self._stats.bytes_stored += stored * self.pool.page_bytes
            return n
        finally:
            self._give_staging(conn, blocks)

    # ---- requests ----

    def _wait(self, conn: _Connection, ticket: "_client.Ticket", not_cached_ok: bool = False
              ) -> Optional["_client.OpResult"]:
        """The request's result. With not_cached_ok, a request that ended with a per-request error (the page not
        cached, the pool full of pinned blocks, another store in progress) gives None. Raises _Unreachable (after
        dropping the connection) for a lost daemon or session, and for a request that did not end in time (it may
        still copy into its staging block, which must then never be reused)."""
        try:
            return ticket.wait(self.op_timeout_s)
        except Error as e:
            if not_cached_ok and e.code in _PER_REQUEST_CODES:
                with self._lock:
                    self._stats.errors += 1
                return None
            self._drop(conn, e)
            raise _Unreachable() from e

    def _release(self, conn: _Connection, handles: Sequence[int]) -> None:
        """Drops the pins of `handles`; a failure only costs the connection (pins end with the session)."""
        try:
            for t in [conn.client.release(h) for h in handles]:
                t.wait(self.op_timeout_s)
        except Error as e:
            self._drop(conn, e)

    def _pages(self, keys: Sequence[str], host_indices: Sequence[int]) -> List[int]:
        """The pool page of each key from SGLang's token indices (one page_size run per key)."""
        idx = np.asarray(host_indices).reshape(-1)
        t = self.pool.page_size
        if idx.size != len(keys) * t:
            raise InvalidArgument(f"{idx.size} host indices for {len(keys)} pages; expected {len(keys) * t} "
                                  f"(page_size {t} per key)")
        return [self.pool.page_of(int(idx[i * t])) for i in range(len(keys))]

    def _record_transfer(self, op: str, pages: int, hits: int, start: float) -> None:
        seconds = time.perf_counter() - start
        gbps = hits * self.pool.page_bytes / seconds / 1e9 if hits and seconds > 0 else 0.0
        with self._lock:
            s = self._stats
            if op == "get":
                s.get_pages += pages
                s.get_hits += hits
                if hits:
                    s.prefetch_pgs.append(hits)
                    s.prefetch_bandwidth.append(gbps)
            else:
                s.set_pages += pages
                s.set_done += hits
                if hits:
                    s.backup_pgs.append(hits)
                    s.backup_bandwidth.append(gbps)

    # ---- connection and staging ----

    def _connection(self) -> _Connection:
        """The current connection; without one, starts a reconnect in the background when the backoff has passed
        (an attach to a daemon that hangs can take the control plane's deadline, 10 s, which must not stall
        SGLang's storage threads) and raises _Unreachable."""
        with self._lock:
            conn = self._conn
            if conn is not None:
                return conn
            due = not self._closed and self._clock() >= self._retry_at and \
                (self._reconnecting is None or not self._reconnecting.is_alive())
            if due:
                self._reconnecting = threading.Thread(target=self._connect_if_due, name="flexkv-sglang-reconnect",
                                                      daemon=True)
                self._reconnecting.start()
        raise _Unreachable()

    def _connect_if_due(self) -> Optional[_Connection]:
        """Connects and attaches when not connected and the backoff has passed; None when that is not now or it
        failed (logged, and the backoff doubled)."""
        with self._lock:
            if self._closed:
                return None
            if self._conn is not None:
                return self._conn
            if self._clock() < self._retry_at:
                return None
            self._retry_at = self._clock() + self._backoff  # one attempt per backoff, whichever thread makes it
        client = None
        try:
            client = _client.connect(self.socket_path, timeout=self.connect_timeout_s)
            client.attach(self.name, self.namespace, self.geometry)
            buf = client.create_host_kv(Layout.BLOCK_FIRST, self.staging_pages)
            staging = np.frombuffer(buf, dtype=np.uint8).reshape((self.staging_pages,) + self.pool.block_shape)
        except Error as e:
            if client is not None:
                client.close()
            with self._lock:
                first = self._backoff == self.backoff_initial_s
                self._backoff = min(self._backoff * 2, self.backoff_max_s)
            log = logger.warning if first else logger.debug
            log("flexkvd at %s not usable (%s: %s); HiCache storage answers misses, retrying in %.1f s",
                self.socket_path or "$FLEXKV_SOCKET", type(e).__name__, e, self._backoff)
            return None
        with self._lock:
            if self._closed or self._conn is not None:
                racing = True
            else:
                racing = False
                self._conn = _Connection(client, staging)
                if self._stats.disconnects:
                    self._stats.reconnects += 1
                self._stats.connected = True
                self._backoff = self.backoff_initial_s
                conn = self._conn
        if racing:
            del staging, buf
            client.close()
            return self._conn
        logger.info("flexkvd session %s attached in namespace %r (%d staging pages of %d bytes)",
                    client.session_id, self.namespace, self.staging_pages, self.pool.page_bytes)
        return conn

    def _drop(self, conn: _Connection, err: Exception) -> None:
        """Forgets `conn` (if it is still the current one) after `err`; the next call after the backoff reconnects.
        Staging blocks of the old connection are never handed out again."""
        with self._lock:
            if self._conn is not conn:
                return
            self._conn = None
            self._stats.disconnects += 1
            self._stats.connected = False
            self._retry_at = self._clock() + self._backoff
            self._staging_freed.notify_all()
        logger.warning("flexkvd session lost (%s: %s); HiCache storage answers misses until it reconnects",
                       type(err).__name__, err)
        conn.client.close()  # keeps the mapping until the views other threads still hold are gone

    def _take_staging(self, wanted: int) -> Tuple[_Connection, List[int]]:
        """Between 1 and `wanted` free staging blocks of the current connection, waiting (bounded) for one.
        Raises _Unreachable when there is no connection or none frees up in time."""
        conn = self._connection()
        deadline = time.monotonic() + self.op_timeout_s
        with self._lock:
            while self._conn is conn and not conn.free:
                left = deadline - time.monotonic()
                if left <= 0 or not self._staging_freed.wait(left):
                    raise _Unreachable()
            if self._conn is not conn:
                raise _Unreachable()
            n = min(wanted, len(conn.free))
            blocks, conn.free = conn.free[:n], conn.free[n:]
            return conn, blocks

    def _give_staging(self, conn: _Connection, blocks: List[int]) -> None:
        with self._lock:
            if self._conn is conn:
                conn.free.extend(blocks)
                self._staging_freed.notify_all()


def _staging_block(conn: _Connection, block: int) -> np.ndarray:
    """Staging block `block` of `conn` (a view into memory shared with flexkvd)."""
    return conn.staging[block]


def _copy_into(dst: np.ndarray) -> _BlockCopy:
    return lambda block: np.copyto(dst, block)


def _copy_from(src: np.ndarray) -> _BlockCopy:
    return lambda block: np.copyto(block, src)


def _leading(results: Sequence[bool]) -> int:
    """The number of leading True values."""
    n = 0
    for r in results:
        if not r:
            break
        n += 1
    return n
