"""The vLLM adapter with vLLM's hybrid memory allocator: FlexKVdConnector as SupportsHMA, its KV cache groups read
from kv_cache_config (stand-ins of vLLM's spec classes, named and shaped as vllm/v1/kv_cache_interface.py has them),
request_finished_all_groups, per-group block ids through a load, the check of what this vLLM's scheduler can take,
and the daemon's KV events handed to vLLM through take_events (KvEventRelay against a real flexkvd)."""
from __future__ import annotations

import dataclasses
import enum
import importlib
import pickle
import sys
import time
import types
from types import SimpleNamespace as NS_

import numpy as np
import pytest

import flexkvd
from conftest import settled_status
from flexkvd.integrations._vllm_events import KvEventRelay, key_bytes
from flexkvd.integrations._vllm_groups import map_kv_cache_groups
from flexkvd.integrations._vllm_layerwise import layer_order_names
from test_vllm_adapter import _StandInBase
from vllm_harness import BS, GPT_OSS_GROUPS, HostKvEngine, prompt


class _Dtype:
    itemsize = 2


# Stand-ins of vLLM's KVCacheSpec classes: the adapter tells them apart by class name, as it does vLLM's.
@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: object = _Dtype()
    page_size_padded: object = None
    sliding_window: object = None


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    sliding_window: int
    dtype: object = _Dtype()
    page_size_padded: object = None


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    block_size: int
    page_size_bytes: int
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class ChunkedLocalAttentionSpec:
    block_size: int
    num_kv_heads: int = 2
    head_size: int = 64


def kv_cache_config(*specs):
    return NS_(kv_cache_groups=[NS_(layer_names=[f"model.layers.{2 * i + j}.attn" for j in range(2)], kv_cache_spec=s)
                                for i, s in enumerate(specs)])


GPT_OSS_CONFIG = kv_cache_config(SlidingWindowSpec(BS, 2, 64, 3 * BS), FullAttentionSpec(BS, 2, 64))


class SchedulerOneGroup:
    """vLLM's scheduler as read: a finished load unpacks one group's block ids."""

    def _update_waiting_for_remote_kv(self, request):
        (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)
        return block_ids

    def _update_requests_with_invalid_blocks(self, requests, invalid_block_ids, evict_blocks=True):
        return set(), 0, set()


class SchedulerAllGroups:
    """A scheduler that takes every group's block ids where a load ends."""

    def _update_waiting_for_remote_kv(self, request):
        return self.kv_cache_manager.get_block_ids(request.request_id)

    def _update_requests_with_invalid_blocks(self, requests, invalid_block_ids, evict_blocks=True):
        return set(), 0, set()


@dataclasses.dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object
    medium: object
    lora_name: object
    group_idx: object = None
    kv_cache_spec_kind: object = None
    kv_cache_spec_sliding_window: object = None


@dataclasses.dataclass
class BlockRemoved:
    block_hashes: list
    medium: object
    group_idx: object = None


@pytest.fixture
def hma_vllm(monkeypatch):
    """vLLM's modules as the adapter imports them, with SupportsHMA; set_scheduler(cls) picks the scheduler."""
    role = enum.Enum("KVConnectorRole", {"SCHEDULER": 0, "WORKER": 1})

    class SupportsHMA:
        pass

    sched = types.ModuleType("vllm.v1.core.sched.scheduler")
    modules = {
        "vllm": {}, "vllm.distributed": {}, "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {}, "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorBase_V1": _StandInBase, "KVConnectorMetadata": type("KVConnectorMetadata", (), {}),
            "KVConnectorRole": role, "SupportsHMA": SupportsHMA},
        "vllm.distributed.parallel_state": {"get_tensor_model_parallel_rank": lambda: 0},
        "vllm.distributed.kv_events": {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved},
        "vllm.v1": {}, "vllm.v1.core": {}, "vllm.v1.core.sched": {},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, sched.__name__, sched)
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer.kv_connector.v1.metrics", None)
    monkeypatch.delitem(sys.modules, "flexkvd.integrations.vllm", raising=False)

    def set_scheduler(cls) -> None:
        sched.Scheduler = cls

    set_scheduler(SchedulerAllGroups)
    yield importlib.import_module("flexkvd.integrations.vllm"), role, SupportsHMA, set_scheduler
    sys.modules.pop("flexkvd.integrations.vllm", None)


