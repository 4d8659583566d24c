"""Client data plane (python/flexkvd/client.py): match / load / store / release between Python processes."""
from __future__ import annotations

import subprocess
import sys
from typing import List

import numpy as np
import pytest

import flexkvd
from conftest import settled_status
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE, block_content, block_view, kv_array, tokens

ENGINE = [sys.executable, __import__("engine_process").__file__]
TPB = TEST_GEOMETRY.tokens_per_block


def run_engine(daemon, name: str, steps: List[str], layout: str = "BLOCK_FIRST", kv_blocks: int = 128) -> List[str]:
    argv = ENGINE + ["--socket", daemon.socket, "--name", name, "--layout", layout, "--kv-blocks", str(kv_blocks)]
    for s in steps:
        argv += ["--do", s]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr}"
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ATTACHED ")
    return lines[1:]


@pytest.mark.parametrize("layout_a,layout_b", [("BLOCK_FIRST", "BLOCK_FIRST"), ("LAYER_FIRST", "BLOCK_FIRST"),
                                               ("BLOCK_FIRST", "LAYER_BLOCK"), ("LAYER_BLOCK", "LAYER_FIRST"),
                                               ("LAYER_BLOCK_REGIONS", "LAYER_FIRST"),
                                               ("BLOCK_FIRST", "LAYER_BLOCK_REGIONS")])
def test_blocks_stored_by_one_python_process_load_byte_identical_in_another(daemon, observer, layout_a, layout_b):
    # A writes SEED 7's 24 blocks into its KV blocks 10..33 and stores them.
    a = run_engine(daemon, "A", ["store:7:24:10"], layout_a)
    stored = a[0].split()
    assert stored[:3] == ["STORED", "0", "24"]
    # B asks for a 32-block prompt of the same seed: the first 24 blocks hit, land in its blocks 60..83 equal to
    # what A wrote (digests) and to the seed's content; every other block of B's KV stays untouched; B's own store
    # of the same prompt finds the 24 blocks cached and stores nothing.
    b = run_engine(daemon, "B", ["load:7:32:60", "untouched:60:24", "store:7:24:0"], layout_b)
    loaded = b[0].split()
    assert loaded[:4] == ["LOADED", "24", "24", "1"]
    assert loaded[4] == stored[3]
    assert b[1] == "UNTOUCHED 1"
    assert b[2].split()[:3] == ["STORED", "24", "0"]
    s = settled_status(observer)
    assert (s.index_blocks, s.used_blocks, s.pinned_blocks, s.sessions) == (24, 24, 0, 0)


def test_round_trip_in_one_process_and_results(client, observer):
    kv = kv_array(client.create_host_kv(flexkvd.Layout.LAYER_FIRST, 64), flexkvd.Layout.LAYER_FIRST, 64)
    assert kv.nbytes == 64 * TEST_GEOMETRY.host_block_bytes
    for i in range(8):
        block_view(kv, flexkvd.Layout.LAYER_FIRST, i)[...] = block_content(3, i)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(3, 8), TPB)
    miss = client.match(keys).wait(5)
    assert (miss.ok, miss.matched_blocks, miss.match_handle, miss.message) == (True, 0, 0, "")
    r = client.store(keys, np.arange(8, dtype=np.uint32)).wait(5)
    assert (r.matched_blocks, r.done_blocks) == (0, 8)
    assert client.match(keys[:5]).wait(5).matched_blocks == 5
    assert client.match_via_control(keys) == 8
    hit = client.match(keys, pin=True).wait(5)
    assert hit.matched_blocks == 8 and hit.match_handle != 0
    assert observer.status().pinned_blocks == 8
    ticket = client.load(hit.match_handle, [40 + i for i in range(8)])
    assert ticket.wait(5).done_blocks == 8
    assert ticket.wait(5).done_blocks == 8  # the outcome is kept: wait again gives the same result
    assert ticket.try_wait() is not None and ticket.done()
    for i in range(8):
        assert np.array_equal(block_view(kv, flexkvd.Layout.LAYER_FIRST, 40 + i), block_content(3, i))
    assert client.release(hit.match_handle).wait(5).ok
    assert observer.status().pinned_blocks == 0
    del kv


