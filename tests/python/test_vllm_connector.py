"""flexkvd.integrations.vllm: the connector's logic (SchedulerLogic, WorkerLogic) driven with the calls vLLM V1 makes
(vllm_harness.MiniVllm, written from vllm/v1/core/sched/scheduler.py and kv_connector_model_runner_mixin.py) against
a real flexkvd, with host KV buffers and every loaded block checked byte for byte. The adapter and the configuration
are tested in test_vllm_adapter.py."""
from __future__ import annotations

import os
import pickle
import tempfile
import time
from typing import Iterator, List

import pytest

import flexkvd
from conftest import settled_status
from engine_process import TEST_GEOMETRY
from flexkvd.integrations._vllm_link import LinkOptions
from flexkvd.integrations._vllm_logic import ConnectorConfig, ConnectorMetadata, SchedulerLogic
from flexkvd.integrations._vllm_worker import RankKv, WorkerLogic
from vllm_harness import BS, NS, HostKvEngine, MiniVllm, config, prompt



@pytest.fixture
def engines(daemon) -> Iterator:
    """make(num_blocks=64, chunk_tokens=...) -> a MiniVllm with its own scheduler and worker sessions; all closed
    (sessions first, then their KV views) after the test."""
    made: List[MiniVllm] = []

    def make(num_blocks: int = 64, chunk_tokens: int = 1 << 20, socket: str = None) -> MiniVllm:
        cfg = config(socket or daemon.socket)
        worker = WorkerLogic(cfg)
        worker.create_host_kv(num_blocks)
        vllm = MiniVllm(SchedulerLogic(cfg), worker, HostKvEngine(worker, num_blocks), chunk_tokens)
        made.append(vllm)
        return vllm

    try:
        yield make
    finally:
        for v in made:
            v.scheduler.close()
            v.worker.close()
            v.engine.release()


def cached_blocks(observer_socket: str, tokens: List[int]) -> int:
    """How many leading full blocks of `tokens` flexkvd holds (a fresh session's unpinned match)."""
    with flexkvd.connect(observer_socket) as c:
        c.attach("observer", NS, TEST_GEOMETRY)
        return c.match(flexkvd.block_keys(NS, tokens, BS)).wait(timeout=5).matched_blocks


# ---- prefill hits ----

def test_prefill_hit_loads_every_full_block_asynchronously_and_the_bytes_are_the_stored_ones(daemon, engines,
                                                                                             observer):
    p = prompt(1, 10 * BS + 5)  # ten full blocks and a partial one, which is never cached
    a = engines()
    a.add("a", p)
    a.run()
    assert a.worker.stats.stored_blocks == 10
    assert cached_blocks(daemon.socket, p) == 10

    b = engines()
    r = b.add("b", p)
    b.step()  # Scheduler.schedule: get_num_new_matched_tokens -> (160, True): the request waits for the load
    assert r.external_tokens == 10 * BS and r.status in ("remote", "running", "finished")
    b.run()
    assert r.loaded_ok and r.load_failures == 0
    assert b.worker.stats.loaded_blocks == 10 and b.worker.stats.loaded_bytes == 10 * TEST_GEOMETRY.host_block_bytes
    assert b.worker.stats.stored_blocks == 0  # everything was cached already: the store planned nothing
    assert a.worker.tracked_requests == 0 and b.worker.tracked_requests == 0  # finished ids are not kept
    assert a.scheduler.in_flight == (0, 0) and not a.scheduler._requests
    assert settled_status(observer).pinned_blocks == 0  # pins released as soon as the load ended


def test_partial_hit_loads_the_cached_prefix_and_stores_only_the_new_blocks(daemon, engines):
    system = prompt(2, 6 * BS)
    a = engines()
    a.add("a", system + prompt(3, 7))
    a.run()
    longer = system + prompt(4, 4 * BS + 3)
    b = engines()
    r = b.add("b", longer)
    b.run()
    assert r.external_tokens == 6 * BS and r.loaded_ok
    assert b.worker.stats.loaded_blocks == 6 and b.worker.stats.stored_blocks == 4
    assert cached_blocks(daemon.socket, longer) == 10


