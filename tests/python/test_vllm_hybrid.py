"""flexkvd.integrations.vllm with vLLM's hybrid memory allocator (SupportsHMA): KV cache groups mapped to flexkvd
components (_vllm_groups), driven in vLLM's call order by vllm_harness.MiniVllm against a real flexkvd: a gpt-oss-like
model (full attention + sliding window, the full group not first), a Qwen3-Next-like one (full attention + two Mamba
groups), loads from the engine's own prefix end, window stores, preemption, a load error and a daemon restart; and
requests that differ only in cache salt, LoRA adapter, media or prompt embeddings never sharing a block."""
from __future__ import annotations

import dataclasses
from typing import Iterator, List

import numpy as np
import pytest

import flexkvd
from conftest import settled_status
from engine_process import TEST_GEOMETRY
from flexkvd.geometry import ComponentKind
from flexkvd.integrations._vllm_layerwise import layer_order_names
from flexkvd.integrations._vllm_groups import (FULL, MAMBA, MLA, NULL_BLOCK, SLIDING_WINDOW, KvGroup,
                                               map_kv_cache_groups)
from flexkvd.integrations._vllm_logic import SchedulerLogic
from flexkvd.integrations._vllm_worker import WorkerLogic
from vllm_harness import BS, GPT_OSS_GROUPS, NS, QWEN3_NEXT_GROUPS, HostKvEngine, MiniVllm, config, prompt

# ---- the mapping ----

def test_groups_map_to_components_full_first_then_the_others_in_group_order():
    m = map_kv_cache_groups(GPT_OSS_GROUPS, block_size=BS, tp_size=1)
    g = m.geometry
    assert m.full_group == 1 and m.is_hybrid and not m.has_state
    assert [(s.group, s.component, s.kind, s.window_blocks) for s in m.slots] == [
        (0, 1, ComponentKind.SLIDING_WINDOW, 3), (1, 0, ComponentKind.FULL, 0)]
    assert (g.num_layers, g.kv_planes, g.kv_heads_per_rank, g.head_dim, g.dtype_bytes) == (2, 2, 2, 64, 2)
    assert g.component_kind(1) == ComponentKind.SLIDING_WINDOW and g.window_blocks(1) == 3
    q = map_kv_cache_groups(QWEN3_NEXT_GROUPS, block_size=BS, tp_size=2)
    assert q.has_state and q.geometry.tp_size == 2
    assert [c.state_bytes_per_layer for c in q.geometry.components] == [2048, 1024]
    mla = map_kv_cache_groups([KvGroup(MLA, 4, BS, 1, 576, 2, spec="MLAAttentionSpec")], block_size=BS, tp_size=1)
    assert mla.geometry.is_mla and not mla.is_hybrid and mla.geometry.head_dim == 576
    # A load past the engine's first block k of prefix end e: FULL [k, e), the window [max(k, e - w), e).
    ids = [[0, 0, 0, 13, 14, 15], [1, 2, 3, 4, 5, 6]]  # window group first, nulls before the window
    assert m.load_ids(ids, 2, 6) == [[3, 4, 5, 6], [13, 14, 15]]
    assert m.load_ids(ids, 5, 6) == [[6], [15]]
    assert m.load_ids([[0, 0, 0, 0, 14, 15], [1, 2, 3, 4, 5, 6]], 2, 6) is None  # the window's block 3 is gone
    assert m.positions_ids(ids, 4, 6) == [14, 15, 5, 6]


