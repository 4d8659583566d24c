"""The KV events' ZMQ publisher (--kv-events-zmq) decoded as a vLLM KV-event subscriber would (issue 20, acceptance 2).

The decoder below uses only python3-zmq and python3-msgpack and follows vLLM's published KV-event format
(vllm/distributed/kv_events.py): multipart [topic, seq (8 bytes, big-endian), payload]; the payload a msgpack
KVEventBatch encoded array-like, [ts, [event, ...]], each event a tagged array whose first element is its class name:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
   group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]
  ["BlockRemoved", block_hashes, medium, group_idx]
  ["AllBlocksCleared"]
flexkvd's block hashes are its 128-bit keys as 16 bytes: lo then hi, little-endian (docs/kv_events.md).
The flexkv package only drives the daemon (stores, matches) and computes the expected keys.
"""
from __future__ import annotations

import os
import tempfile
from typing import Dict, List, Optional, Set, Tuple

import pytest

zmq = pytest.importorskip("zmq", reason="python3-zmq is not installed (scripts/deps.sh installs it)")
msgpack = pytest.importorskip("msgpack", reason="python3-msgpack is not installed (scripts/deps.sh installs it)")

import flexkvd  # noqa: E402
from conftest import Daemon  # noqa: E402
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE  # noqa: E402

TPB = TEST_GEOMETRY.tokens_per_block
TOPIC = b"kv-events"


def chain(seed: int, blocks: int) -> flexkvd.BlockKeys:
    return flexkvd.block_keys(TEST_NAMESPACE, [seed * 100000 + i for i in range(blocks * TPB)], TPB)


def as_hash(key) -> bytes:
    return key.lo.to_bytes(8, "little") + key.hi.to_bytes(8, "little")


