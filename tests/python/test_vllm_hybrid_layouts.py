"""flexkvd.integrations._vllm_state_layouts: a hybrid model's vLLM KV tensors (fake tensors: pointers, shapes,
strides) planned as one flexkvd registration per geometry component. Models as vLLM's hybrid allocator lays them
out: each raw per-layer buffer shared by one layer of each group (block ids are unique across groups), attention
layers viewing it in their backend's shape, a Mamba layer's state tensors (conv, SSM) viewing one page per block.
Every accepted plan is checked against the geometry chunk by chunk (attention) and page by page (state); the
refusals name the layer and what was found."""
from __future__ import annotations

import dataclasses
import re
import sys
from types import SimpleNamespace

import pytest

import flexkvd
from flexkvd.geometry import ComponentKind
from flexkvd.integrations._vllm_groups import FULL, MAMBA, SLIDING_WINDOW, KvGroup, map_kv_cache_groups
from flexkvd.integrations._vllm_state_layouts import plan_hybrid_kv_caches, plan_state_layers
from flexkvd.integrations._vllm_worker import RankKv, WorkerLogic
from flexkvd.integrations.vllm import describe_plans
from test_vllm_hma_adapter import GPT_OSS_CONFIG, _vllm_config, hma_vllm  # noqa: F401 (a fixture)
from test_vllm_layouts import FakeTensor, check_every_chunk, nbytes, view
from vllm_harness import config

BS, NB = 16, 10
BASE = 0x7F0000000000


def attn(name: str) -> str:
    return f"model.layers.{name}.self_attn.attn"


def mamba(i: int) -> str:
    return f"model.layers.{i}.linear_attn"


def gpt_oss_groups(heads_window: int = 2):
    """Window group first (layers 0, 2), full attention second (layers 1, 3)."""
    return [KvGroup(SLIDING_WINDOW, 2, BS, heads_window, 64, 2, sliding_window=3 * BS, spec="SlidingWindowSpec",
                    layer_names=(attn("0"), attn("2"))),
            KvGroup(FULL, 2, BS, 2, 64, 2, spec="FullAttentionSpec", layer_names=(attn("1"), attn("3")))]


def gpt_oss_caches(form: str = "flash_attn"):
    """Two raw buffers, each shared by a window layer and a full layer (vLLM's KVCacheTensor.shared_by); the layers
    view it in FLASH_ATTN's (2, NB, bs, h, d) or FLASHINFER's (NB, 2, bs, h, d)."""
    shape, order = ((2, NB, BS, 2, 64), [0, 1, 2, 3, 4]) if form == "flash_attn" else \
        ((NB, 2, BS, 2, 64), [0, 1, 2, 3, 4])
    step = nbytes(shape) + (1 << 20)
    raw = [BASE + i * step for i in range(2)]
    # vLLM's dict is in neither group's nor layer order
    return {attn("3"): view(raw[1], shape, order), attn("0"): view(raw[0], shape, order),
            attn("1"): view(raw[0], shape, order), attn("2"): view(raw[1], shape, order)}


