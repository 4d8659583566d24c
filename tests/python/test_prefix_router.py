"""examples/prefix_router.py and flexkvd.routing.KvEventFeed against two real daemons: requests go to the node that
holds their prefix, the view follows stores and a daemon restart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import flexkvd
from conftest import FLEXKVD
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE
from flexkvd.routing import KvEventFeed, PrefixRouter, RoutingIndex, choose_prefix_aware

TPB = TEST_GEOMETRY.tokens_per_block
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "prefix_router.py")


def tokens(seed: int, blocks: int):
    return [seed * 100000 + i for i in range(blocks * TPB)]


def store(socket: str, toks, blocks: int) -> None:
    with flexkvd.connect(socket) as c:
        c.attach("router-test-engine", TEST_NAMESPACE, TEST_GEOMETRY)
        c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, blocks)
        r = c.store(flexkvd.block_keys(TEST_NAMESPACE, toks, TPB), list(range(blocks))).wait(10.0)
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
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(1, 4), TPB)
    store(d.socket, tokens(1, 4), 4)
    feed = KvEventFeed(index, node, d.socket, namespace=TEST_NAMESPACE, backoff_initial_s=0.05)
    try:
        assert feed.wait_synced(10.0), feed.last_error
        assert index.prefix_lengths(keys)[node].blocks == 4  # from the snapshot
        store(d.socket, tokens(2, 3), 3)
        more = flexkvd.block_keys(TEST_NAMESPACE, tokens(2, 3), TPB)
        assert eventually(lambda: index.prefix_lengths(more)[node].blocks == 3)  # from the live events
        first = feed.instance_id
        d.kill()
        d.restart()  # same pool: the blocks come back once verified
        assert eventually(lambda: feed.snapshots >= 2 and feed.instance_id != first, 20.0), feed.last_error
        assert eventually(lambda: index.prefix_lengths(keys)[node].blocks == 4 and
                          index.prefix_lengths(more)[node].blocks == 3, 20.0)
        assert index.key_count(node, flexkvd.routing.Tier.DRAM) == 7
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


OTHER_NAMESPACE = "router-test-other|bf16|tp1"


def store_in(socket: str, namespace: str, toks, blocks: int) -> flexkvd.BlockKeys:
    with flexkvd.connect(socket) as c:
        c.attach(f"router-test-{namespace[:12]}", namespace, TEST_GEOMETRY)
        c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, blocks)
        keys = flexkvd.block_keys(namespace, toks, TPB)
        r = c.store(keys, list(range(blocks))).wait(10.0)
        assert r.ok, r
        return keys


def daemon_keys(socket: str):
    """The daemon's keys per tier now, from a fresh subscription's snapshot."""
    held = {"dram": set(), "ssd": set()}
    with flexkvd.subscribe_kv_events(socket) as sub:
        while True:
            b = sub.next_batch()
            for e in b.events:
                held[e.tier].add(e.key)
            if b.snapshot_end:
                return held


FLEXKVCTL = os.path.join(os.path.dirname(FLEXKVD), "flexkvctl")


def last_seq(socket: str) -> int:
    with flexkvd.connect(socket) as c:  # no need to shell out to flexkvctl --json (issue 29, item 8)
        return c.status().kv_events.last_seq


def test_feed_drops_only_the_dropped_domain(make_daemon):
    """Regression (issue 20 review): a `cleared` event for one domain (an admin dropped it while another lives)
    cleared the node's whole view, so the router lost the other domain's blocks until the next resubscription."""
    d = make_daemon(["--max-domains", "2"])
    index = RoutingIndex()
    node = index.add_node("a")
    feed = KvEventFeed(index, node, d.socket, backoff_initial_s=0.05)
    try:
        assert feed.wait_synced(10.0), feed.last_error
        kept = store_in(d.socket, TEST_NAMESPACE, tokens(1, 5), 5)
        dropped = store_in(d.socket, OTHER_NAMESPACE, tokens(2, 4), 4)
        assert eventually(lambda: index.key_count(node, flexkvd.routing.Tier.DRAM) == 9), feed.last_error
        out = subprocess.run([FLEXKVCTL, "--socket", d.socket, "drop-domain", OTHER_NAMESPACE, "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr
        assert '"dropped_blocks":4' in out.stdout
        target = last_seq(d.socket)  # the cleared event is in by then
        assert eventually(lambda: feed.position >= target, 20.0), feed.last_error
        truth = daemon_keys(d.socket)
        assert truth["dram"] == set(kept) and not truth["ssd"]
        assert index.key_count(node, flexkvd.routing.Tier.DRAM) == len(truth["dram"])
        assert index.prefix_lengths(kept)[node].dram_blocks == len(kept)
        assert index.prefix_lengths(dropped)[node].blocks == 0
        assert feed.resyncs == 1
    finally:
        feed.close()


def test_filtered_feed_holds_the_ssd_blocks_the_daemon_names_by_the_namespace_hash(make_daemon):
    """Regression (issue 20 review): a daemon restarted on an SSD directory, its DRAM pool gone, reports the SSD blocks
    of a namespace it has not seen attached under "#<XXH3-64 of the namespace>"; a feed filtered on the namespace
    dropped them, and missed them for good after the namespace's first request (which names only new events)."""
    import shutil
    import tempfile

    ssd = tempfile.mkdtemp(dir="/var/tmp", prefix="flexkv-feed-ssd-")
    fs = subprocess.run(["stat", "-f", "-c", "%T", ssd], capture_output=True, text=True).stdout.strip()
    if fs == "tmpfs":
        shutil.rmtree(ssd, ignore_errors=True)
        import pytest
        pytest.skip("/var/tmp is tmpfs: the SSD tier needs a disk filesystem")
    try:
        d = make_daemon(["--ssd-path", ssd, "--ssd-size", "16MiB", "--ssd-write-policy", "all"], pool_size="8MiB")
        chains = [store_in(d.socket, TEST_NAMESPACE, tokens(40 + i, 4), 4) for i in range(3)]
        on_ssd = {k for keys in chains for k in keys}
        assert eventually(lambda: daemon_keys(d.socket)["ssd"] == on_ssd, 30.0)
        d.kill()
        shutil.rmtree(d.pool_dir)  # the DRAM pool is gone (a reboot), the SSD directory stays
        d.restart()
        hashed = f"#{flexkvd.keys.namespace_hash(TEST_NAMESPACE):016x}"
        with flexkvd.subscribe_kv_events(d.socket) as sub:  # the precondition: the blocks come under the hash
            names = set()
            while True:
                b = sub.next_batch()
                names.update(e.model_namespace for e in b.events if e.tier == "ssd")
                if b.snapshot_end:
                    break
            assert names == {hashed}
        index = RoutingIndex()
        node = index.add_node("a")
        feed = KvEventFeed(index, node, d.socket, namespace=TEST_NAMESPACE, backoff_initial_s=0.05)
        try:
            assert feed.wait_synced(10.0), feed.last_error
            # The namespace's first request since the restart: its name is known from now on.
            fresh = store_in(d.socket, TEST_NAMESPACE, tokens(50, 2), 2)
            target = last_seq(d.socket)
            assert eventually(lambda: feed.position >= target, 20.0), feed.last_error
            truth = daemon_keys(d.socket)
            assert on_ssd <= truth["ssd"]
            assert index.key_count(node, flexkvd.routing.Tier.SSD) >= len(on_ssd)
            for keys in chains:
                assert index.prefix_lengths(keys)[node].blocks == 4
            assert index.prefix_lengths(fresh)[node].dram_blocks == 2
        finally:
            feed.close()
    finally:
        shutil.rmtree(ssd, ignore_errors=True)