def test_a_local_prefix_hit_is_extended_by_the_blocks_after_it(daemon, engines):
    p = prompt(5, 8 * BS)
    a = engines()
    a.add("a", p)
    a.run()
    b = engines()
    b.local_hits["b"] = 2 * BS + 7  # vLLM passes its block-aligned local hit: 2 blocks
    r = b.add("b", p)
    b.step()
    assert r.external_tokens == 6 * BS  # flexkvd's 8 blocks beyond the 2 vLLM holds
    b.run()
    assert r.loaded_ok  # its first 2 blocks hold vLLM's own KV, untouched; blocks 2.. were loaded
    assert b.worker.stats.loaded_blocks == 6 and b.scheduler.stats.lookup_hit_tokens == 6 * BS
    # The daemon copied only blocks 2..8 (the load's reported bytes): the local prefix is not copied again.
    assert b.worker.stats.loaded_bytes == 6 * TEST_GEOMETRY.host_block_bytes


def test_chunked_prefill_loads_once_then_computes_the_rest_in_chunks(daemon, engines):
    system = prompt(6, 6 * BS)
    a = engines()
    a.add("a", system)
    a.run()
    p = system + prompt(7, 5 * BS + 9)
    b = engines(chunk_tokens=40)  # not a multiple of the block size
    r = b.add("b", p)
    steps = 0
    while r.status != "finished":
        b.step()
        steps += 1
    b.run()
    assert steps >= 3  # the load, then the remaining 89 tokens in chunks of 40
    assert b.scheduler.stats.lookups == 1 and b.worker.stats.loads == 1 and r.loaded_ok
    assert b.worker.stats.stored_blocks == 5
    assert cached_blocks(daemon.socket, p) == 11


# ---- preemption and abort ----

def test_a_preempted_request_is_looked_up_and_loaded_again_into_its_new_blocks(daemon, engines, observer):
    # scheduler.py: _preempt_request frees a RUNNING request's blocks and sets num_computed_tokens = 0; when it is
    # scheduled again get_num_new_matched_tokens is asked again (num_computed_tokens == 0).
    system = prompt(8, 6 * BS)
    a = engines()
    a.add("a", system)
    a.run()
    b = engines(chunk_tokens=BS)
    r = b.add("b", system + prompt(9, 4 * BS))
    while r.status != "running" or r.num_computed_tokens <= 7 * BS:
        b.step()
    first_blocks = list(r.block_ids)
    b.preempt("b")
    assert b.scheduler.in_flight == (0, 0)  # nothing of the connector is in flight for a running request
    b.free.reverse()  # the freed blocks are not the ones handed out next
    b.run()
    assert r.loaded_ok and r.num_preemptions == 1
    assert b.scheduler.stats.lookups == 2 and b.worker.stats.loads == 2 and b.worker.stats.loaded_blocks == 12
    assert r.block_ids == [] and first_blocks  # freed after its store
    assert b.worker.stats.stores == 1 and b.worker.stats.stored_blocks == 4
    assert settled_status(observer).pinned_blocks == 0


def test_a_request_aborted_while_preempted_stores_nothing(daemon, engines):
    b = engines(chunk_tokens=2 * BS)
    p = prompt(10, 8 * BS)
    r = b.add("b", p)
    b.step()
    b.step()
    assert r.status == "running" and r.num_computed_tokens == 4 * BS
    b.preempt("b")
    assert b.abort("b") is False  # request_finished with 0 computed tokens: nothing to store, blocks freed now
    b.run()
    assert b.worker.stats.stores == 0
    assert cached_blocks(daemon.socket, p) == 0


def test_an_abort_mid_prefill_stores_only_the_blocks_whose_kv_was_computed(daemon, engines):
    b = engines(chunk_tokens=3 * BS + 5)
    p = prompt(11, 9 * BS)
    r = b.add("b", p)
    b.step()
    assert r.num_computed_tokens == 3 * BS + 5
    assert b.abort("b") is True  # a store of the 3 computed full blocks; the blocks are held until it ends
    b.run()
    assert b.worker.stats.stored_blocks == 3
    assert cached_blocks(daemon.socket, p) == 3


