"""Hybrid geometries from Python (docs/hybrid.md): per-component host KV buffers, per-component store and load with
state boundaries, the client's refusals of wrong id counts, and a gpt-oss store/match/load compared byte for byte
between two engine sessions."""
from __future__ import annotations

import gc
import hashlib
import subprocess
import sys
from typing import List

import numpy as np
import pytest

import flexkvd

NAMESPACE = "pytest-hybrid"
# FULL: 2 layers, K/V, 2 heads of 64, bf16, 16 tokens: 16 KiB blocks; a 32-token (2-block) window of the same
# shape; a state of 2 layers x 256 bytes (512-byte snapshots).
SMALL = flexkvd.Geometry(tokens_per_block=16, num_layers=2, kv_planes=2, kv_heads_per_rank=2, head_dim=64,
                        components=[flexkvd.ComponentSpec.sliding_window(2, 2, 64, 32),
                                    flexkvd.ComponentSpec.state(2, 256)])
KV_BLOCKS = 16


def prompt_keys(seed: int, blocks: int, geometry: flexkvd.Geometry = SMALL) -> flexkvd.BlockKeys:
    tokens = [(seed * 100003 + i) % 128000 for i in range(blocks * geometry.tokens_per_block)]
    return flexkvd.block_keys(NAMESPACE, tokens, geometry.tokens_per_block)


def slot_bytes(geometry: flexkvd.Geometry, component: int) -> int:
    g = geometry.component(component)
    return g.num_layers * g.kv_planes * g.chunk_bytes_per_rank


def component_arrays(client: flexkvd.Client, geometry: flexkvd.Geometry) -> List[np.ndarray]:
    """Registers every component's host buffers (BLOCK_FIRST) and returns them as [block][bytes] arrays."""
    out = []
    for i in range(geometry.component_count):
        buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, KV_BLOCKS, component=i)
        assert len(buf) == KV_BLOCKS * slot_bytes(geometry, i)
        out.append(np.frombuffer(buf, dtype=np.uint8).reshape(KV_BLOCKS, slot_bytes(geometry, i)))
    return out


def load_four_layer_wise(b: flexkvd.Client, hit, kv_a: List[np.ndarray], kv_b: List[np.ndarray]):
    """Loads the 4-block hit stored from FULL blocks 0..3, window blocks 6, 7 and the state in slot 2 into FULL 4..7,
    window 8, 9 and state 11 layer-wise; every layer reported, the bytes A's. Returns the load's result."""
    t = b.load(hit.match_handle, [[4, 5, 6, 7], [8, 9], [11]], layerwise=True)
    assert t.wait_layers(SMALL.total_layers, timeout=10) == SMALL.total_layers
    r = t.wait()
    assert r.done_blocks == 4
    assert np.array_equal(kv_b[0][4:8], kv_a[0][0:4])
    assert np.array_equal(kv_b[1][8:10], kv_a[1][6:8])
    assert np.array_equal(kv_b[2][11], kv_a[2][2])
    return r


@pytest.fixture
def hybrid(daemon):
    with flexkvd.connect(daemon.socket) as c:
        c.attach("pytest-hybrid", NAMESPACE, SMALL)
        kv = component_arrays(c, SMALL)
        yield c, kv
        del kv


def test_each_component_registers_its_own_buffers_and_reports_its_sub_pool(hybrid):
    c, kv = hybrid
    assert [a.shape[1] for a in kv] == [16384, 16384, 512]
    for i in range(3):
        slot, capacity = c.session_component(i)
        assert slot == SMALL.component(i).host_block_bytes and capacity > 0
    with pytest.raises(flexkvd.InvalidArgument, match="component 3"):
        c.session_component(3)
    with pytest.raises(flexkvd.AlreadyExists, match=r"component 1 \(sliding_window\)"):
        c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 4, component=1)
    with pytest.raises(flexkvd.InvalidArgument, match="component 3 is not in this session's geometry"):
        c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 4, component=3)


def test_a_full_attention_session_has_one_component(client):
    slot, capacity = client.session_component(0)
    assert slot == client.status().block_bytes and capacity == client.status().capacity_blocks
    with pytest.raises(flexkvd.InvalidArgument):
        client.session_component(1)