def test_groups_flexkvd_cannot_represent_are_refused_naming_the_group_and_its_spec():
    full = KvGroup(FULL, 2, BS, 2, 64, 2, spec="FullAttentionSpec")
    cases = [
        ([full, KvGroup("chunked_local", 2, BS, 2, 64, 2, spec="ChunkedLocalAttentionSpec")],
         r"KV cache group 1 \(ChunkedLocalAttentionSpec, 2 layers\): flexkvd represents"),
        ([full, full], r"KV cache group 1 \(FullAttentionSpec, 2 layers\): a second full-attention group"),
        ([full, KvGroup(SLIDING_WINDOW, 2, 32, 2, 64, 2, sliding_window=64, spec="SlidingWindowSpec")],
         r"group 1 \(SlidingWindowSpec.*block size 32; .* block size 16"),
        ([full, KvGroup(MAMBA, 2, BS, state_bytes=1000, spec="MambaSpec")], r"group 1 \(MambaSpec.*1000 bytes"),
        ([KvGroup(MAMBA, 2, BS, state_bytes=1024, spec="MambaSpec")], r"no full-attention group among \['MambaSpec'\]"),
        ([full] + [KvGroup(SLIDING_WINDOW, 1, BS, 2, 64, 2, sliding_window=64)] * 8, r"9 KV cache groups"),
        ([full, KvGroup(FULL, 2, BS, 2, 64, 2, spec="FullAttentionSpec(page_size_padded=8192)",
                        refusal="a padded page; flexkvd copies unpadded blocks")], r"padded page"),
        ([], "no KV cache groups"),
    ]
    for groups, message in cases:
        with pytest.raises(flexkvd.InvalidArgument, match=message):
            map_kv_cache_groups(groups, block_size=BS, tp_size=1)
    with pytest.raises(flexkvd.InvalidArgument, match="block size is 24 tokens; flexkvd needs a power of two"):
        map_kv_cache_groups([KvGroup(FULL, 2, 24, 2, 64, 2)], block_size=24, tp_size=1)
    m = map_kv_cache_groups(GPT_OSS_GROUPS, block_size=BS, tp_size=1)
    assert m.as_groups([]) == [[], []]  # a request preempted, then aborted, has no blocks
    with pytest.raises(flexkvd.InvalidArgument, match="block ids of 1 KV cache groups; this engine has 2"):
        m.as_groups([1, 2, 3])


# ---- engines ----

@pytest.fixture
def engines(daemon) -> Iterator:
    """make(groups=None, namespace=NS, num_blocks=96, chunk_tokens=...) -> a MiniVllm with its own sessions."""
    made: List[MiniVllm] = []

    def make(groups=None, namespace: str = NS, num_blocks: int = 96, chunk_tokens: int = 1 << 20,
             socket: str = None, load_mode: str = "whole") -> MiniVllm:
        mapping = map_kv_cache_groups(groups, block_size=BS, tp_size=1) if groups else None
        cfg = config(socket or daemon.socket, mapping.geometry if mapping else TEST_GEOMETRY, namespace, mapping)
        cfg = dataclasses.replace(cfg, load_mode=load_mode)
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


def slot_bytes(vllm: MiniVllm, component: int) -> int:
    return vllm.scheduler.config.geometry.component(component).host_block_bytes


GPT_NS, QWEN_NS = "vllm|gpt-oss-like|main|bf16|tp1", "vllm|qwen3-next-like|main|bf16|tp1"


def test_gpt_oss_like_prefix_loads_past_the_local_hit_into_other_blocks_byte_exact(daemon, engines, observer):
    p = prompt(31, 10 * BS + 5)
    a = engines(GPT_OSS_GROUPS, GPT_NS)
    a.add("a", p)
    a.run()
    assert a.worker.stats.stored_blocks == 10
    b = engines(GPT_OSS_GROUPS, GPT_NS)
    b.free.reverse()  # other block ids than a's
    r = b.add("b", p)
    b.run()
    assert r.external_tokens == 10 * BS and r.loaded_ok and r.load_failures == 0
    # The whole hit moved: 10 FULL blocks, the 3-block window before 10.
    assert b.worker.stats.loaded_blocks == 10
    assert b.worker.stats.loaded_bytes == 10 * slot_bytes(b, 0) + 3 * slot_bytes(b, 1)
    # vLLM's own prefix cache holds 7 blocks (and their window): only blocks 7.. move.
    c = engines(GPT_OSS_GROUPS, GPT_NS)
    c.local_hits["c"] = 7 * BS + 3
    r = c.add("c", p)
    c.run()
    assert r.external_tokens == 3 * BS and r.loaded_ok
    assert c.worker.stats.loaded_blocks == 3
    assert c.worker.stats.loaded_bytes == 3 * slot_bytes(c, 0) + 3 * slot_bytes(c, 1)
    c.local_hits["d"] = 9 * BS
    r = c.add("d", p)
    c.run()
    assert r.external_tokens == BS and r.loaded_ok
    assert c.worker.stats.loaded_bytes == 3 * slot_bytes(c, 0) + 3 * slot_bytes(c, 1) + \
        slot_bytes(c, 0) + slot_bytes(c, 1)  # block 9 of FULL and of the window
    assert settled_status(observer).pinned_blocks == 0


