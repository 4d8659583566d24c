"""flexkvd.integrations.vllm's layer-wise loads and fenced stores, driven as vLLM drives them, against a real flexkvd
with host KV buffers (the layer waits are then the CPU's: Ticket.wait_layers; on a GPU the engine's stream waits on
CUDA events instead: test_vllm_gpu_layouts.py). Every loaded layer is compared byte for byte with the KV its key
stands for."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import flexkvd
from conftest import settled_status
from engine_process import TEST_GEOMETRY
from flexkvd.integrations._vllm_logic import ConnectorConfig, SchedulerLogic
from flexkvd.integrations._vllm_worker import WorkerLogic
from vllm_harness import BS, NS, HostKvEngine, config, prompt

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(TEST_GEOMETRY.num_layers)]


class Side:
    """One engine: its scheduler and worker logic and its host KV."""

    def __init__(self, socket: str, load_mode: str = "whole", num_blocks: int = 64) -> None:
        cfg = dataclasses.replace(config(socket), load_mode=load_mode)
        self.scheduler = SchedulerLogic(cfg)
        self.worker = WorkerLogic(cfg)
        self.worker.create_host_kv(num_blocks)
        self.worker.register_layer_names({n: i for i, n in enumerate(NAMES)})
        self.engine = HostKvEngine(self.worker, num_blocks)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
        self.engine.release()


@pytest.fixture
def sides(daemon):
    made = []

    def make(**kw) -> Side:
        made.append(Side(daemon.socket, **kw))
        return made[-1]

    try:
        yield make
    finally:
        for s in made:
            s.close()


def store(side: Side, request_id: str, tokens, ids) -> None:
    """A request computed its blocks and finished: its store is planned and run to its end."""
    keys = flexkvd.block_keys(NS, tokens, BS)
    side.engine.compute(keys, ids)
    assert side.scheduler.request_finished(request_id, tokens, ids, len(tokens))
    side.worker.start(side.scheduler.build_connector_meta())
    assert side.worker.wait_all()
    assert side.worker.get_finished({request_id}) == ({request_id}, None)


def cached(socket: str, tokens) -> int:
    with flexkvd.connect(socket) as c:
        c.attach("observer", NS, TEST_GEOMETRY)
        return c.match(flexkvd.block_keys(NS, tokens, BS)).wait(timeout=5).matched_blocks


def test_a_layer_wise_load_runs_in_the_step_and_each_layer_is_there_after_its_wait(daemon, sides, observer):
    p = prompt(7, 10 * BS + 3)
    store(sides(), "a", p, list(range(10)))
    b = sides(load_mode="layerwise")
    hit, asynchronous = b.scheduler.get_num_new_matched_tokens("b", p, 0)
    assert (hit, asynchronous) == (10 * BS, False)  # vLLM schedules the request in this step
    ids = list(range(20, 31))
    b.scheduler.update_state_after_alloc("b", ids, hit)
    meta = b.scheduler.build_connector_meta()
    assert [s.layerwise for s in meta.loads] == [True]
    assert b.scheduler.in_flight == (0, 0)  # never awaited in finished_recving
    b.engine.poison(ids)
    b.worker.start(meta)  # start_load_kv, before the forward
    keys = flexkvd.block_keys(NS, p, BS)
    for layer, name in enumerate(NAMES):
        b.worker.wait_layer(name)  # wait_for_layer_load, before the layer's attention
        for key, block in zip(keys, ids[:10]):
            assert np.array_equal(b.engine.kv[layer, :, block, :], b.engine.content(key)[layer]), (layer, block)
    assert b.worker.get_finished(set()) == (None, None)  # a synchronous load is not reported as received
    assert b.worker.take_load_errors() == set()
    assert b.worker.stats.loaded_blocks == 10 and b.worker.in_flight == (0, 0)
    assert not b.scheduler.request_finished("b", p, ids, len(p))  # everything was cached: nothing to store
    assert settled_status(observer).pinned_blocks == 0


def test_a_prompt_cached_whole_leaves_its_last_token_to_compute_and_still_loads_its_last_block(daemon, sides):
    p = prompt(13, 3 * BS)  # block-aligned and cached whole
    store(sides(), "a", p, [0, 1, 2])
    b = sides(load_mode="layerwise")
    hit, asynchronous = b.scheduler.get_num_new_matched_tokens("b", p, 0)
    assert (hit, asynchronous) == (3 * BS - 1, False)  # vLLM schedules at least one token
    b.scheduler.update_state_after_alloc("b", [5, 6, 7], hit)
    meta = b.scheduler.build_connector_meta()
    assert meta.loads[0].block_ids == [[5, 6, 7]]  # the block holding the recomputed token is loaded too
    b.engine.poison([5, 6, 7])
    b.worker.start(meta)
    for name in NAMES:
        b.worker.wait_layer(name)
    assert b.worker.get_finished(set()) == (None, None) and b.worker.take_load_errors() == set()
    assert b.engine.holds(flexkvd.block_keys(NS, p, BS), [5, 6, 7])


def test_a_name_that_is_not_a_registered_layer_waits_for_every_layer(daemon, sides):
    p = prompt(8, 4 * BS + 1)
    store(sides(), "a", p, [0, 1, 2, 3])
    b = sides(load_mode="layerwise")
    hit, _ = b.scheduler.get_num_new_matched_tokens("b", p, 0)
    b.scheduler.update_state_after_alloc("b", [9, 8, 7, 6], hit)
    b.engine.poison([9, 8, 7, 6])
    b.worker.start(b.scheduler.build_connector_meta())
    b.worker.wait_layer("model.layers.2.self_attn.attn")  # EAGLE's layer after the target's two: left out
    assert b.engine.holds(flexkvd.block_keys(NS, p, BS)[:4], [9, 8, 7, 6])
    assert b.worker.get_finished(set()) == (None, None) and b.worker.take_load_errors() == set()


def test_a_layer_wise_load_that_fails_reports_its_blocks_in_the_same_step(daemon, sides):
    p = prompt(9, 6 * BS)
    store(sides(), "a", p, list(range(6)))
    b = sides(load_mode="layerwise")
    hit, _ = b.scheduler.get_num_new_matched_tokens("b", p, 0)
    ids = list(range(30, 36))
    b.scheduler.update_state_after_alloc("b", ids, hit)
    meta = b.scheduler.build_connector_meta()
    daemon.kill()  # gone between the lookup and the load
    b.worker.start(meta)
    for name in NAMES:
        b.worker.wait_layer(name)  # nothing to wait for: the forward goes on, its output is discarded by vLLM
    assert b.worker.get_finished(set()) == (None, None)
    assert b.worker.take_load_errors() == set(ids)  # vLLM computes these tokens again
    assert b.worker.stats.load_failed_blocks == 6


def test_a_layer_whose_wait_failed_fails_its_load_even_when_the_copy_ends_ok(daemon, sides, monkeypatch):
    """wait_for_layer_load gave up on a layer (timed out): the forward may have read it before it landed, so the load
    is reported failed in its step (vLLM recomputes the tokens) although the daemon's copy ended OK."""
    p = prompt(10, 5 * BS + 1)
    store(sides(), "a", p, list(range(5)))
    b = sides(load_mode="layerwise")
    hit, _ = b.scheduler.get_num_new_matched_tokens("b", p, 0)
    ids = list(range(40, 45))
    b.scheduler.update_state_after_alloc("b", ids, hit)
    b.worker.start(b.scheduler.build_connector_meta())

    def timed_out(self, layers, timeout=None):
        raise flexkvd.DeadlineExceeded(f"wait_layers({layers}) timed out (test)")

    monkeypatch.setattr(flexkvd.Ticket, "wait_layers", timed_out)
    b.worker.wait_layer(NAMES[0])
    monkeypatch.undo()
    for name in NAMES[1:]:
        b.worker.wait_layer(name)
    assert b.worker.get_finished(set()) == (None, None)
    assert b.worker.take_load_errors() == set(ids)
    assert b.worker.stats.load_failed_blocks == 5 and b.worker.stats.loaded_blocks == 0


