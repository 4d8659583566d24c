"""flexkvd.subscribe_kv_events (python/flexkvd/kv_events.py): the snapshot, then stores and evictions, as the daemon
holds them."""
from __future__ import annotations

import json
import os
import subprocess

import flexkvd
from conftest import FLEXKVD
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE

FLEXKVCTL = os.path.join(os.path.dirname(FLEXKVD), "flexkvctl")


def last_seq(socket: str) -> int:
    out = subprocess.run([FLEXKVCTL, "--socket", socket, "status", "--json"], capture_output=True, text=True,
                         timeout=30, check=True)
    return json.loads(out.stdout)["kv_events"]["last_seq"]

TPB = TEST_GEOMETRY.tokens_per_block


def chain(seed: int, blocks: int) -> flexkvd.BlockKeys:
    return flexkvd.block_keys(TEST_NAMESPACE, [seed * 100000 + i for i in range(blocks * TPB)], TPB)


def test_a_subscription_sees_the_snapshot_then_every_store_and_eviction(make_daemon):
    d = make_daemon(pool_size="1MiB")  # 64 blocks of 16 KiB
    with flexkvd.connect(d.socket) as c:
        c.attach("kv-events", TEST_NAMESPACE, TEST_GEOMETRY)
        c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 4)
        first = chain(1, 4)
        c.store(first, [0, 1, 2, 3]).wait(10.0)
        with flexkvd.subscribe_kv_events(d.socket, max_batch_events=3) as sub:
            held = set()
            instance = None
            while True:  # the snapshot: the 4 blocks, in batches of at most 3
                b = sub.next_batch()
                instance = b.instance_id
                assert b.snapshot
                assert len(b.events) <= 3
                for e in b.events:
                    assert (e.seq, e.kind, e.tier, e.model_namespace, e.tokens_per_block) == \
                        (0, "stored", "dram", TEST_NAMESPACE, TPB)
                    held.add(e.key)
                if b.snapshot_end:
                    break
            assert held == set(first)
            for seed in range(2, 40):  # 152 more blocks into 64 slots: evictions
                c.store(chain(seed, 4), [0, 1, 2, 3]).wait(10.0)
            target = last_seq(d.socket)  # read until every event so far is in
            last = 0
            parents = {}
            position = 0
            while position < target:
                b = sub.next_batch()
                position = b.position or position
                assert b.instance_id == instance and not b.snapshot
                for e in b.events:
                    assert e.seq > last
                    last = e.seq
                    if e.kind == "stored":
                        held.add(e.key)
                        parents[e.key] = e.parent
                        assert e.cause == "store"
                    elif e.kind == "removed":
                        held.discard(e.key)
                        assert e.cause == "evicted"
            keys = chain(39, 4)
            assert parents[keys[1]] == keys[0] and parents[keys[0]] == flexkvd.BlockKey(0, 0)
            total = sum(c.match_via_control(chain(seed, 4)) for seed in range(1, 40))
            assert total == len(held) == c.status().index_blocks
            sub.cancel()