class VllmSubscriber:
    """What a router that consumes vLLM's KV events keeps: the hashes per (medium, KV cache group), each stored hash's
    parent, and each group's spec (kind, sliding window)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.last_seq: Optional[int] = None
        self.held: Dict[Tuple[str, int], Set[bytes]] = {}
        self.kinds: Dict[int, Tuple[Optional[str], Optional[int]]] = {}
        self.parent: Dict[bytes, Optional[bytes]] = {}
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.block_sizes: Set[int] = set()

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()

    def poll(self, timeout_ms: int) -> bool:
        """Decodes one message; False when none came within timeout_ms."""
        if not self.sub.poll(timeout_ms):
            return False
        frames = self.sub.recv_multipart()
        assert len(frames) == 3, f"expected [topic, seq, payload], got {len(frames)} frames"
        topic, seq_bytes, payload = frames
        assert topic == TOPIC
        assert len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        if self.last_seq is not None:
            assert seq == self.last_seq + 1, f"batch seq {seq} after {self.last_seq}: a gap"
        self.last_seq = seq
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch, list) and len(batch) >= 2, batch
        ts, events = batch[0], batch[1]
        assert isinstance(ts, float) and ts > 0
        for event in events:
            self.apply(event)
        return True

    def apply(self, event: List) -> None:
        tag = event[0]
        if tag == "BlockStored":
            assert len(event) == 12, event
            (block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kind,
             window) = event[1:12]
            assert lora_id is None and lora_name is None and extra_keys is None
            assert isinstance(token_ids, list)
            assert isinstance(group_idx, int)
            self.block_sizes.add(block_size)
            self.kinds[group_idx] = (kind, window)
            held = self.held.setdefault((medium, group_idx), set())
            for h in block_hashes:
                assert isinstance(h, bytes) and len(h) == 16
                if group_idx == 0:
                    self.parent[h] = parent
                    parent = h
                else:
                    assert parent is None, "a window or state entry has no parent"
                held.add(h)
                self.stored += 1
        elif tag == "BlockRemoved":
            assert len(event) == 4, event
            block_hashes, medium, group_idx = event[1:4]
            for h in block_hashes:
                self.held.setdefault((medium, group_idx), set()).discard(h)
                self.removed += 1
        elif tag == "AllBlocksCleared":
            self.held.clear()
            self.cleared += 1
        else:
            raise AssertionError(f"unknown event tag {tag!r}")

    def until_stored(self, key_hash: bytes, medium: str = "CPU", group: int = 0) -> None:
        """Reads until key_hash is held (the publisher is in order: everything before it has arrived)."""
        for _ in range(100000):
            if key_hash in self.held.get((medium, group), set()):
                return
            self.poll(100)
        raise AssertionError("the stored block never arrived")


def start_daemon_with_zmq(endpoint: str, pool_size: str, extra_args: Optional[List[str]] = None) -> Daemon:
    d = Daemon(["--kv-events-zmq", endpoint] + list(extra_args or []), pool_size)
    try:
        d.wait_ready()
    except RuntimeError as e:
        d.stop()
        if "built without libzmq" in str(e):
            pytest.skip("this flexkvd was built without libzmq/msgpack-c")
        raise
    return d


def store(client: flexkvd.Client, keys: flexkvd.BlockKeys) -> None:
    client.store(keys, list(range(len(keys)))).wait(10.0)


def test_zmq_stream_decodes_as_vllm_block_stored_and_removed_with_the_keys_and_parents():
    tmp = tempfile.mkdtemp(prefix="flexkv-zmq-")
    endpoint = f"ipc://{os.path.join(tmp, 'kv-events')}"
    d = start_daemon_with_zmq(endpoint, "1MiB")  # 64 blocks of 16 KiB: the load below evicts
    sub = VllmSubscriber(endpoint)
    try:
        with flexkvd.connect(d.socket) as c:
            c.attach("zmq-test", TEST_NAMESPACE, TEST_GEOMETRY)
            c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 8)
            # The subscription is live once the first message (AllBlocksCleared and the snapshot) arrives.
            warm = 0
            while True:
                store(c, chain(1000 + warm, 1))
                warm += 1
                if sub.poll(200):
                    break
            chains = [chain(seed, 4) for seed in range(60)]  # 240 blocks into 64 slots
            for keys in chains:
                store(c, keys)
            sentinel = chain(5000, 2)
            store(c, sentinel)
            sub.until_stored(as_hash(sentinel[1]))
            assert sub.block_sizes == {TPB}
            assert set(sub.held) <= {("CPU", 0)}  # no SSD tier here, and a full-attention model: group 0 only
            assert sub.kinds == {0: ("full_attention", None)}
            assert sub.removed > 0, "the load evicted, so BlockRemoved events came"
            # Every chain's blocks were stored with the right hashes and parents: the first block under no parent
            # (a prompt's start), each next under the one before.
            for keys in chains + [sentinel]:
                hashes = [as_hash(k) for k in keys]
                for i, h in enumerate(hashes):
                    assert h in sub.parent, f"block {i} of a chain was never reported stored"
                    assert sub.parent[h] == (None if i == 0 else hashes[i - 1])
            # What the subscriber holds is exactly what the daemon matches: a chain's cached prefix, nothing else.
            held = sub.held.get(("CPU", 0), set())
            total = 0
            for keys in chains + [sentinel]:
                h = c.match_via_control(keys)
                for i, k in enumerate(keys):
                    assert (as_hash(k) in held) == (i < h), f"block {i} of a chain with {h} cached"
                total += h
            warm_held = sum(1 for i in range(warm) if as_hash(chain(1000 + i, 1)[0]) in held)
            assert len(held) == total + warm_held
            assert c.status().index_blocks == len(held)
    finally:
        sub.close()
        d.stop()


def test_a_daemon_restart_publishes_all_blocks_cleared_then_its_restored_blocks():
    tmp = tempfile.mkdtemp(prefix="flexkv-zmq-")
    endpoint = f"ipc://{os.path.join(tmp, 'kv-events')}"
    d = start_daemon_with_zmq(endpoint, "4MiB")
    sub = VllmSubscriber(endpoint)
    try:
        with flexkvd.connect(d.socket) as c:
            c.attach("zmq-test", TEST_NAMESPACE, TEST_GEOMETRY)
            c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 8)
            warm = 0
            while True:
                store(c, chain(2000 + warm, 1))
                warm += 1
                if sub.poll(200):
                    break
            keys = chain(7, 3)
            store(c, keys)
            sub.until_stored(as_hash(keys[2]))
        d.kill()
        sub.close()
        sub = VllmSubscriber(endpoint)  # a new subscriber: the restarted daemon tells it everything it holds
        d.restart()
        d.wait_ready()
        # The restarted daemon publishes AllBlocksCleared, then its blocks as they pass verification.
        sub.until_stored(as_hash(keys[2]))
        assert sub.parent[as_hash(keys[1])] == as_hash(keys[0])
    finally:
        sub.close()
        d.stop()


def test_a_bad_zmq_endpoint_is_refused_with_the_reason():
    d = Daemon(["--kv-events-zmq", "tcp://not-an-address:x"], "1MiB")
    try:
        with pytest.raises(RuntimeError) as e:
            d.wait_ready()
        assert "--kv-events-zmq" in str(e.value)
    finally:
        d.stop()


def test_dropping_one_domain_leaves_the_subscriber_the_other_domains_blocks():
    """Regression (issue 20 review): a domain dropped while another lives was published as a bare AllBlocksCleared
    (vLLM's event names no domain), so a subscriber lost the living domain's blocks too. Now the clear is followed by
    a snapshot: the subscriber ends with the daemon's true set."""
    import subprocess

    from conftest import FLEXKVD

    other = "zmq-test-other|bf16|tp1"
    tmp = tempfile.mkdtemp(prefix="flexkv-zmq-")
    endpoint = f"ipc://{os.path.join(tmp, 'kv-events')}"
    d = start_daemon_with_zmq(endpoint, "4MiB", ["--max-domains", "2"])
    sub = VllmSubscriber(endpoint)
    try:
        with flexkvd.connect(d.socket) as c:
            c.attach("zmq-test", TEST_NAMESPACE, TEST_GEOMETRY)
            c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 8)
            warm = 0
            while True:
                store(c, chain(3000 + warm, 1))
                warm += 1
                if sub.poll(200):
                    break
            kept = chain(8, 4)
            store(c, kept)
            with flexkvd.connect(d.socket) as o:
                o.attach("zmq-test-other", other, TEST_GEOMETRY)
                o.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 8)
                gone = flexkvd.block_keys(other, [9 * 100000 + i for i in range(3 * TPB)], TPB)
                store(o, gone)
            sub.until_stored(as_hash(gone[2]))
            out = subprocess.run([os.path.join(os.path.dirname(FLEXKVD), "flexkvctl"), "--socket", d.socket,
                                  "drop-domain", other, "--json"], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stdout + out.stderr
            assert '"dropped_blocks":3' in out.stdout
            sentinel = chain(5001, 2)  # published after the drop: everything before it has arrived
            store(c, sentinel)
            sub.until_stored(as_hash(sentinel[1]))
            held = sub.held.get(("CPU", 0), set())
            warm_keys = {as_hash(chain(3000 + i, 1)[0]) for i in range(warm)}
            assert held == {as_hash(k) for k in list(kept) + list(sentinel)} | warm_keys
            assert sub.cleared >= 2  # the one at the subscription, the one of the drop
    finally:
        sub.close()
        d.stop()


# gpt-oss's shape, small: FULL and a 32-token (2-block) sliding window of 2 layers x K/V x 2 heads x 64 (16 KiB
# blocks), and a state of 2 layers x 256 bytes.
HYBRID = flexkvd.Geometry(tokens_per_block=16, num_layers=2, kv_planes=2, kv_heads_per_rank=2, head_dim=64,
                         components=[flexkvd.ComponentSpec.sliding_window(2, 2, 64, 32),
                                     flexkvd.ComponentSpec.state(2, 256)])


def test_zmq_stream_carries_each_component_of_a_hybrid_model_with_vllms_group_fields():
    tmp = tempfile.mkdtemp(prefix="flexkv-zmq-")
    endpoint = f"ipc://{os.path.join(tmp, 'kv-events')}"
    # Small: the stores below evict FULL blocks and windows.
    d = start_daemon_with_zmq(endpoint, "2MiB", ["--swa-share", "0.3", "--state-share", "0.05"])
    sub = VllmSubscriber(endpoint)
    namespace = "zmq-hybrid"
    try:
        with flexkvd.connect(d.socket) as c:
            c.attach("zmq-hybrid", namespace, HYBRID)
            for i in range(HYBRID.component_count):
                c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 8, component=i)
            prompts = []

            def store_prompt(seed: int) -> flexkvd.BlockKeys:
                keys = flexkvd.block_keys(namespace, [seed * 100000 + i for i in range(4 * 16)], 16)
                # 4 FULL blocks, the window of the last 2, the state after block 4.
                c.store(keys, [[0, 1, 2, 3], [4, 5], [6]], state_boundaries=[4]).wait(10.0)
                return keys

            warm = 0
            while True:
                prompts.append(store_prompt(900 + warm))
                warm += 1
                if sub.poll(200):
                    break
            for seed in range(60):
                prompts.append(store_prompt(seed))
            sentinel = store_prompt(5000)
            sub.until_stored(as_hash(sentinel[3]), group=2)  # its state: the last entry the store committed
            assert sub.kinds == {0: ("full_attention", None), 1: ("sliding_window", 32), 2: ("mamba", None)}
            assert sub.removed > 0, "the stores evicted"
            st = c.status()
            full = sub.held.get(("CPU", 0), set())
            window = sub.held.get(("CPU", 1), set())
            state = sub.held.get(("CPU", 2), set())
            # The subscriber's view of each group is what each sub-pool holds (no pins: used == committed).
            assert len(full) == st.index_blocks
            pools = c.pool_components()
            assert len(window) == pools[1].used and len(state) == pools[2].used
            # A window entry is a key of the last two blocks of a stored prompt, a state entry the key of the fourth.
            windows_stored = {as_hash(k) for keys in prompts + [sentinel] for k in keys[2:4]}
            states_stored = {as_hash(keys[3]) for keys in prompts + [sentinel]}
            assert window <= windows_stored and state <= states_stored
            assert as_hash(sentinel[3]) in state and as_hash(sentinel[2]) in window
            # Each prompt the daemon matches whole has its window and state held as the subscriber sees them.
            for keys in prompts + [sentinel]:
                if c.match_via_control(keys) == 4:
                    assert {as_hash(keys[2]), as_hash(keys[3])} <= window and as_hash(keys[3]) in state
    finally:
        sub.close()
        d.stop()
