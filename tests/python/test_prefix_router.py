"""examples/prefix_router.py and flexkv.routing.KvEventFeed against two real daemons: requests go to the node that
holds their prefix, the view follows stores and a daemon restart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import flexkv
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE
from flexkv.routing import KvEventFeed, RoutingIndex

TPB = TEST_GEOMETRY.tokens_per_block
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "prefix_router.py")


def tokens(seed: int, blocks: int):
    return [seed * 100000 + i for i in range(blocks * TPB)]


def store(socket: str, toks, blocks: int) -> None:
    with flexkv.connect(socket) as c:
        c.attach("router-test-engine", TEST_NAMESPACE, TEST_GEOMETRY)
        c.create_host_kv(flexkv.Layout.BLOCK_FIRST, blocks)
        r = c.store(flexkv.block_keys(TEST_NAMESPACE, toks, TPB), list(range(blocks))).wait(10.0)
        assert r.ok, r


def eventually(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_feed_follows_stores_and_a_restart(make_daemon):
    d = make_daemon()
    index = RoutingIndex()
    node = index.add_node("a")
    keys = flexkv.block_keys(TEST_NAMESPACE, tokens(1, 4), TPB)
    store(d.socket, tokens(1, 4), 4)
    feed = KvEventFeed(index, node, d.socket, namespace=TEST_NAMESPACE, backoff_initial_s=0.05)
    try:
        assert feed.wait_synced(10.0), feed.last_error
        assert index.prefix_lengths(keys)[node].blocks == 4  # from the snapshot
        store(d.socket, tokens(2, 3), 3)
        more = flexkv.block_keys(TEST_NAMESPACE, tokens(2, 3), TPB)
        assert eventually(lambda: index.prefix_lengths(more)[node].blocks == 3)  # from the live events
        first = feed.instance_id
        d.kill()
        d.restart()  # same pool: the blocks come back once verified
        assert eventually(lambda: feed.snapshots >= 2 and feed.instance_id != first, 20.0), feed.last_error
        assert eventually(lambda: index.prefix_lengths(keys)[node].blocks == 4 and
                          index.prefix_lengths(more)[node].blocks == 3, 20.0)
        assert index.key_count(node, flexkv.routing.Tier.DRAM) == 7
    finally:
        feed.close()


def test_example_routes_each_prompt_to_the_node_holding_its_prefix(make_daemon):
    a, b = make_daemon(), make_daemon()
    store(a.socket, tokens(10, 6), 6)
    store(b.socket, tokens(20, 4), 4)
    requests = [
        {"id": "on-a", "tokens": tokens(10, 6) + [1] * TPB},
        {"id": "on-b", "tokens": tokens(20, 4) + [2] * (2 * TPB)},
        {"id": "part-of-a", "tokens": tokens(10, 3)},
        {"id": "nowhere", "tokens": tokens(30, 5)},
    ]
    env = dict(os.environ)
    out = subprocess.run([sys.executable, EXAMPLE, "--node", f"a={a.socket}", "--node", f"b={b.socket}",
                          "--namespace", TEST_NAMESPACE, "--tokens-per-block", str(TPB)],
                         input="\n".join(json.dumps(r) for r in requests) + "\n", capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    got = {d["id"]: d for d in map(json.loads, out.stdout.splitlines())}
    assert got["on-a"]["node"] == "a" and got["on-a"]["cached_blocks"] == 6
    assert got["on-a"]["prefixes"] == {"a": [6, 6], "b": [0, 0]}
    assert got["on-b"]["node"] == "b" and got["on-b"]["cached_blocks"] == 4
    assert got["part-of-a"]["node"] == "a" and got["part-of-a"]["cached_blocks"] == 3
    assert got["nowhere"]["cached_blocks"] == 0  # the least loaded node