@pytest.mark.parametrize("groups,namespace", [(GPT_OSS_GROUPS, GPT_NS), (QWEN3_NEXT_GROUPS, QWEN_NS)],
                         ids=["gpt-oss-like", "qwen3-next-like"])
def test_hybrid_layer_wise_loads_land_each_layer_before_its_wait_returns(daemon, engines, observer, groups, namespace):
    """load_mode "layerwise" on a hybrid model: the hit loads in the step that computes the request (not async);
    wait_for_layer_load of each layer name (every group's, in the geometry's layer order) returns once that layer's
    loaded blocks hold the stored bytes; the states are in place before the forward (vLLM runs those layers without
    a wait)."""
    p = prompt(41, 10 * BS + 5)
    a = engines(groups, namespace)
    a.add("a", p)
    a.run()
    b = engines(groups, namespace, load_mode="layerwise")
    assert b.scheduler.config.layerwise
    b.free.reverse()
    geometry = b.scheduler.config.geometry
    names = [[f"component{c}.layer{j}" for j in range(geometry.component(c).num_layers)]
             for c in range(geometry.component_count)]
    b.worker.register_layer_names(layer_order_names(geometry, names))
    assert sorted(b.worker.layer_names.values()) == list(range(geometry.total_layers))
    checked = []
    forward = b._forward

    def forward_waiting(r, n):
        if r.request_id == "b" and r.num_computed_tokens == 10 * BS:  # the step the hit loads in
            keys = b.keys(r)
            kinds = {s.component: s for s in b.group_map.slots}
            for c, slot in kinds.items():  # before any wait: the states at the prefix end (position 9's slot)
                if slot.kind == ComponentKind.STATE:
                    assert np.array_equal(b.engine.kv_of(c)[:, :, r.groups[slot.group][9], :],
                                          b.engine.content(keys[9], c))
                    checked.append((c, "state"))
            for c, j in geometry.layer_order():
                b.worker.wait_layer(names[c][j])
                slot = kinds[c]
                if slot.kind == ComponentKind.STATE:
                    continue
                ids = r.groups[slot.group]
                start = 10 - geometry.window_blocks(c) if slot.kind == ComponentKind.SLIDING_WINDOW else 0
                kv = b.engine.kv_of(c)
                for pos in range(start, 10):
                    assert np.array_equal(kv[j, :, ids[pos], :], b.engine.content(keys[pos], c)[j]), (c, j, pos)
                checked.append((c, j))
        forward(r, n)

    b._forward = forward_waiting
    assert b.scheduler.get_num_new_matched_tokens("probe", p, 0) == (10 * BS, False)  # loaded in its step
    r = b.add("b", p)
    b.run()
    # (a layer-wise load is never reported in finished_recving: loaded_ok stays unset, no failure is reported)
    assert r.external_tokens == 10 * BS and not r.load_failed and r.load_failures == 0
    want = [(c, "state") for c in range(geometry.component_count) if geometry.component_kind(c) == ComponentKind.STATE]
    want += [(c, j) for c, j in geometry.layer_order() if geometry.component_kind(c) != ComponentKind.STATE]
    assert checked == want
    assert b.worker.stats.loaded_blocks == 10
    assert settled_status(observer).pinned_blocks == 0