def test_status_carries_the_kv_event_fields_a_router_compares(make_daemon):
    """Regression (issue 29, item 8): DaemonStatus had no KV-event or cluster fields, so a router had to shell out to
    `flexkvctl --json` to compare its feed's position with the daemon's last seq (docs/kv_events.md)."""
    d = make_daemon()
    index = RoutingIndex()
    node = index.add_node("a")
    feed = KvEventFeed(index, node, d.socket, backoff_initial_s=0.05)
    try:
        assert feed.wait_synced(10.0), feed.last_error
        store(d.socket, tokens(3, 4), 4)
        with flexkvd.connect(d.socket) as c:
            st = c.status()
        assert st.kv_events is not None
        assert st.kv_events.instance_id == feed.instance_id != 0
        assert st.kv_events.subscribers >= 1
        assert st.kv_events.last_seq >= 4  # the 4 blocks stored, numbered while the feed subscribes
        assert st.kv_events.buffer_events > 0
        assert eventually(lambda: feed.position >= st.kv_events.last_seq), feed.last_error
        assert st.cluster is None  # no --etcd-endpoints
        assert st.index_blocks == 4 and st.state == "serving"
    finally:
        feed.close()


def test_a_killed_or_hung_node_is_not_chosen(make_daemon):
    """Regression (issue 29, item 8): 6 s after a kill -9 the routing index still held the dead node's keys and
    choose_prefix_aware chose it for 27 of 400 prompts; a request sent to a dead node fails, it does not cost a
    miss. The feed's state is the node's liveness now: a stream that ends (kill -9) makes the node not live at once,
    one that goes quiet (SIGSTOP) after stale_after_s; it comes back when its daemon is heard from again."""
    a, b = make_daemon(), make_daemon()
    index = RoutingIndex()
    na, nb = index.add_node("a"), index.add_node("b")
    prompts = [tokens(200 + i, 3) for i in range(8)]
    for i, p in enumerate(prompts):
        store(a.socket if i % 2 == 0 else b.socket, p, 3)
    feeds = [KvEventFeed(index, na, a.socket, backoff_initial_s=0.05, stale_after_s=1.0),
             KvEventFeed(index, nb, b.socket, backoff_initial_s=0.05, stale_after_s=1.0)]
    router = PrefixRouter(index, TEST_NAMESPACE, TPB)
    rng = __import__("random").Random(29)

    def choices(n: int):
        return [router.route(prompts[rng.randrange(len(prompts))] + [7] * TPB,
                             loads=[rng.randrange(4), rng.randrange(4)])[0] for _ in range(n)]

    try:
        assert all(f.wait_synced(10.0) for f in feeds), [f.last_error for f in feeds]
        assert eventually(lambda: index.key_count(na, flexkvd.routing.Tier.DRAM) == 12 and
                          index.key_count(nb, flexkvd.routing.Tier.DRAM) == 12)
        assert choices(400).count(na) > 100  # a holds half the prompts
        a.kill()
        killed = time.monotonic()
        assert eventually(lambda: not index.is_live(na), 1.0), feeds[0].last_error
        assert time.monotonic() - killed < 1.0
        assert na not in choices(400)
        assert index.key_count(na, flexkvd.routing.Tier.DRAM) == 12  # its view stays (it may come back with it)
        a.restart()  # the same pool: its blocks come back once verified
        assert eventually(lambda: index.is_live(na), 20.0), feeds[0].last_error
        assert eventually(lambda: index.key_count(na, flexkvd.routing.Tier.DRAM) == 12, 20.0)
        assert choices(400).count(na) > 100
        b.freeze()  # hung: its stream goes quiet, nothing ends it
        try:
            assert eventually(lambda: not index.is_live(nb), 5.0)
            assert nb not in choices(400)
        finally:
            b.thaw()
        assert eventually(lambda: index.is_live(nb), 5.0)
    finally:
        for f in feeds:
            f.close()


