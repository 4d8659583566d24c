#!/usr/bin/env python3
"""What the vLLM connector costs vLLM's scheduler thread per request (a benchmark program, not a test): starts a
private flexkvd, stores one prompt per length (so every lookup hits all its blocks), then times SchedulerLogic.get_num_new_matched_tokens for a new
request (keys computed from a Python list, as vLLM hands over all_token_ids, plus an unpinned match), the same call
again (keys cached: the match round trip alone) and request_finished of a prompt flexkvd already holds (nothing to plan). Prints p50/p99 in µs.

  PYTHONPATH=python FLEXKV_LIBRARY=build/libflexkv.so.0 /usr/bin/python3 tests/python/vllm_lookup_bench.py
"""
from __future__ import annotations

import random
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))

import flexkvd  # noqa: E402
from conftest import Daemon  # noqa: E402
from engine_process import TEST_GEOMETRY  # noqa: E402
from flexkvd.integrations._vllm_link import LinkOptions  # noqa: E402
from flexkvd.integrations._vllm_logic import ConnectorConfig, SchedulerLogic  # noqa: E402


def pct(samples: list, q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e6


def main() -> int:
    daemon = Daemon(pool_size="256MiB")
    try:
        daemon.wait_ready()
        cfg = ConnectorConfig(namespace="bench", geometry=TEST_GEOMETRY, link=LinkOptions(socket=daemon.socket))
        sched = SchedulerLogic(cfg)
        rng = random.Random(1)
        print(f"{'tokens':>7} {'new request p50/p99 us':>24} {'asked again p50/p99 us':>24} "
              f"{'request_finished, all cached p50/p99 us':>40}")
        for n in (1024, 8192, 32768):
            tokens = [rng.randrange(128000) for _ in range(n)]
            with flexkvd.connect(daemon.socket) as c:  # the prompt is cached: every lookup is a full hit
                c.attach("bench-store", "bench", TEST_GEOMETRY)
                kv = c.create_host_kv(flexkvd.Layout.LAYER_FIRST, n // 16)
                kv[:] = b"\x01" * len(kv)
                c.store(flexkvd.block_keys("bench", tokens, 16), list(range(n // 16))).wait(timeout=60)
                del kv
            new, again, finished = [], [], []
            for i in range(200):
                rid = f"r{n}-{i}"
                t0 = time.perf_counter()
                sched.get_num_new_matched_tokens(rid, tokens, 0)
                t1 = time.perf_counter()
                sched.get_num_new_matched_tokens(rid, tokens, 0)
                t2 = time.perf_counter()
                sched.request_finished(rid, tokens, list(range(n // 16)), n)
                t3 = time.perf_counter()
                sched.build_connector_meta()
                new.append(t1 - t0)
                again.append(t2 - t1)
                finished.append(t3 - t2)
            print(f"{n:>7} {pct(new, .5):>11.0f} / {pct(new, .99):<10.0f} {pct(again, .5):>11.0f} / "
                  f"{pct(again, .99):<10.0f} {pct(finished, .5):>25.0f} / {pct(finished, .99):<10.0f}")
        sched.close()
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