def test_a_slice_stores_under_its_parent_and_a_missing_parent_is_refused(client, observer):
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 32)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(21, 30), TPB)
    with pytest.raises(flexkvd.FailedPrecondition, match="parent key not cached") as e:
        client.store(keys[20:30], range(20, 30)).wait(5)  # keys[19] is not cached
    assert e.value.result.done_blocks == 0
    assert observer.status().index_blocks == 0
    assert client.store(keys[0:20], range(20)).wait(5).done_blocks == 20
    r = client.store(keys[20:30], range(20, 30)).wait(5)
    assert (r.matched_blocks, r.done_blocks) == (0, 10)
    assert client.match(keys).wait(5).matched_blocks == 30  # from the prompt's first block
    assert client.match(list(keys)[20:]).wait(5).matched_blocks == 0  # not stored as roots
    del buf


def test_layerwise_load_reports_layers(client):
    buf = client.create_host_kv(flexkvd.Layout.LAYER_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(11, 4), TPB)
    client.store(keys, range(4)).wait(5)
    hit = client.match(keys, pin=True).wait(5)
    t = client.load(hit.match_handle, range(8, 12), layerwise=True)
    assert t.wait_layers(TEST_GEOMETRY.num_layers, 5) == TEST_GEOMETRY.num_layers
    assert t.wait(5).done_blocks == 4
    assert t.wait_layers(1, 0) == 1  # ended: any count is reached
    client.release(hit.match_handle).wait(5)
    del buf


def test_many_requests_in_flight_at_once(client):
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 128)
    tickets = [client.store(flexkvd.block_keys(TEST_NAMESPACE, tokens(100 + j, 4), TPB), range(4 * j, 4 * j + 4))
               for j in range(32)]
    assert sum(t.wait(10).done_blocks for t in tickets) == 128
    matches = [client.match(flexkvd.block_keys(TEST_NAMESPACE, tokens(100 + j, 4), TPB)) for j in range(32)]
    assert [m.wait(10).matched_blocks for m in matches] == [4] * 32
    del buf


# ---- prefetch (needs the daemon side of Prefetch, ring op 5; an older flexkvd raises InvalidArgument) ----

def test_prefetch_without_a_cluster_tier_answers_the_local_hits_and_pins_nothing(client, observer):
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(31, 12), TPB)
    stored = client.store(keys[:8], range(8)).wait(5)
    assert (stored.done_blocks, stored.bytes, stored.source) == (8, 0, "")
    t = client.prefetch(keys)
    assert t.op == "prefetch"
    r = t.wait(5)
    assert (r.ok, r.matched_blocks, r.done_blocks, r.bytes, r.source, r.match_handle) == (True, 8, 0, 0, "", 0)
    assert observer.status().pinned_blocks == 0
    hit = client.match(keys, pin=True).wait(5)
    assert hit.matched_blocks == 8
    client.release(hit.match_handle).wait(5)
    miss = client.prefetch(flexkvd.block_keys(TEST_NAMESPACE, tokens(32, 6), TPB)).wait(5)
    assert (miss.ok, miss.matched_blocks, miss.done_blocks, miss.bytes, miss.source) == (True, 0, 0, 0, "")
    del buf


def test_prefetch_of_an_all_zero_key_raises_invalid_argument(client):
    keys = list(flexkvd.block_keys(TEST_NAMESPACE, tokens(33, 3), TPB))
    keys[1] = (0, 0)
    with pytest.raises(flexkvd.InvalidArgument) as e:
        client.prefetch(keys).wait(5)
    assert (e.value.result.done_blocks, e.value.result.bytes, e.value.result.source) == (0, 0, "")
    with pytest.raises(flexkvd.InvalidArgument):
        client.prefetch([])  # nothing sent


def test_load_with_an_unknown_event_set_raises_from_wait_launched_and_holds_nothing(client, observer):
    # Layer events (docs/python.md "Layer events") need a GPU for the set itself; what a host session can see is the
    # refusal path: an unknown set ends the load NOT_FOUND (raised by wait_launched, nothing to wait on), the
    # handle's blocks stay loadable, and the client refuses layerwise together with an event set before sending.
    client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(5, 4), TPB)
    assert client.store(keys, np.arange(4, dtype=np.uint32)).wait(5).done_blocks == 4
    m = client.match(keys, pin=True).wait(5)
    ids = np.arange(4, 8, dtype=np.uint32)
    t = client.load(m.match_handle, ids, event_set=9)
    with pytest.raises(flexkvd.NotFound, match="event_set 9 is not registered in this session"):
        t.wait_launched(5)
    with pytest.raises(flexkvd.NotFound):
        t.wait(5)
    with pytest.raises(flexkvd.InvalidArgument, match="one completion kind"):
        client.load(m.match_handle, ids, layerwise=True, event_set=9)
    assert client.load(m.match_handle, ids).wait(5).done_blocks == 4
    client.release(m.match_handle).wait(5)