def test_window_stores_carry_every_window_block_the_engine_holds(daemon, engines):
    p = prompt(32, 10 * BS + 5)
    # vLLM drops window blocks that left the window: only the store's end (10) is a hit.
    a = engines(GPT_OSS_GROUPS, GPT_NS)
    a.add("a", p)
    a.run()
    b = engines(GPT_OSS_GROUPS, GPT_NS)
    assert b.scheduler.get_num_new_matched_tokens("x", p[:6 * BS + 1], 0) == (0, False)
    assert b.scheduler.get_num_new_matched_tokens("y", p, 0) == (10 * BS, True)
    # An engine that still holds every window block it computed stores them all: every prefix end inside the store
    # whose window is there becomes a hit.
    q = prompt(33, 10 * BS + 5)
    c = engines(GPT_OSS_GROUPS, GPT_NS)
    c.trim = False
    c.add("c", q)
    c.run()
    for end in (3, 6, 10):
        assert b.scheduler.get_num_new_matched_tokens(f"z{end}", q[:end * BS + 1], 0) == (end * BS, True)
    r = b.add("short", q[:6 * BS + 2])
    b.run()
    assert r.external_tokens == 6 * BS and r.loaded_ok


def test_qwen3_next_like_state_loads_at_the_prefix_end_and_a_full_prompt_hit_keeps_a_block_to_compute(daemon,
                                                                                                        engines):
    p = prompt(34, 10 * BS + 5)
    a = engines(QWEN3_NEXT_GROUPS, QWEN_NS)
    a.add("a", p)
    a.run()
    b = engines(QWEN3_NEXT_GROUPS, QWEN_NS)
    b.free.reverse()
    r = b.add("b", p)
    b.run()
    assert r.external_tokens == 10 * BS and r.loaded_ok
    assert b.worker.stats.loaded_bytes == 10 * slot_bytes(b, 0) + slot_bytes(b, 1) + slot_bytes(b, 2)
    # A block-aligned prompt: its last token is computed again by vLLM, which must not apply it twice to a loaded
    # state, so the hit ends a block earlier - where a state was stored.
    aligned = prompt(35, 8 * BS)
    a.trim = False  # the states after every block are kept (mamba_cache_mode "all") and stored
    a.add("a2", aligned)
    a.run()
    r = b.add("b2", aligned)
    b.run()
    assert r.external_tokens == 7 * BS and r.loaded_ok
    # With only the state at the prompt's end stored, a block-aligned prompt is a miss.
    other = prompt(36, 8 * BS)
    a.trim = True
    a.add("a3", other)
    a.run()
    r = b.add("b3", other)
    b.run()
    assert r.lookups == [0]


def test_hybrid_preemption_reloads_into_new_blocks(daemon, engines):
    system = prompt(37, 6 * BS)
    a = engines(GPT_OSS_GROUPS, GPT_NS)
    a.add("a", system)
    a.run()
    b = engines(GPT_OSS_GROUPS, GPT_NS, chunk_tokens=BS)
    r = b.add("b", system + prompt(38, 4 * BS))
    while r.status != "running" or r.num_computed_tokens <= 7 * BS:
        b.step()
    b.preempt("b")
    b.free.reverse()
    b.run()
    assert r.loaded_ok and r.num_preemptions == 1 and r.load_failures == 0
    assert b.worker.stats.loads == 2 and b.worker.stats.loaded_blocks == 12
    assert b.worker.stats.stored_blocks == 4


def test_hybrid_load_error_is_reported_per_group_and_recomputed(daemon, engines, observer):
    p = prompt(39, 8 * BS)
    a = engines(QWEN3_NEXT_GROUPS, QWEN_NS)
    a.add("a", p + [7])
    a.run()
    b = engines(QWEN3_NEXT_GROUPS, QWEN_NS)
    r = b.add("b", p + [8, 9])

    def drain(meta) -> None:  # between the lookup and the worker's load: the daemon refuses loads
        if meta.loads:
            observer.drain()

    b.before_worker = drain
    b.run()
    assert r.lookups[0] == 8 * BS and r.load_failures == 1 and r.status == "finished"
    # Every group's blocks of the failed positions were reported (no null block among them).
    assert NULL_BLOCK not in b.load_errors_seen and len(b.load_errors_seen) == 8 + 1 + 1
    assert observer.resume() == "serving"
    b.before_worker = None
    b.scheduler.link.retry_now()
    b.worker.link.retry_now()
    r2 = b.add("b2", p + [8, 9])
    b.run()
    assert r2.lookups == [8 * BS] and r2.loaded_ok