def test_a_request_finishing_while_its_load_is_in_flight_is_not_stored_and_its_pins_go(daemon, engines, observer):
    # scheduler.py finish_requests: a WAITING_FOR_REMOTE_KVS request keeps its blocks until finished_recving;
    # request_finished must not plan a store of blocks the load may still be writing.
    p = prompt(12, 8 * BS)
    a = engines()
    a.add("a", p)
    a.run()
    b = engines()
    s, w = b.scheduler, b.worker
    assert s.get_num_new_matched_tokens("b", p, 0) == (8 * BS, True)
    ids = list(range(20, 28))
    s.update_state_after_alloc("b", ids, 8 * BS)
    meta = s.build_connector_meta()
    w.start(meta)  # pinned and loading
    assert s.request_finished("b", p, ids, 8 * BS) is False  # the abort: vLLM keeps the blocks itself
    assert s.build_connector_meta().stores == []
    sending, recving = w.get_finished({"b"})
    while not recving:
        assert w.wait_all(10.0)
        sending, recving = w.get_finished(set())
    assert recving == {"b"} and not sending
    s.update_connector_output(sending, recving)
    assert s.in_flight == (0, 0)
    assert settled_status(observer).pinned_blocks == 0


# ---- failures: eviction, a dead daemon ----

def test_blocks_evicted_between_lookup_and_load_are_reported_and_recomputed(make_daemon, engines):
    small = make_daemon(pool_size="1MiB")
    p = prompt(13, 8 * BS)
    a = engines(socket=small.socket)
    a.add("a", p)
    a.run()
    b = engines(socket=small.socket)
    r = b.add("b", p)

    def evict(meta) -> None:  # between the scheduler's lookup and the worker's pin: fill the pool with others
        if not meta.loads:
            return
        with flexkvd.connect(small.socket) as c:
            c.attach("filler", NS, TEST_GEOMETRY)
            c.create_host_kv(flexkvd.Layout.LAYER_FIRST, 8)
            capacity = c.status().capacity_blocks
            for seed in range(100, 100 + capacity // 8 + 2):
                keys = flexkvd.block_keys(NS, prompt(seed, 8 * BS), BS)
                c.store(keys, list(range(8))).wait(timeout=10)

    b.before_worker = evict
    b.run()
    assert r.lookups[0] == 8 * BS and r.load_failures == 1  # promised, then found evicted: looked up again
    assert b.load_errors_seen and b.worker.stats.load_failed_blocks == len(b.load_errors_seen)
    assert r.loaded_ok  # whatever did load is the right bytes; the rest was recomputed
    assert b.worker.stats.stored_blocks + b.worker.stats.loaded_blocks == 8  # what was evicted is stored again
    assert cached_blocks(small.socket, p) == 8


def test_daemon_killed_and_restarted_mid_run_falls_back_to_prefill_then_hits_again(daemon, engines, observer):
    p = prompt(14, 8 * BS)
    a = engines()
    a.add("a", p)
    a.run()
    b = engines()
    r = b.add("b", p)

    def kill(meta) -> None:
        if meta.loads:
            daemon.kill()

    b.before_worker = kill  # the scheduler promised 8 blocks; the daemon dies before the worker pins them
    b.run()
    assert r.lookups[0] == 8 * BS and r.load_failures == 1 and r.status == "finished"
    assert set(b.load_errors_seen) and b.worker.stats.session_losses >= 1
    b.before_worker = None
    r2 = b.add("b2", p)  # the daemon is still down: a miss, prefilled
    b.run()
    assert r2.external_tokens == 0 and b.scheduler.stats.lookup_errors >= 1

    daemon.restart()  # same pool: what was committed is served again
    b.scheduler.link.retry_now()
    b.worker.link.retry_now()
    r3 = b.add("b3", p)
    b.run()
    assert r3.external_tokens == 8 * BS and r3.loaded_ok and r3.load_failures == 0
    assert b.worker.kv_generation == 2  # the worker registered a new host KV buffer with the new session


def test_a_daemon_killed_while_a_load_is_in_flight_ends_the_load_reported_and_nothing_waits(daemon, engines):
    p = prompt(18, 8 * BS)
    a = engines()
    a.add("a", p)
    a.run()
    b = engines()
    s, w = b.scheduler, b.worker
    assert s.get_num_new_matched_tokens("b", p, 0) == (8 * BS, True)
    ids = list(range(30, 38))
    s.update_state_after_alloc("b", ids, 8 * BS)
    w.start(s.build_connector_meta())  # pinned, load submitted
    daemon.kill()
    sending, recving = w.get_finished(set())
    while not recving:  # the load ended (before the kill) or the lost session ended it
        assert w.wait_all(10.0)
        sending, recving = w.get_finished(set())
    assert recving == {"b"}
    errors = w.take_load_errors()
    assert errors <= set(ids)
    loaded = w.stats.loaded_blocks
    assert loaded + len(errors) == 8  # every planned block is either loaded or reported
    if errors:
        assert w.stats.session_losses == 1 and not w.link.attached
    assert w.in_flight == (0, 0)


def test_a_stopped_daemon_costs_one_timeout_per_side_then_misses_and_its_late_pins_are_released(daemon, engines,
                                                                                                  observer):
    p1, p2 = prompt(22, 4 * BS), prompt(23, 4 * BS)
    a = engines()
    a.add("a1", p1)
    a.add("a2", p2)
    a.run()
    b = engines()
    s, w = b.scheduler, b.worker
    s.config.op_timeout_s = w.config.op_timeout_s = 0.2
    for rid, p, ids in (("r1", p1, [0, 1, 2, 3]), ("r2", p2, [4, 5, 6, 7])):
        assert s.get_num_new_matched_tokens(rid, p, 0) == (4 * BS, True)
        s.update_state_after_alloc(rid, ids, 4 * BS)
    meta = s.build_connector_meta()
    daemon.freeze()  # SIGSTOP: nothing answers, nothing fails
    try:
        w.start(meta)  # both pins share one timeout; then the worker's link stalls
        assert w.get_finished(set()) == (None, {"r1", "r2"}) and w.take_load_errors() == set(range(8))
        assert s.get_num_new_matched_tokens("r3", p1, 0) == (0, False)  # times out: the scheduler's link stalls
        assert s.get_num_new_matched_tokens("r4", p1, 0) == (0, False)  # not even asked
        assert s.stats.lookups == 3 and s.stats.lookup_errors == 2
    finally:
        daemon.thaw()
    s.link.retry_now()
    w.link.retry_now()
    for _ in range(2000):  # the pins the stopped daemon granted late are released as their answers arrive
        w.get_finished(set())
        if w.stray_requests == 0:
            break
        time.sleep(0.005)
    assert w.stray_requests == 0
    assert observer.status().pinned_blocks == 0
    assert s.get_num_new_matched_tokens("r5", p2, 0) == (4 * BS, True)


def test_a_daemon_that_is_not_there_costs_misses_not_errors():
    empty = tempfile.mkdtemp(prefix="flexkv-vllm-")
    try:
        cfg = ConnectorConfig(namespace=NS, geometry=TEST_GEOMETRY,
                              link=LinkOptions(socket=os.path.join(empty, "none.sock"), connect_timeout_s=0.0))
        s = SchedulerLogic(cfg)
        assert s.get_num_new_matched_tokens("r", prompt(15, 4 * BS), 0) == (0, False)
        assert s.request_finished("r", prompt(15, 4 * BS), [0, 1, 2, 3], 4 * BS) is False
        assert s.stats.lookup_errors == 1 and s.link.failures == 1
        w = WorkerLogic(cfg)
        with pytest.raises(flexkvd.Unavailable, match="not reachable"):
            w.create_host_kv(8)
        s.close()
        w.close()
    finally:
        os.rmdir(empty)


# ---- TP ----

def test_tp2_rank1_hands_its_description_to_rank0_which_registers_and_alone_reports(make_daemon, observer):
    # Host KV serves TP 2 only for MLA (its latent KV is the same on every rank): rank 1's description says so and
    # rank 0 registers for both. K/V shards of TP ranks need the CUDA backend (see the next test).
    d = make_daemon()
    mla = flexkvd.Geometry(tokens_per_block=16, num_layers=2, kv_planes=1, kv_heads_per_rank=1, head_dim=64,
                          dtype_bytes=2, tp_size=2)
    cfg = config(d.socket, mla, namespace="vllm|pytest-mla|main|bfloat16|tp2")
    rank0, rank1 = WorkerLogic(cfg, tp_rank=0), WorkerLogic(cfg, tp_rank=1)
    assert rank1.link is None  # ranks > 0 open no session
    described = pickle.loads(pickle.dumps(rank1.describe_kv(32)))  # over vLLM's TP CPU group
    assert described == RankKv(1, "mla-replica", 32)
    with pytest.raises(flexkvd.InvalidArgument, match="expected 0..1"):
        rank0.register_kv([rank0.describe_kv(32)])
    rank0.register_kv([rank0.describe_kv(32), described])
    engine = HostKvEngine(rank0, 32)
    s = SchedulerLogic(cfg)
    try:
        vllm = MiniVllm(s, rank0, engine)
        p = prompt(16, 4 * BS)
        vllm.add("a", p)
        vllm.run()
        assert rank0.stats.stored_blocks == 4
        vllm.add("b", p + [1])
        vllm.run()
        assert vllm.requests["b"].loaded_ok and rank0.stats.loaded_blocks == 4
        meta = s.build_connector_meta()
        rank1.start(meta)
        assert rank1.get_finished({"a", "b"}) == (None, None)  # get_finished_count() == 1: rank 0 alone reports
    finally:
        s.close()
        rank0.close()
        engine.release()


def test_a_draining_daemon_costs_misses_and_the_connector_resumes_with_it(daemon, engines, observer):
    p = prompt(20, 4 * BS)
    a = engines()
    a.add("a", p)
    a.run()
    b = engines()
    assert b.scheduler.link.client() is not None  # both sessions attached before the drain
    assert observer.drain() in ("draining", "drained")
    r = b.add("b", p + prompt(21, 2 * BS))  # two new blocks to store
    b.run()
    # Matches are still answered, loads are refused: one failed load, then the request is prefilled (one load per
    # request: asked again, the connector answers 0) and its store is refused too.
    assert r.lookups == [4 * BS, 0] and r.load_failures == 1 and b.load_errors_seen
    assert b.worker.stats.store_failures == 1 and b.worker.stats.stored_blocks == 0
    assert observer.resume() == "serving"
    b.scheduler.link.retry_now()
    b.worker.link.retry_now()
    r2 = b.add("b2", p)
    b.run()
    assert r2.lookups == [4 * BS] and r2.loaded_ok


def test_a_local_hit_that_ends_inside_a_block_loads_from_that_block(daemon, engines):
    p = prompt(24, 6 * BS)
    a = engines()
    a.add("a", p)
    a.run()
    b = engines()
    s = b.scheduler
    assert s.get_num_new_matched_tokens("b", p, 2 * BS + 5) == (4 * BS - 5, True)
    s.update_state_after_alloc("b", [40, 41, 42, 43, 44, 45], 4 * BS - 5)
    (load,) = s.build_connector_meta().loads
    assert load.first_block == 2 and load.block_ids == [[40, 41, 42, 43, 44, 45]]
    b.worker.start(ConnectorMetadata(loads=[load]))
    assert b.worker.wait_all()
    assert b.worker.get_finished(set()) == (None, {"b"}) and not b.worker.take_load_errors()
    assert b.engine.holds(flexkvd.block_keys(NS, p, BS)[2:], [42, 43, 44, 45])