def test_store_and_load_copy_the_full_blocks_the_window_and_the_state(daemon, hybrid):
    a, kv_a = hybrid
    rng = np.random.default_rng(7)
    for arr in kv_a:
        arr[:] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
    keys = prompt_keys(1, 6)
    # Keys 0..5 from FULL blocks 0..5, the window (keys 4, 5) from window blocks 10, 11, states after keys 2 and 5.
    r = a.store(keys, [range(6), np.array([10, 11], dtype=np.int64), (3, 4)], state_boundaries=[3, 6]).wait()
    assert r.done_blocks == 6
    with flexkvd.connect(daemon.socket) as b:
        b.attach("pytest-hybrid-b", NAMESPACE, SMALL)
        kv_b = component_arrays(b, SMALL)
        hit = b.match(keys, pin=True).wait()
        assert hit.matched_blocks == 6
        r = b.load(hit.match_handle, [[8, 9, 10, 11, 12, 13], [0, 1], [15]]).wait()
        assert r.done_blocks == 6
        assert np.array_equal(kv_b[0][8:14], kv_a[0][0:6])
        assert np.array_equal(kv_b[1][0:2], kv_a[1][10:12])
        assert np.array_equal(kv_b[2][15], kv_a[2][4])  # the snapshot at e = 6
        assert not kv_b[0][:8].any() and not kv_b[0][14:].any()
        assert not kv_b[1][2:].any() and not kv_b[2][:15].any()
        b.release(hit.match_handle).wait()
        # The 3-key prefix ends at the other boundary, but its window (keys 1, 2) was never stored: no hit there.
        assert b.match(keys[:3]).wait().matched_blocks == 0
        del kv_b