def state_views(ptr: int, page: int, states):
    """A Mamba layer's kv_caches entry as vLLM makes it: one (NB, *shape) tensor per state (shape, itemsize),
    back to back from the page's start, each at a block stride of one page."""
    out, offset = [], 0
    for shape, itemsize in states:
        inner, step = [], 1
        for d in reversed(shape):
            inner.insert(0, step)
            step *= d
        out.append(FakeTensor(ptr + offset, (NB,) + tuple(shape), (page // itemsize,) + tuple(inner), itemsize))
        offset += step * itemsize
    return out


def interleaved(ptr: int):
    """An attention layer beside Mamba layers as vLLM views it: logical (2, NB, bs, h, d), K and V of a block
    next to each other (strides (hidden, 2 * hidden, ...))."""
    hidden = BS * 2 * 64
    return FakeTensor(ptr, (2, NB, BS, 2, 64), (hidden, 2 * hidden, 128, 64, 1))


CONV_A, SSM_A = ((4, 64), 2), ((2, 16, 12), 4)     # 512 + 1536 = 2048 bytes
CONV_B, SSM_B = ((2, 64), 2), ((4, 48), 4)         # 256 + 768 = 1024 bytes


def qwen3_next(states_b=(CONV_B, SSM_B), page_b: int = 1024):
    """Full attention (layers 3, 7; K and V of a block interleaved) and two Mamba groups (layers 0, 1 of
    2048-byte states; layers 2, 4 of page_b-byte pages); every layer its own raw buffer."""
    groups = [KvGroup(FULL, 2, BS, 2, 64, 2, spec="FullAttentionSpec", layer_names=(attn("3"), attn("7"))),
              KvGroup(MAMBA, 2, BS, state_bytes=2048, spec="MambaSpec", layer_names=(mamba(0), mamba(1))),
              KvGroup(MAMBA, 2, BS, state_bytes=page_b, spec="MambaSpec", layer_names=(mamba(2), mamba(4)))]
    raw = [BASE + i * (1 << 24) for i in range(6)]
    caches = {attn("3"): interleaved(raw[0]),
              mamba(1): state_views(raw[2], 2048, [CONV_A, SSM_A]),
              mamba(0): state_views(raw[1], 2048, [CONV_A, SSM_A]),
              attn("7"): interleaved(raw[3]),
              mamba(4): state_views(raw[5], page_b, list(states_b)),
              mamba(2): state_views(raw[4], page_b, list(states_b))}
    return map_kv_cache_groups(groups, block_size=BS, tp_size=1), caches


def check_every_page(plan, geometry, layers):
    """Block b of each state layer: the plan's page (LAYER_FIRST, one plane) is where the layer's first state of
    block b starts, and the page holds every state of block b."""
    page = geometry.state_bytes_per_layer
    assert plan.region_bytes == plan.num_blocks * page
    for l, states in enumerate(layers):
        for b in range(plan.num_blocks):
            start = plan.regions[l] + b * page
            for s in states:
                first = s.ptr + b * s.stride()[0] * s.itemsize
                size = s.itemsize
                for d in s.shape[1:]:
                    size *= d
                assert start <= first and first + size <= start + page, (l, b)
            assert min(s.ptr for s in states) + b * page == start


@pytest.mark.parametrize("form,layout", [("flash_attn", flexkvd.Layout.LAYER_FIRST),
                                         ("flashinfer", flexkvd.Layout.LAYER_BLOCK_REGIONS)])
def test_a_gpt_oss_like_model_registers_its_window_and_full_layers_as_their_components(form, layout):
    groups = map_kv_cache_groups(gpt_oss_groups(), block_size=BS, tp_size=1)
    caches = gpt_oss_caches(form)
    plans = plan_hybrid_kv_caches(caches, groups)
    g = groups.geometry
    assert [p.component for p in plans] == [0, 1]
    assert g.component_kind(1) == ComponentKind.SLIDING_WINDOW
    full, window = plans
    # component 0 is the full-attention group (vLLM's group 1), component 1 the window (group 0)
    assert full.layer_names == [attn("1"), attn("3")] and window.layer_names == [attn("0"), attn("2")]
    for plan, c in ((full, 0), (window, 1)):
        cg = g.component(c)
        assert plan.layout == layout and plan.num_blocks == NB
        assert plan.regions == [caches[n].ptr for n in plan.layer_names]
        assert plan.region_bytes == cg.kv_planes * NB * cg.chunk_bytes_per_rank
        check_every_chunk(plan, cg, [caches[n] for n in plan.layer_names])
    # the window and full layers share the raw buffers (one layer of each group), as vLLM's allocator shares them
    assert full.regions == window.regions


def test_a_window_component_of_another_head_count_is_planned_in_its_own_geometry():
    groups = map_kv_cache_groups(gpt_oss_groups(heads_window=4), block_size=BS, tp_size=1)
    caches = gpt_oss_caches()
    for n in (attn("0"), attn("2")):
        caches[n] = view(caches[n].ptr, (2, NB, BS, 4, 64), [0, 1, 2, 3, 4])
    window = plan_hybrid_kv_caches(caches, groups)[1]
    assert window.region_bytes == 2 * NB * BS * 4 * 64 * 2
    check_every_chunk(window, groups.geometry.component(1), [caches[n] for n in window.layer_names])
    caches[attn("2")] = view(caches[attn("2")].ptr, (2, NB, BS, 2, 64), [0, 1, 2, 3, 4])  # the full layers' shape
    with pytest.raises(flexkvd.InvalidArgument, match=r"layer 'model.layers.2.self_attn.attn'.*\(16, 2, 64\); the "
                                                      r"geometry has \(16, 4, 64\)"):
        plan_hybrid_kv_caches(caches, groups)


def test_a_qwen3_next_like_model_registers_each_mamba_group_as_state_pages():
    groups, caches = qwen3_next()
    plans = plan_hybrid_kv_caches(caches, groups)
    g = groups.geometry
    assert [p.component for p in plans] == [0, 1, 2]
    assert [g.component_kind(c) for c in range(3)] == [ComponentKind.FULL, ComponentKind.STATE, ComponentKind.STATE]
    full, a, b = plans
    assert full.layout == flexkvd.Layout.LAYER_BLOCK_REGIONS and full.layer_names == [attn("3"), attn("7")]
    check_every_chunk(full, g.component(0), [caches[n] for n in full.layer_names])
    for plan, c, names, page in ((a, 1, [mamba(0), mamba(1)], 2048), (b, 2, [mamba(2), mamba(4)], 1024)):
        cg = g.component(c)
        assert cg.state_bytes_per_layer == page
        assert plan.layout == flexkvd.Layout.LAYER_FIRST and plan.form == "mamba-state"
        assert plan.layer_names == names and plan.num_blocks == NB
        assert plan.regions == [caches[n][0].ptr for n in names] and plan.region_bytes == NB * page
        check_every_page(plan, cg, [caches[n] for n in names])


def test_a_padded_mamba_page_registers_the_whole_page():
    # vLLM pads a Mamba page up to the attention page: the states fill its front, the page is copied whole
    groups, caches = qwen3_next(states_b=(CONV_B, ((2, 48), 4)), page_b=1024)  # 256 + 384 of 1024 bytes
    b = plan_hybrid_kv_caches(caches, groups)[2]
    assert b.region_bytes == NB * 1024
    check_every_page(b, groups.geometry.component(2), [caches[n] for n in b.layer_names])


def test_mamba_states_that_are_not_one_contiguous_page_per_block_are_refused_naming_the_layer():
    groups, caches = qwen3_next()
    g2 = groups.geometry.component(2)
    layer = mamba(2)
    ptr = caches[layer][0].ptr
    cases = {
        # each state in a buffer of its own (block stride = the state's size, not the page)
        "separate buffers": [FakeTensor(ptr, (NB, 2, 64), (128, 64, 1), 2),
                             FakeTensor(ptr + (1 << 20), (NB, 4, 48), (192, 48, 1), 4)],
        # a gap between the conv and the SSM state
        "a gap": [FakeTensor(ptr, (NB, 2, 64), (512, 64, 1), 2), FakeTensor(ptr + 320, (NB, 4, 48), (256, 48, 1), 4)],
        # the states overlap
        "overlap": [FakeTensor(ptr, (NB, 2, 64), (512, 64, 1), 2), FakeTensor(ptr + 128, (NB, 4, 48), (256, 48, 1), 4)],
        # a transposed conv state (not dense inside the block)
        "transposed": [FakeTensor(ptr, (NB, 64, 2), (512, 1, 64), 2),
                       FakeTensor(ptr + 256, (NB, 4, 48), (256, 48, 1), 4)],
        # states of more bytes than the page
        "too big": state_views(ptr, 1024, [CONV_B, ((6, 48), 4)]),
        # a page of another size than the component's state_bytes_per_layer
        "another page": state_views(ptr, 2048, [CONV_B, SSM_B]),
        # the states disagree on the number of blocks
        "blocks": [FakeTensor(ptr, (NB, 2, 64), (512, 64, 1), 2),
                   FakeTensor(ptr + 256, (NB - 1, 4, 48), (256, 48, 1), 4)],
    }
    whys = {"separate buffers": r"block stride is 256 bytes, not the 1024-byte page",
            "a gap": r"starts \+64 bytes from where the states before it end",
            "overlap": r"starts -128 bytes from where the states before it end",
            "transposed": r"state strides \(1, 64\) are not dense \(2, 1\)",
            "too big": r"its states hold 1408 bytes a block, more than the 1024-byte page",
            "another page": r"block stride is 2048 bytes, not the 1024-byte page",
            "blocks": r"has 9 blocks, .* 10"}
    for case, states in cases.items():
        bad = dict(caches)
        bad[layer] = states
        with pytest.raises(flexkvd.InvalidArgument) as err:
            plan_hybrid_kv_caches(bad, groups)
        msg = str(err.value)
        assert f"Mamba layer '{layer}'" in msg and "1024-byte page" in msg, (case, msg)
        assert re.search(whys[case], msg), (case, msg)
    # the same page refused by the state planner alone, and one tensor instead of the list is one state
    with pytest.raises(flexkvd.InvalidArgument, match="no state tensors"):
        plan_state_layers([(mamba(2), []), (mamba(4), caches[mamba(4)])], g2)
    whole = FakeTensor(ptr, (NB, 256), (256, 1), 4)
    plan = plan_state_layers([(mamba(2), whole), (mamba(4), caches[mamba(4)])], g2)
    assert plan.regions == [ptr, caches[mamba(4)][0].ptr]


def test_layers_missing_given_twice_or_in_no_group_are_refused():
    groups = map_kv_cache_groups(gpt_oss_groups(), block_size=BS, tp_size=1)
    caches = gpt_oss_caches()
    missing = {n: t for n, t in caches.items() if n != attn("2")}
    with pytest.raises(flexkvd.InvalidArgument, match=r"no KV for layer\(s\) \['model.layers.2.self_attn.attn'\] of "
                                                      r"component 1 \(SLIDING_WINDOW\)"):
        plan_hybrid_kv_caches(missing, groups)
    twice = [gpt_oss_groups()[0],
             KvGroup(FULL, 2, BS, 2, 64, 2, spec="FullAttentionSpec", layer_names=(attn("1"), attn("2")))]
    with pytest.raises(flexkvd.InvalidArgument, match=r"'model.layers.2.self_attn.attn' is given twice \(in "
                                                      r"components 0 and 1\)"):
        plan_hybrid_kv_caches(caches, map_kv_cache_groups(twice, block_size=BS, tp_size=1))
    stray = dict(caches)
    stray[attn("4")] = caches[attn("1")]
    with pytest.raises(flexkvd.InvalidArgument, match=r"layer\(s\) \['model.layers.4.self_attn.attn'\] that belong "
                                                      r"to no KV cache group"):
        plan_hybrid_kv_caches(stray, groups)
    unnamed = [KvGroup(SLIDING_WINDOW, 2, BS, 2, 64, 2, sliding_window=3 * BS), KvGroup(FULL, 2, BS, 2, 64, 2)]
    with pytest.raises(flexkvd.InvalidArgument, match="component 0 .* has no layer names"):
        plan_hybrid_kv_caches(caches, map_kv_cache_groups(unnamed, block_size=BS, tp_size=1))
    listed = dict(caches)
    listed[attn("1")] = [caches[attn("1")]]
    with pytest.raises(flexkvd.InvalidArgument, match=r"layer 'model.layers.1.self_attn.attn' \(component 0, FULL\) "
                                                      r"is a list of 1 tensors"):
        plan_hybrid_kv_caches(listed, groups)


def test_every_component_of_every_rank_must_be_given_to_register_kv():
    groups, caches = qwen3_next()
    g = groups.geometry
    plans = plan_hybrid_kv_caches(caches, groups)
    worker = WorkerLogic(config("/nonexistent/flexkvd.sock", g, groups=groups))
    try:
        ranks = describe_plans(0, g, plans)
        assert [(r.component, r.kind, r.layout, r.num_blocks) for r in ranks] == [
            (0, "gpu", int(flexkvd.Layout.LAYER_BLOCK_REGIONS), NB), (1, "gpu", int(flexkvd.Layout.LAYER_FIRST), NB),
            (2, "gpu", int(flexkvd.Layout.LAYER_FIRST), NB)]
        assert ranks[1].tensors == plans[1].regions and ranks[2].region_bytes == NB * 1024
        with pytest.raises(flexkvd.InvalidArgument, match=r"RankKv of components \[0, 2\]; expected 0..2 \(GPU KV "
                                                          r"registers every component"):
            worker.register_kv([ranks[0], ranks[2]])
        with pytest.raises(flexkvd.InvalidArgument, match="TP rank 0 of component 1 given twice"):
            worker.register_kv(ranks + [ranks[1]])
        with pytest.raises(flexkvd.InvalidArgument, match="component 3; expected 0..2"):
            describe_plans(0, g, plans + [dataclasses.replace(plans[0], component=3)])
        with pytest.raises(flexkvd.InvalidArgument, match="host KV described for component 1"):
            worker.describe_kv(NB, None, component=1)
        host = RankKv(0, "host", NB)
        with pytest.raises(flexkvd.InvalidArgument, match=r"RankKv of components \[0, 1\]; expected 0..0 \(host KV"):
            worker.register_kv([host, ranks[1]])
    finally:
        worker.close()


def test_the_adapter_registers_each_kv_cache_group_as_its_component(hma_vllm, monkeypatch):
    # FlexKVdConnector (vLLM stand-ins) of a gpt-oss-like engine: register_kv_caches plans each group's layers as
    # its component and hands every component's RankKv to the worker; no cross-layer tensor is asked for.
    adapter, role = hma_vllm[0], hma_vllm[1]
    monkeypatch.setattr(sys.modules["vllm.distributed.parallel_state"], "get_tp_group",
                        lambda: SimpleNamespace(world_size=1), raising=False)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(current_stream=lambda: None)))
    worker = adapter.FlexKVdConnector(_vllm_config("/nonexistent/flexkvd.sock"), role.WORKER, GPT_OSS_CONFIG)
    try:
        assert worker._config.geometry.component_count == 2 and not worker.prefer_cross_layer_blocks
        got = []
        monkeypatch.setattr(worker._worker, "register_kv", lambda ranks: got.append(list(ranks)))
        shape = (2, NB, BS, 2, 64)
        caches = {f"model.layers.{i}.attn": view(BASE + i * (1 << 24), shape, [0, 1, 2, 3, 4]) for i in range(4)}
        with pytest.raises(ValueError, match="one cross-layer KV tensor for a model with 2 KV cache groups"):
            worker.register_cross_layers_kv_cache(view(BASE, (4,) + shape, [0, 1, 2, 3, 4, 5]))
        worker.register_kv_caches(caches)
        [ranks] = got
        # component 0: vLLM's group 1 (full attention, layers 2 and 3); component 1: the window group (0 and 1)
        assert [(r.component, r.tp_rank, r.kind, r.layout) for r in ranks] == [
            (0, 0, "gpu", int(flexkvd.Layout.LAYER_FIRST)), (1, 0, "gpu", int(flexkvd.Layout.LAYER_FIRST))]
        assert ranks[0].tensors == [caches[f"model.layers.{i}.attn"].ptr for i in (2, 3)]
        assert ranks[1].tensors == [caches[f"model.layers.{i}.attn"].ptr for i in (0, 1)]
        del caches["model.layers.1.attn"]
        with pytest.raises(flexkvd.InvalidArgument, match=r"no KV for layer\(s\) \['model.layers.1.attn'\] of "
                                                          r"component 1"):
            worker.register_kv_caches(caches)
        assert len(got) == 1
    finally:
        worker.shutdown()