def _vllm_config(socket: str, extra=None):
    model = NS_(model="pytest-gpt-oss", revision=None, dtype="bfloat16", use_mla=False)
    return NS_(model_config=model, cache_config=NS_(block_size=BS, cache_dtype="bfloat16"),
               parallel_config=NS_(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
               kv_transfer_config=NS_(kv_connector_extra_config=dict({"socket": socket}, **(extra or {})),
                                      kv_load_failure_policy="recompute"))


def test_vllm_groups_are_described_for_the_mapping_and_what_flexkvd_cannot_copy_is_refused(hma_vllm):
    adapter = hma_vllm[0]
    groups = adapter.describe_vllm_groups(GPT_OSS_CONFIG)
    assert groups == GPT_OSS_GROUPS  # the spec classes read as the harness's gpt-oss-like groups
    mapping = map_kv_cache_groups(groups, block_size=BS, tp_size=1)
    assert mapping.component_layers(0) == ("model.layers.2.attn", "model.layers.3.attn")  # vLLM's group 1
    assert mapping.component_layers(1) == ("model.layers.0.attn", "model.layers.1.attn")
    assert adapter.describe_vllm_groups(None) == []
    qwen = adapter.describe_vllm_groups(kv_cache_config(FullAttentionSpec(BS, 2, 64), MambaSpec(BS, 2048)))
    assert map_kv_cache_groups(qwen, block_size=BS, tp_size=1).geometry.components[0].state_bytes_per_layer == 2048
    for config, message in (
            (kv_cache_config(FullAttentionSpec(BS, 2, 64, page_size_padded=9000)), "padded page"),
            (kv_cache_config(FullAttentionSpec(BS, 2, 64), MambaSpec(BS, 2048, "none")),
             "mamba_cache_mode 'none' keeps no state per block"),
            (kv_cache_config(FullAttentionSpec(BS, 2, 64), ChunkedLocalAttentionSpec(BS)),
             r"group 1 \(ChunkedLocalAttentionSpec, 2 layers\)")):
        with pytest.raises(flexkvd.InvalidArgument, match=message):
            map_kv_cache_groups(adapter.describe_vllm_groups(config), block_size=BS, tp_size=1)
    # Whether this vLLM's scheduler can finish a load of several groups is read from its source.
    assert adapter.engine_loads_groups(GPT_OSS_CONFIG, 2) == (True, "")
    hma_vllm[3](SchedulerOneGroup)
    ok, why = adapter.engine_loads_groups(GPT_OSS_CONFIG, 2)
    assert not ok and "_update_waiting_for_remote_kv unpacks one KV cache group" in why
    assert adapter.engine_loads_groups(GPT_OSS_CONFIG, 1) == (True, "")


def test_the_connector_is_supports_hma_and_moves_every_group(daemon, hma_vllm, observer):
    adapter, role, SupportsHMA, set_scheduler = hma_vllm
    config = _vllm_config(daemon.socket, {"load_mode": "whole"})  # asynchronous loads (layer-wise: below)
    sched = adapter.FlexKVdConnector(config, role.SCHEDULER, GPT_OSS_CONFIG)
    worker = adapter.FlexKVdConnector(config, role.WORKER, GPT_OSS_CONFIG)
    assert isinstance(sched, SupportsHMA) and sched._config.geometry.is_hybrid
    worker._worker.create_host_kv(32)
    engine = HostKvEngine(worker._worker, 32)
    try:
        tokens = prompt(51, 5 * BS + 3)
        keys = flexkvd.block_keys(sched._config.namespace, tokens, BS)
        full_ids, window_ids = [1, 2, 3, 4, 5, 6], [0, 0, 9, 10, 11, 12]  # the window group: group 0
        engine.compute(keys, full_ids[:5], 0)
        engine.compute(keys[2:], window_ids[2:5], 1)
        req = NS_(request_id="r", all_token_ids=tokens, lora_request=None, mm_features=[],
                  num_computed_tokens=len(tokens), num_in_flight_tokens=0, num_publishable_block_hashes=5)
        assert sched.request_finished_all_groups(req, (window_ids, full_ids)) == (True, None)
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(NS_(preempted_req_ids=set()))))
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker._worker.wait_all()
        assert worker.get_finished({"r"}) == ({"r"}, None)
        sched.update_connector_output(NS_(finished_sending={"r"}, finished_recving=None))
        assert worker._worker.stats.stored_blocks == 5

        req2 = NS_(request_id="r2", all_token_ids=tokens, lora_request=None, mm_features=[], num_computed_tokens=0)
        assert sched.get_num_new_matched_tokens(req2, 2 * BS) == (3 * BS, True)
        blocks = NS_(get_block_ids=lambda: ([0, 0, 21, 22, 23, 24], [13, 14, 15, 16, 17, 18]))
        sched.update_state_after_alloc(req2, blocks, 3 * BS)
        worker.bind_connector_metadata(sched.build_connector_meta(NS_(preempted_req_ids=set())))
        worker.start_load_kv(None)
        worker._worker.wait_all()
        assert worker.get_finished(set()) == (None, {"r2"}) and worker.get_block_ids_with_load_errors() == set()
        assert engine.holds(keys[2:5], [15, 16, 17], 0) and engine.holds(keys[2:5], [21, 22, 23], 1)
        g = sched._config.geometry
        assert worker._worker.stats.loaded_bytes == 3 * g.component(0).host_block_bytes + \
            3 * g.component(1).host_block_bytes  # blocks 2..4 only: the engine held 0 and 1

        # A vLLM whose scheduler unpacks one group where a load ends: the connector stores, never loads.
        set_scheduler(SchedulerOneGroup)
        one = adapter.FlexKVdConnector(config, role.SCHEDULER, GPT_OSS_CONFIG)
        req3 = NS_(request_id="r3", all_token_ids=tokens, lora_request=None, mm_features=[], num_computed_tokens=0)
        assert one.get_num_new_matched_tokens(req3, 0) == (0, False)
        one.shutdown()
    finally:
        sched.shutdown()
        worker.shutdown()
        engine.release()
    assert settled_status(observer).sessions == 0