def test_the_layer_order_merges_every_components_layers_by_depth():
    assert SMALL.total_layers == 6
    # The state's layers first (engines run them without a per-layer wait), then full and window layers by depth.
    assert SMALL.layer_order() == [(2, 0), (2, 1), (0, 0), (1, 0), (0, 1), (1, 1)]
    gpt_oss = flexkvd.Geometry.gpt_oss_20b()  # 12 full + 12 sliding, alternating in the model
    assert gpt_oss.layer_order()[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    qwen3_next = flexkvd.Geometry.qwen3_next_80b()  # 12 full + 36 Gated DeltaNet states
    order = qwen3_next.layer_order()
    assert order[:36] == [(1, i) for i in range(36)] and order[36:] == [(0, i) for i in range(12)]
    assert len(order) == qwen3_next.total_layers == 48
    for c in range(qwen3_next.component_count):  # each component's layers once, in order
        assert [layer for comp, layer in order if comp == c] == list(range(qwen3_next.component(c).num_layers))
    llama = flexkvd.Geometry.llama3_8b()
    assert llama.layer_order() == [(0, i) for i in range(32)]


def test_a_layer_wise_load_reports_every_components_layers_in_the_layer_order(daemon, hybrid):
    """Host KV: the layers land when the copies end (the host backend copies whole), reported in order; the bytes
    are the whole load's. A load where only the state moves reports the other components' layers at once."""
    a, kv_a = hybrid
    rng = np.random.default_rng(5)
    for arr in kv_a:
        arr[:] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
    keys = prompt_keys(9, 4)
    assert a.store(keys, [range(4), [6, 7], (2,)], state_boundaries=[4]).wait().done_blocks == 4
    with flexkvd.connect(daemon.socket) as b:
        b.attach("pytest-hybrid-b", NAMESPACE, SMALL)
        kv_b = component_arrays(b, SMALL)
        hit = b.match(keys, pin=True).wait()
        assert hit.matched_blocks == 4
        r = load_four_layer_wise(b, hit, kv_a, kv_b)
        assert r.bytes == 4 * 16384 + 2 * 16384 + 512
        # The engine holds all 4 blocks already (first_block = e): only the state at 4 moves, layer-wise too.
        kv_b[2][12] = 0
        t = b.load(hit.match_handle, [[], [], [12]], layerwise=True, first_block=4)
        assert t.wait_layers(SMALL.total_layers, timeout=10) == SMALL.total_layers
        r = t.wait()
        assert r.bytes == 512 and np.array_equal(kv_b[2][12], kv_a[2][2])
        b.release(hit.match_handle).wait()
        del kv_b


def test_a_store_with_every_window_block_and_a_load_past_the_engines_prefix(daemon, hybrid):
    """window_keys makes the boundary inside the store (3) a hit; first_block loads only past the engine's prefix."""
    a, kv_a = hybrid
    rng = np.random.default_rng(11)
    for arr in kv_a:
        arr[:] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
    keys = prompt_keys(3, 6)
    # Window ids for all 6 keys (window blocks 0..5), states after keys 2 and 5 in state slots 3, 4.
    r = a.store(keys, [range(6), range(6), (3, 4)], state_boundaries=[3, 6], window_keys=6).wait()
    assert r.done_blocks == 6
    with flexkvd.connect(daemon.socket) as b:
        b.attach("pytest-hybrid-b", NAMESPACE, SMALL)
        kv_b = component_arrays(b, SMALL)
        hit = b.match(keys[:3], pin=True).wait()
        assert hit.matched_blocks == 3  # its window (keys 1, 2) and its state are there
        # The engine holds block 0: it loads FULL blocks 1, 2, the window (1, 2) and the state at 3.
        r = b.load(hit.match_handle, [[9, 10], [9, 10], [14]], first_block=1).wait()
        assert r.done_blocks == 2
        assert r.bytes == 2 * 16384 + 2 * 16384 + 512
        assert np.array_equal(kv_b[0][9:11], kv_a[0][1:3])
        assert np.array_equal(kv_b[1][9:11], kv_a[1][1:3])
        assert np.array_equal(kv_b[2][14], kv_a[2][3])
        assert not kv_b[0][:9].any() and not kv_b[0][11:].any() and not kv_b[2][:14].any()
        b.release(hit.match_handle).wait()
        del kv_b
    with pytest.raises(flexkvd.InvalidArgument, match="window_keys 1 for a store of 6 keys"):
        a.store(prompt_keys(4, 6), [range(6), [5], (3,)], state_boundaries=[6], window_keys=1)
    with pytest.raises(flexkvd.InvalidArgument, match="window_keys given with a single block id sequence"):
        a.store(keys, [0, 1, 2, 3, 4, 5], window_keys=6)


def test_wrong_counts_are_refused_before_anything_is_sent(hybrid):
    c, _ = hybrid
    keys = prompt_keys(2, 4)
    first = c.match(keys)
    first.wait()
    with pytest.raises(flexkvd.InvalidArgument, match="per-component overload"):
        c.store(keys, [0, 1, 2, 3])
    with pytest.raises(flexkvd.InvalidArgument, match="per-component overload"):
        c.load(1, [0, 1, 2, 3])
    with pytest.raises(flexkvd.InvalidArgument, match=r"component 1 \(sliding_window\) has 3 block ids; expected 2"):
        c.store(keys, [[0, 1, 2, 3], [1, 2, 3], [4]], state_boundaries=[4])
    with pytest.raises(flexkvd.InvalidArgument, match=r"component 2 \(state\) has 1 block ids; expected 0"):
        c.store(keys, [[0, 1, 2, 3], [2, 3], [4]])
    with pytest.raises(flexkvd.InvalidArgument, match="state boundary 1 is 2 after 3; expected strictly increasing"):
        c.store(keys, [[0, 1, 2, 3], [2, 3], [4, 5]], state_boundaries=np.array([3, 2]))
    with pytest.raises(flexkvd.InvalidArgument, match="state boundary 0 is 5; expected 1..4"):
        c.store(keys, [[0, 1, 2, 3], [2, 3], [4]], state_boundaries=[5])
    with pytest.raises(flexkvd.InvalidArgument, match="2 id spans; expected one per geometry component: 3"):
        c.store(keys, [[0, 1, 2, 3], [2, 3]])
    with pytest.raises(flexkvd.InvalidArgument, match=r"component 2 \(state\) has 2 block ids; expected 1"):
        c.load(1, [[0, 1, 2, 3], [2, 3], [4, 5]])
    with pytest.raises(flexkvd.InvalidArgument, match="both layerwise and event_set"):
        c.load(1, [[0, 1, 2, 3], [2, 3], [4]], layerwise=True, event_set=1)
    with pytest.raises(flexkvd.InvalidArgument, match="state_boundaries given with a single block id sequence"):
        c.store(keys, [0, 1, 2, 3], state_boundaries=[4])
    with pytest.raises(flexkvd.InvalidArgument, match=r"block_ids\[1\] holds -1"):
        c.store(keys, [[0, 1, 2, 3], [-1, 3], [4]], state_boundaries=[4])
    # None of them reached the rings: the next request is the next ticket, and nothing is cached.
    after = c.match(keys)
    assert after.id == first.id + 1
    assert after.wait().matched_blocks == 0


def test_detach_waits_for_views_of_any_component_buffer(daemon):
    with flexkvd.connect(daemon.socket) as c:
        c.attach("pytest-hybrid", NAMESPACE, SMALL)
        c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 2, component=0)
        state_view = c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 2, component=2)
        with pytest.raises(flexkvd.FailedPrecondition, match="1 views"):
            c.detach()
        del state_view
        gc.collect()
        c.detach()
        assert not c.attached