def test_a_layer_wise_load_of_blocks_evicted_since_the_lookup_reports_them(daemon, sides):
    p = prompt(10, 5 * BS)
    store(sides(), "a", p, list(range(5)))
    b = sides(load_mode="layerwise")
    hit, _ = b.scheduler.get_num_new_matched_tokens("b", p + prompt(11, 3 * BS), 0)
    assert hit == 5 * BS
    ids = list(range(40, 45))
    b.scheduler.update_state_after_alloc("b", ids, hit)
    meta = b.scheduler.build_connector_meta()
    # two blocks more than flexkvd holds: as if evicted since the lookup
    meta.loads[0] = dataclasses.replace(meta.loads[0], block_ids=[ids + [45, 46]])
    b.worker.start(meta)
    for name in NAMES:
        b.worker.wait_layer(name)
    assert b.worker.get_finished(set()) == (None, None)
    assert b.worker.take_load_errors() == {45, 46}
    assert b.engine.holds(flexkvd.block_keys(NS, p, BS), ids)
    # The scheduler learns a layer-wise load's failed blocks from its step's output (even one handed over after the
    # next step was built, as under async scheduling): the request's store at its end covers them again.
    b.scheduler.build_connector_meta()
    b.scheduler.update_connector_output(None, None, {42})
    assert b.scheduler._requests["b"].cached_blocks == 2