def test_the_default_layer_wise_mode_loads_every_group_in_the_step_that_computes_the_request(daemon, hma_vllm,
                                                                                               observer):
    """load_mode "layerwise" (the adapter's default) on a hybrid model: the hit is synchronous, start_load_kv loads
    every group's blocks past the engine's prefix, wait_for_layer_load returns with them in place, and get_finished
    reports nothing received and no load error (a layer-wise load is judged in its step)."""
    adapter, role, _, _ = hma_vllm
    config = _vllm_config(daemon.socket)
    sched = adapter.FlexKVdConnector(config, role.SCHEDULER, GPT_OSS_CONFIG)
    worker = adapter.FlexKVdConnector(config, role.WORKER, GPT_OSS_CONFIG)
    assert sched._config.layerwise and sched._config.geometry.is_hybrid
    worker._worker.create_host_kv(32)
    engine = HostKvEngine(worker._worker, 32)
    # What the adapter registers with GPU KV (register_kv_caches): each group's layer names at their index in the
    # geometry's layer order - full 0, window 0, full 1, window 1; vLLM's group 0 is the window.
    mapping = map_kv_cache_groups(adapter.describe_vllm_groups(GPT_OSS_CONFIG), block_size=BS, tp_size=1)
    names = [mapping.component_layers(c) for c in range(mapping.geometry.component_count)]
    worker._worker.register_layer_names(layer_order_names(mapping.geometry, names))
    assert worker._worker.layer_names == {"model.layers.2.attn": 0, "model.layers.0.attn": 1,
                                          "model.layers.3.attn": 2, "model.layers.1.attn": 3}
    try:
        tokens = prompt(52, 5 * BS + 3)
        keys = flexkvd.block_keys(sched._config.namespace, tokens, BS)
        full_ids, window_ids = [1, 2, 3, 4, 5, 6], [0, 0, 9, 10, 11, 12]
        engine.compute(keys, full_ids[:5], 0)
        engine.compute(keys[2:], window_ids[2:5], 1)
        req = NS_(request_id="r", all_token_ids=tokens, lora_request=None, mm_features=[],
                  num_computed_tokens=len(tokens), num_in_flight_tokens=0, num_publishable_block_hashes=5)
        assert sched.request_finished_all_groups(req, (window_ids, full_ids)) == (True, None)
        worker.bind_connector_metadata(sched.build_connector_meta(NS_(preempted_req_ids=set())))
        worker.start_load_kv(None)
        worker._worker.wait_all()
        assert worker.get_finished({"r"}) == ({"r"}, None)
        sched.update_connector_output(NS_(finished_sending={"r"}, finished_recving=None))

        req2 = NS_(request_id="r2", all_token_ids=tokens, lora_request=None, mm_features=[], num_computed_tokens=0)
        assert sched.get_num_new_matched_tokens(req2, 2 * BS) == (3 * BS, False)  # loaded in its step
        blocks = NS_(get_block_ids=lambda: ([0, 0, 21, 22, 23, 24], [13, 14, 15, 16, 17, 18]))
        sched.update_state_after_alloc(req2, blocks, 3 * BS)
        worker.bind_connector_metadata(sched.build_connector_meta(NS_(preempted_req_ids=set())))
        worker.start_load_kv(None)
        for name in ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn", "model.layers.3.attn"):
            worker.wait_for_layer_load(name)  # the model's order: window 0, window 1, full 0, full 1
            layer = int(name.split(".")[2])
            component, j = (1, layer) if layer < 2 else (0, layer - 2)
            blocks = [15, 16, 17] if component == 0 else [21, 22, 23]
            for key, block in zip(keys[2:5], blocks):
                assert np.array_equal(engine.kv_of(component)[j, :, block, :], engine.content(key, component)[j])
        assert worker.get_finished(set()) == (None, None) and worker.get_block_ids_with_load_errors() == set()
        g = sched._config.geometry
        assert worker._worker.stats.loaded_bytes == 3 * g.component(0).host_block_bytes + \
            3 * g.component(1).host_block_bytes
    finally:
        sched.shutdown()
        worker.shutdown()
        engine.release()
    assert settled_status(observer).sessions == 0