def test_close_keeps_a_viewed_component_buffer_mapped(daemon):
    c = flexkvd.connect(daemon.socket)
    c.attach("pytest-hybrid", NAMESPACE, SMALL)
    c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 2, component=0)
    window = np.frombuffer(c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 2, component=1), dtype=np.uint8)
    c.close()
    window[:] = 7  # still mapped: the session ends once the view is gone
    assert int(window.sum()) == 7 * len(window)
    del window
    gc.collect()


_ENGINE_B = r"""
import hashlib, sys
import numpy as np
import flexkvd
socket, namespace = sys.argv[1], sys.argv[2]
g = flexkvd.Geometry.gpt_oss_20b()
with flexkvd.connect(socket) as c:
    c.attach("engine-b", namespace, g)
    bufs = [np.frombuffer(c.create_host_kv(flexkvd.Layout.LAYER_FIRST, 16, component=i), dtype=np.uint8)
            for i in range(2)]
    tokens = [(7 * 100003 + i) % 128000 for i in range(12 * 16)]
    keys = flexkvd.block_keys(namespace, tokens, 16)
    hit = c.match(keys, pin=True).wait()
    e = hit.matched_blocks
    w = min(g.window_blocks(1), e)
    c.load(hit.match_handle, [list(range(e)), list(range(16 - w, 16))]).wait()
    c.release(hit.match_handle).wait()
    print(e, w, hashlib.sha256(bufs[0].tobytes()).hexdigest(), hashlib.sha256(bufs[1].tobytes()).hexdigest())
    del bufs
"""