class Fence:
    """A CUDA event's query() as the test decides it."""

    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_stores_wait_for_their_fence_without_blocking_and_are_reported_after_it(daemon, sides):
    a = sides()
    fences = []
    a.worker.store_fence = lambda: fences.append(Fence()) or fences[-1]
    a.worker.sync = lambda: pytest.fail("the engine's stream is never synchronized when stores are fenced")
    p = prompt(12, 8 * BS)
    a.engine.compute(flexkvd.block_keys(NS, p, BS), list(range(8)))
    assert a.scheduler.request_finished("a", p, list(range(8)), len(p))
    a.worker.start(a.scheduler.build_connector_meta())  # start_load_kv: returns at once, the store is parked
    assert a.worker.fenced_stores == 1 and len(fences) == 1
    assert a.worker.get_finished({"a"}) == (None, None)  # vLLM names it finished now, and only now
    assert cached(daemon.socket, p) == 0
    fences[0].passed = True  # the engine's kernels that wrote the blocks ran
    deadline = time.monotonic() + 10
    while True:
        sending, recving = a.worker.get_finished(set())
        if sending or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    assert (sending, recving) == ({"a"}, None)
    assert a.worker.fenced_stores == 0 and a.worker.stats.stored_blocks == 8
    assert cached(daemon.socket, p) == 8


def test_load_mode_is_checked_and_layer_wise_only_where_the_daemon_can_serve_it():
    base = dict(default_namespace=NS, geometry=TEST_GEOMETRY)
    assert ConnectorConfig.from_extra_config({}, **base).load_mode == "whole"
    assert ConnectorConfig.from_extra_config({}, default_load_mode="layerwise", **base).layerwise
    assert not ConnectorConfig.from_extra_config({"load_mode": "whole"}, default_load_mode="layerwise",
                                                 **base).layerwise
    with pytest.raises(flexkvd.InvalidArgument, match="load_mode is 'eager'; expected one of"):
        ConnectorConfig.from_extra_config({"load_mode": "eager"}, **base)
    with pytest.raises(flexkvd.InvalidArgument, match="cross_layer_blocks is 'yes'"):
        ConnectorConfig.from_extra_config({"cross_layer_blocks": "yes"}, **base)
    tp2 = dataclasses.replace(TEST_GEOMETRY, tp_size=2)
    assert not ConnectorConfig.from_extra_config({"load_mode": "layerwise"}, default_namespace=NS,
                                                 geometry=tp2).layerwise  # one rank's layer events per set
