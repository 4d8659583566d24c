"""A load's launch deadline (ring layout 6; Client.load(launch_deadline=...)), against a real flexkvd with host KV:
a load the daemon has not launched by its deadline - it was stopped (SIGSTOP) - ends DeadlineExceeded once it
resumes and copies nothing, through flexkvd.Client.load and through the vLLM connector's layer-wise path (the load
given up on, the engine's blocks untouched after SIGCONT)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import flexkvd
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE, block_content, block_view, kv_array, tokens
from flexkvd.integrations._vllm_logic import SchedulerLogic
from flexkvd.integrations._vllm_worker import WorkerLogic
from vllm_harness import BS, NS, HostKvEngine, config, prompt

TPB = TEST_GEOMETRY.tokens_per_block
SENTINEL = 0xEE
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(TEST_GEOMETRY.num_layers)]

pytestmark = pytest.mark.skipif(not flexkvd._lib.has_launch_deadlines,  # noqa: SLF001
                                reason="the libflexkv loaded has no flexkv_load_by (ring layout 6)")


@pytest.fixture
def pinned(client):
    """The client with 4 blocks of seed 5 stored, its host KV then sentinel-filled, and a pin of them."""
    kv = kv_array(client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 32), flexkvd.Layout.BLOCK_FIRST, 32)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(5, 4), TPB)
    for i in range(4):
        block_view(kv, flexkvd.Layout.BLOCK_FIRST, i)[...] = block_content(5, i)
    client.store(keys, range(4)).wait(5)
    kv[...] = SENTINEL
    hit = client.match(keys, pin=True).wait(5)
    assert hit.matched_blocks == 4
    yield client, kv, hit.match_handle


def test_a_load_whose_launch_deadline_passed_raises_deadline_exceeded_and_copies_nothing(pinned, observer):
    client, kv, handle = pinned
    with pytest.raises(flexkvd.DeadlineExceeded, match="not launched by its launch deadline; nothing was copied"):
        client.load(handle, [8, 9, 10, 11], launch_deadline=time.monotonic() - 0.001).wait(5)
    assert (kv == SENTINEL).all()
    # The handle is still pinned and loads with a far deadline, byte-exact.
    r = client.load(handle, [8, 9, 10, 11], launch_deadline=time.monotonic() + 60).wait(5)
    assert r.done_blocks == 4
    for i in range(4):
        assert np.array_equal(block_view(kv, flexkvd.Layout.BLOCK_FIRST, 8 + i), block_content(5, i))
    client.release(handle).wait(5)
    assert observer.status().pinned_blocks == 0


def test_a_launch_deadline_must_be_a_positive_monotonic_time(pinned):
    client, _, handle = pinned
    for bad in (-1.0, 0, float("nan"), float("inf"), "soon", True):
        with pytest.raises(flexkvd.InvalidArgument, match="launch_deadline"):
            client.load(handle, [8], launch_deadline=bad)


def test_a_load_submitted_to_a_stopped_daemon_past_its_deadline_ends_deadline_exceeded_after_sigcont(
        pinned, daemon, observer):
    client, kv, handle = pinned
    daemon.freeze()
    try:
        deadline = time.monotonic() + 0.2
        whole = client.load(handle, [8, 9, 10, 11], launch_deadline=deadline)
        layerwise = client.load(handle, [12, 13, 14, 15], layerwise=True, launch_deadline=deadline)
        with pytest.raises(flexkvd.DeadlineExceeded):  # the caller gives up: nothing was launched
            layerwise.wait_layers(1, timeout=max(0.0, deadline - time.monotonic()))
        while time.monotonic() <= deadline + 0.05:
            time.sleep(0.01)
    finally:
        daemon.thaw()
    for ticket in (whole, layerwise):
        with pytest.raises(flexkvd.DeadlineExceeded, match="nothing was copied"):
            ticket.wait(5)
    assert (kv == SENTINEL).all()
    client.release(handle).wait(5)
    assert observer.status().pinned_blocks == 0


def test_the_connector_gives_up_on_a_layer_wise_load_of_a_stopped_daemon_and_the_daemon_never_copies_it(
        daemon, observer):
    cfg = dataclasses.replace(config(daemon.socket), load_mode="layerwise", op_timeout_s=0.3)
    made = []
    try:
        a = (SchedulerLogic(cfg), WorkerLogic(cfg))
        a[1].create_host_kv(64)
        a_engine = HostKvEngine(a[1], 64)
        made.append((*a, a_engine))
        p = prompt(21, 4 * BS + 1)
        keys = flexkvd.block_keys(NS, p, BS)
        a_engine.compute(keys, [0, 1, 2, 3])
        assert a[0].request_finished("a", p, [0, 1, 2, 3], len(p))
        a[1].start(a[0].build_connector_meta())
        assert a[1].wait_all()
        a[1].get_finished({"a"})

        scheduler, worker = SchedulerLogic(cfg), WorkerLogic(cfg)
        worker.create_host_kv(64)
        worker.register_layer_names({n: i for i, n in enumerate(NAMES)})
        engine = HostKvEngine(worker, 64)
        made.append((scheduler, worker, engine))
        hit, asynchronous = scheduler.get_num_new_matched_tokens("b", p, 0)
        assert (hit, asynchronous) == (4 * BS, False)
        ids = [40, 41, 42, 43]
        scheduler.update_state_after_alloc("b", ids, hit)
        meta = scheduler.build_connector_meta()
        engine.poison(ids)
        submit = worker._load  # noqa: SLF001

        def stop_then_submit(*args, **kw):  # the daemon stops between the pin and the load
            daemon.freeze()
            return submit(*args, **kw)
        worker._load = stop_then_submit  # noqa: SLF001
        try:
            worker.start(meta)
            for name in NAMES:
                worker.wait_layer(name)  # each gives up after op_timeout_s: the forward goes on
            assert worker.get_finished(set()) == (None, None)
            assert worker.take_load_errors() == set(ids)  # given up on: vLLM computes these tokens again
        finally:
            daemon.thaw()
        # The load ends (DeadlineExceeded: its deadline passed while the daemon was stopped) and the worker
        # releases its pin when it sees that (a later step's get_finished).
        until = time.monotonic() + 10
        while observer.status().pinned_blocks != 0 and time.monotonic() < until:
            worker.get_finished(set())
            time.sleep(0.02)
        assert observer.status().pinned_blocks == 0
        # The resumed daemon copied nothing into the given-up blocks.
        assert (engine.kv_of(0)[:, :, ids, :] == SENTINEL).all()
    finally:
        for s, w, e in made:
            s.close()
            w.close()
            e.release()
