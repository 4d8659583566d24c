"""What the SGLang backend's staging copy costs: batch_set / batch_get of one SGLang batch (128 pages) through a
running flexkvd, the engine-side copy between SGLang's host pool and the shared staging area counted apart, beside a
contiguous memcpy of the same bytes measured in the same run; and batch_exists of the same pages (one single-key
match per page, pipelined).

    python3 -m flexkvd.integrations._sglang_bench --socket /path/flexkvd.sock [--pages 128] [--rounds 5]

Pages are Llama-3-8B's (32 layers, 8 KV heads of 128, bf16) at 16 tokens: 2 MiB each. The daemon needs a pool of at
least pages x 2 MiB per layout.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import List

import numpy as np

from ._sglang_layout import HostPoolLayout
from ._sglang_store import PageStore

LAYERS, HEADS, HEAD_BYTES, PAGE = 32, 8, 256, 16


def pool_buffer(layout: str, pages: int) -> np.ndarray:
    n = pages * PAGE
    shape = {"layer_first": (2, LAYERS, n, HEADS, HEAD_BYTES), "page_first": (2, n, LAYERS, HEADS, HEAD_BYTES),
             "page_first_direct": (2, pages, LAYERS, PAGE, HEADS, HEAD_BYTES)}[layout]
    buf = np.empty(shape, dtype=np.uint8)
    buf[...] = np.random.default_rng(0).integers(0, 256, size=shape[-1], dtype=np.uint8)
    return buf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n = args.pages
    for layout in ("layer_first", "page_first", "page_first_direct"):
        pool = HostPoolLayout(pool_buffer(layout, 2 * n), layout, PAGE, False, 2)
        idx_src = np.arange(n * PAGE, dtype=np.int64)
        idx_dst = np.arange(n * PAGE, 2 * n * PAGE, dtype=np.int64)
        memcpy: List[float] = []
        src = np.ones(n * pool.page_bytes, np.uint8)
        dst = np.zeros_like(src)
        dst[...] = 0  # fault its pages in before timing
        with PageStore(pool, "bench/llama3-8b-page16", socket_path=args.socket, staging_pages=n) as store:
            set_s, set_copy, get_s, get_copy, exists_s = [], [], [], [], []
            for r in range(args.rounds + 1):  # round 0 warms up (page faults in the pools), not counted
                keys = [f"bench-{layout}-{r}-{i}" for i in range(n)]
                before = store.stats().copy_seconds
                t0 = time.perf_counter()
                ok = store.batch_set(keys, idx_src)
                set_s.append(time.perf_counter() - t0)
                mid = store.stats().copy_seconds
                set_copy.append(mid - before)
                t0 = time.perf_counter()
                hits = store.batch_exists(keys)
                exists_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = store.batch_get(keys, idx_dst)
                get_s.append(time.perf_counter() - t0)
                get_copy.append(store.stats().copy_seconds - mid)
                if not (all(ok) and all(got) and hits == n):
                    print(f"{layout}: set {sum(ok)}/{n}, get {sum(got)}/{n}: pool too small or daemon busy")
                    return 1
                t0 = time.perf_counter()
                np.copyto(dst, src)
                memcpy.append(time.perf_counter() - t0)
                if r == 0:
                    for samples in (set_s, set_copy, get_s, get_copy, exists_s, memcpy):
                        samples.clear()
        mib = n * pool.page_bytes / 2**20

        def line(what: str, total: List[float], copy: List[float]) -> str:
            t, c = statistics.median(total), statistics.median(copy)
            return (f"  {what}: {t * 1e3:7.1f} ms ({mib / 1024 / t:5.2f} GiB/s), engine copy {c * 1e3:6.1f} ms "
                    f"({mib / 1024 / c:5.2f} GiB/s, {100 * c / t:4.1f}% of the call)")

        m = statistics.median(memcpy)
        print(f"{layout}: {n} pages of {pool.page_bytes >> 20} MiB ({mib:.0f} MiB), median of {args.rounds}; "
              f"contiguous memcpy {m * 1e3:.1f} ms ({mib / 1024 / m:.2f} GiB/s)")
        print(line("batch_set_v1", set_s, set_copy))
        print(line("batch_get_v1", get_s, get_copy))
        e = statistics.median(exists_s)
        print(f"  batch_exists: {e * 1e3:7.2f} ms for {n} hits ({e / n * 1e6:.1f} us a page, one match each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