def test_gpt_oss_blocks_stored_by_one_engine_load_in_another_process(make_daemon):
    d = make_daemon(pool_size="256MiB")
    g = flexkvd.Geometry.gpt_oss_20b()
    planes, chunk = g.kv_planes, g.chunk_bytes_per_rank
    with flexkvd.connect(d.socket) as a:
        a.attach("engine-a", NAMESPACE, g)
        # LAYER_FIRST: [layer][plane][block][chunk] per component, 16 blocks.
        kv = [np.frombuffer(a.create_host_kv(flexkvd.Layout.LAYER_FIRST, 16, component=i), dtype=np.uint8)
              .reshape(g.component(i).num_layers, planes, 16, chunk) for i in range(2)]
        rng = np.random.default_rng(11)
        for arr in kv:
            arr[:] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
        keys = prompt_keys(7, 12, g)
        # 12 keys from FULL blocks 0..11; the 8-block window (keys 4..11) from window blocks 2..9.
        assert a.store(keys, [list(range(12)), list(range(2, 10))]).wait().done_blocks == 12
        # What engine B must end up with: FULL[0, 12) at blocks 0..11, the window at blocks 8..15, zeros elsewhere.
        want_full = np.zeros_like(kv[0])
        want_full[:, :, 0:12] = kv[0][:, :, 0:12]
        want_window = np.zeros_like(kv[1])
        want_window[:, :, 8:16] = kv[1][:, :, 2:10]
        out = subprocess.run([sys.executable, "-c", _ENGINE_B, d.socket, NAMESPACE], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        e, w, full_digest, window_digest = out.stdout.split()
        assert (int(e), int(w)) == (12, 8)
        assert full_digest == hashlib.sha256(want_full.tobytes()).hexdigest()
        assert window_digest == hashlib.sha256(want_window.tobytes()).hexdigest()
        del kv


def test_pool_components_report_each_sub_pool(hybrid, observer):
    c, _ = hybrid
    pools = observer.pool_components()
    assert [p.kind for p in pools] == [flexkvd.ComponentKind.FULL, flexkvd.ComponentKind.SLIDING_WINDOW,
                                       flexkvd.ComponentKind.STATE]
    assert [p.slot_bytes for p in pools] == [16384, 16384, 512]
    assert [(p.slot_bytes, p.capacity) for p in pools] == [c.session_component(i) for i in range(3)]
    keys = prompt_keys(3, 4)
    c.store(keys, [range(4), [2, 3], [5]], state_boundaries=[4]).wait()
    assert [p.used for p in observer.pool_components()] == [4, 2, 1]


def test_a_daemon_without_a_domain_has_no_sub_pools(observer):
    assert observer.pool_components() == []


_LAYERWISE_VICTIM = """
import sys, time
import flexkvd
sys.path.insert(0, sys.argv[3])
from test_client_hybrid import SMALL, component_arrays, prompt_keys
c = flexkvd.connect(sys.argv[1])
c.attach("victim", sys.argv[2], SMALL)
kv = component_arrays(c, SMALL)
hit = c.match(prompt_keys(21, 4), pin=True).wait()
assert hit.matched_blocks == 4, hit
# Layer-wise loads nobody waits for, a second pin, then kill -9 with all of it in flight or done and unread.
tickets = [c.load(hit.match_handle, [[4, 5, 6, 7], [8, 9], [11]], layerwise=True) for _ in range(32)]
again = c.match(prompt_keys(21, 4), pin=True).wait()
print("SUBMITTED", len(tickets), again.matched_blocks, flush=True)
time.sleep(3600)
"""


def test_a_client_killed_mid_hybrid_layer_wise_loads_leaves_nothing_held(daemon, hybrid, observer):
    """kill -9 of an engine with hybrid layer-wise loads unread and pins held: its session, pins and loads end, and
    the blocks it was loading still load byte-exact, layer-wise, into another engine."""
    import os
    import signal
    import time
    a, kv_a = hybrid
    rng = np.random.default_rng(21)
    for arr in kv_a:
        arr[:] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
    keys = prompt_keys(21, 4)
    assert a.store(keys, [range(4), [6, 7], (2,)], state_boundaries=[4]).wait().done_blocks == 4
    here = os.path.dirname(__file__)
    victim = subprocess.Popen([sys.executable, "-c", _LAYERWISE_VICTIM, daemon.socket, NAMESPACE, here],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=here)
    try:
        line = victim.stdout.readline()
        assert line.split() == ["SUBMITTED", "32", "4"], victim.stderr.read() if not line else line
        held = observer.status()
        assert held.sessions == 2 and held.pinned_blocks >= 4, held
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        victim.kill()
        victim.stdout.close()
        victim.stderr.close()
    deadline = time.monotonic() + 5
    s = observer.status()
    while time.monotonic() < deadline and (s.sessions != 1 or s.pinned_blocks != 0):
        time.sleep(0.01)
        s = observer.status()
    assert (s.sessions, s.pinned_blocks) == (1, 0), s
    with flexkvd.connect(daemon.socket) as b:
        b.attach("pytest-hybrid-b", NAMESPACE, SMALL)
        kv_b = component_arrays(b, SMALL)
        hit = b.match(keys, pin=True).wait()
        assert hit.matched_blocks == 4
        load_four_layer_wise(b, hit, kv_a, kv_b)
        b.release(hit.match_handle).wait()
        del kv_b
    assert observer.status().pinned_blocks == 0