def _free_port() -> int:
    import socket as so
    with so.socket(so.AF_INET, so.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cluster_membership_marks_a_node_whose_lease_ended_not_live(make_daemon, tmp_path):
    """Issue 29, item 8: the cluster's membership as a router reads it (Client.status().cluster, no flexkvctl): two
    daemons joined through a real etcd on loopback; ClusterMembershipFeed names both members, and once one is killed
    and its lease ends it is not live in the index, with no event feed for it at all."""
    import shutil
    etcd_bin = shutil.which("etcd") or "/usr/bin/etcd"
    if not os.access(etcd_bin, os.X_OK):
        import pytest
        pytest.skip("etcd not installed (Debian etcd-server)")
    client_port, peer_port = _free_port(), _free_port()
    etcd = subprocess.Popen([etcd_bin, "--name", "t", "--data-dir", str(tmp_path / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{client_port}",
                             "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                             "--initial-cluster", f"t=http://127.0.0.1:{peer_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        secret = tmp_path / "secret"
        secret.write_text("correct horse battery staple 29\n")
        os.chmod(secret, 0o600)

        def node(name: str):
            return make_daemon(["--etcd-endpoints", f"127.0.0.1:{client_port}", "--cluster-secret-file", str(secret),
                                "--cluster-listen", f"127.0.0.1:{_free_port()}", "--node-id", name,
                                "--cluster-transports", "tcp", "--transfer-dev", "lo", "--cluster-lease-ttl", "2"])

        a, b = node("node-a"), node("node-b")
        index = RoutingIndex()
        na, nb = index.add_node("node-a"), index.add_node("node-b")

        def members(socket: str):
            try:
                with flexkvd.connect(socket, timeout=1.0) as c:
                    st = c.status()
            except flexkvd.Error:
                return None
            return st.cluster

        assert eventually(lambda: (members(a.socket) or None) is not None and members(a.socket).state == "joined"
                          and {m.node_id for m in members(a.socket).members} == {"node-a", "node-b"}, 30.0)
        c = members(a.socket)
        assert c.node_id == "node-a" and c.epoch > 0
        assert [m.is_self for m in c.members if m.node_id == "node-a"] == [True]
        feed = flexkvd.routing.ClusterMembershipFeed(index, [b.socket, a.socket], interval_s=0.2)
        try:
            assert eventually(lambda: feed.members is not None and set(feed.members) == {"node-a", "node-b"}, 10.0)
            assert index.is_live(na) and index.is_live(nb)
            b.kill()  # its lease ends within --cluster-lease-ttl; a answers the membership from then on
            assert eventually(lambda: not index.is_live(nb), 15.0), feed.last_error
            assert index.is_live(na)
            assert choose_prefix_aware(index.prefix_lengths([]), [5, 0]) == na
        finally:
            feed.close()
    finally:
        etcd.kill()
        etcd.wait()