def _wait_events(relay, want: int, timeout: float = 10.0):
    got = []
    deadline = time.monotonic() + timeout
    while sum(len(e.hashes) for e in got) < want and time.monotonic() < deadline:
        got += relay.take()
        time.sleep(0.01)
    return got


def test_kv_events_of_the_namespace_reach_take_events_with_their_groups(make_daemon, hma_vllm):
    adapter, role, _, _ = hma_vllm
    d = make_daemon(["--max-domains", "2"])
    mapping = map_kv_cache_groups(GPT_OSS_GROUPS, block_size=BS, tp_size=1)
    ns = "vllm|pytest-events|main|bfloat16|tp1"
    with flexkvd.connect(d.socket) as c:
        c.attach("storer", ns, mapping.geometry)
        c.create_host_kv(flexkvd.Layout.LAYER_FIRST, 16, 0)
        c.create_host_kv(flexkvd.Layout.LAYER_FIRST, 16, 1)
        first = flexkvd.block_keys(ns, prompt(52, 4 * BS), BS)
        c.store(first, [[0, 1, 2, 3], [4, 5, 6]]).wait(timeout=10)
        relay = KvEventRelay(d.socket, ns, mapping)  # the snapshot announces what is already there
        try:
            events = _wait_events(relay, 4 + 3)
            full = [e for e in events if e.group == 1]  # component 0 is vLLM's group 1 here
            window = [e for e in events if e.group == 0]
            assert [h for e in full for h in e.hashes] == [key_bytes(k) for k in first]
            assert {h for e in window for h in e.hashes} == {key_bytes(k) for k in first[1:]}
            assert all(e.kind == "stored" and e.medium == "CPU" for e in events)
            assert full[0].spec_kind == "full_attention" and full[0].parent is None
            assert window[0].spec_kind == "sliding_window" and window[0].sliding_window == 3 * BS
            # Later stores arrive as they happen; another namespace's never do.
            with flexkvd.connect(d.socket) as other:
                other.attach("other", "another-model", flexkvd.Geometry(tokens_per_block=BS, num_layers=1,
                                                                         kv_heads_per_rank=1, head_dim=64))
                other.create_host_kv(flexkvd.Layout.LAYER_FIRST, 4)
                other.store(flexkvd.block_keys("another-model", prompt(53, 2 * BS), BS), [0, 1]).wait(timeout=10)
            more = flexkvd.block_keys(ns, prompt(52, 4 * BS) + prompt(54, 2 * BS), BS)
            c.store(more[4:], [[7, 8], [9, 10]]).wait(timeout=10)
            events = _wait_events(relay, 2 + 2)
            full = [e for e in events if e.group == 1]
            assert [h for e in full for h in e.hashes] == [key_bytes(k) for k in more[4:]]
            assert full[0].parent == key_bytes(more[3])
            assert all(e.block_size == BS for e in events)
            assert not relay.take()
            # vLLM's event classes, as the connector's take_events hands them over.
            vllm_event = adapter._vllm_event(full[0])
            assert isinstance(vllm_event, BlockStored) and vllm_event.group_idx == 1 and vllm_event.medium == "CPU"
        finally:
            relay.close()
    # A snapshot larger than the relay's bound: dropped, and the relay does not subscribe again (snapshot after
    # snapshot) until the engine took events; then a pause that doubles while it keeps overflowing.
    with flexkvd.connect(d.socket) as c:
        c.attach("storer2", ns, mapping.geometry)
        small = KvEventRelay(d.socket, ns, mapping, max_events=1, retry_s=0.2)
        try:
            deadline = time.monotonic() + 10
            while small.dropped == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert small.dropped > 0
            read = small.batches
            time.sleep(1.0)  # nobody takes: no second subscription meanwhile
            assert small.batches == read, f"{small.batches - read} batches read while no event was taken"
            small.take()
            deadline = time.monotonic() + 10
            while small.batches == read and time.monotonic() < deadline:
                time.sleep(0.01)
            assert small.batches > read  # taken: it subscribes again
        finally:
            small.close()
    # The option, through the connector: off by default, on with kv_events.
    config = _vllm_config(d.socket, {"namespace": ns})
    sched = adapter.FlexKVdConnector(config, role.SCHEDULER, GPT_OSS_CONFIG)
    assert sched.take_events() == ()
    sched.shutdown()
    on = adapter.FlexKVdConnector(_vllm_config(d.socket, {"kv_events": True, "namespace": ns}), role.SCHEDULER,
                                  GPT_OSS_CONFIG)
    try:
        deadline = time.monotonic() + 10
        got = []
        while len(got) < 1 and time.monotonic() < deadline:
            got += on.take_events()
            time.sleep(0.01)
        assert got and all(isinstance(e, (BlockStored, BlockRemoved)) for e in got)
    finally:
        on.shutdown()
    with pytest.raises(flexkvd.InvalidArgument, match="kv_events is 'yes'"):
        adapter.FlexKVdConnector(_vllm_config(d.socket, {"kv_events": "yes"}), role.SCHEDULER, GPT_OSS_CONFIG)