def test_hybrid_daemon_restart_mid_request_costs_the_load_then_hits_again(daemon, engines):
    p = prompt(40, 9 * BS + 3)
    a = engines(GPT_OSS_GROUPS, GPT_NS)
    a.add("a", p)
    a.run()
    b = engines(GPT_OSS_GROUPS, GPT_NS)
    r = b.add("b", p)

    def restart(meta) -> None:
        if meta.loads:
            daemon.restart()

    b.before_worker = restart
    b.run()
    assert r.lookups[0] == 9 * BS and r.load_failures == 1 and r.status == "finished"
    b.before_worker = None
    b.scheduler.link.retry_now()
    b.worker.link.retry_now()
    # The scheduler's session learns of the restart at its next lookup: that request is a miss, prefilled.
    r2 = b.add("b2", p)
    b.run()
    assert r2.lookups == [0] and b.scheduler.stats.session_losses == 1
    b.scheduler.link.retry_now()
    r3 = b.add("b3", p)
    b.run()
    assert r3.external_tokens == 9 * BS and r3.loaded_ok and r3.load_failures == 0
    assert b.worker.kv_generation == 2


# ---- what changes KV besides tokens ----

def _embeds(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


def _rows(array: np.ndarray):
    return lambda start, end: array[start:end].tobytes()


@pytest.mark.parametrize("what", ["salt", "adapter", "media", "embeds"])
def test_requests_that_differ_only_in_what_changes_kv_never_share_a_block(daemon, engines, observer, what):
    n = 6 * BS + 3
    tokens = [0] * n if what == "embeds" else prompt(41, n)  # vLLM fills prompt_embeds' token ids with zeros
    e1, e2 = _embeds(1, n), _embeds(2, n)
    make = {
        "salt": lambda i: flexkvd.BlockExtras(BS, cache_salt=f"tenant-{i}"),
        "adapter": lambda i: flexkvd.BlockExtras(BS, adapter=f"lora-{i}"),
        "media": lambda i: flexkvd.BlockExtras(BS, media=[(f"image-hash-{i}", 2 * BS + 4, 20)]),
        "embeds": lambda i: flexkvd.BlockExtras(BS, embeds=_rows(e1 if i == 1 else e2), embeds_tokens=n),
    }[what]
    a = engines(GPT_OSS_GROUPS, GPT_NS)
    ra = a.add("a", tokens, make(1))
    a.run()
    b = engines(GPT_OSS_GROUPS, GPT_NS)
    rb = b.add("b", tokens, make(2))
    b.run()
    assert ra.lookups == [0] and rb.lookups == [0]  # the second is a miss: nothing of the first is shared
    assert b.worker.stats.stored_blocks == (4 if what == "media" else 6)  # blocks before the image are shared
    ka, kb = a.keys(ra), b.keys(rb)
    shared = {k.hex() for k in ka} & {k.hex() for k in kb}
    if what == "media":  # blocks before the image are the same prompt: shared, and only those
        assert shared == {k.hex() for k in ka[:2]}
    else:
        assert not shared
    # Each loads its own bytes back.
    for i, rid in ((1, "c1"), (2, "c2")):
        r = b.add(rid, tokens, make(i))
        b.run()
        assert r.external_tokens == 6 * BS and r.loaded_ok and r.load_failures == 0
    # A plain request with the same tokens (no salt, adapter, media or embeddings) hits nothing either (before the
    # image, the window of block 2 was never stored: no hit end there).
    r = b.add("plain", tokens)
    b.run()
    assert r.lookups == [0]
    assert settled_status(observer).pinned_blocks == 0
