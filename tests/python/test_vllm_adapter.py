"""flexkvd.integrations.vllm beyond the call sequences: its configuration, the adapter (imported without vLLM, and
driven through a stand-in of vLLM's interface), and the GPU description a TP rank hands rank 0 (as far as a machine
without a GPU goes)."""
from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import sys

import pytest

import flexkvd
from conftest import settled_status
from engine_process import TEST_GEOMETRY
from flexkvd.integrations._vllm_logic import ConnectorConfig, SchedulerLogic, vllm_namespace
from flexkvd.integrations._vllm_worker import RankKv, WorkerLogic
from vllm_harness import BS, NS, HostKvEngine, config, prompt


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, value) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def exported_description(tp_rank: int, layers: int, region_bytes: int, num_blocks: int) -> bytes:
    """What flexkv_gpu_kv_export writes (RegisterKvRequest of proto/flexkv/v1/control.proto, session fields empty),
    encoded here by hand because this machine has no GPU to describe: LAYER_FIRST, one region per layer."""
    regions = b"".join(_field(3, _field(1, bytes([7 + i]) * 64) + _field(2, 256) + _field(3, region_bytes))
                       for i in range(layers))
    cuda = _field(1, b"GPU-00000000-1111-2222-3333-444444444444") + _field(2, tp_rank) + regions
    return _field(3, int(flexkvd.Layout.LAYER_FIRST)) + _field(4, num_blocks) + _field(11, cuda)


class _FakeCudaTensor:
    """data_ptr/numel/element_size, as a CUDA tensor answers them (no CUDA here: describing it fails in libflexkv)."""

    is_cuda = True

    def data_ptr(self) -> int:
        return 0x7F0000000000

    def numel(self) -> int:
        return 4096

    def element_size(self) -> int:
        return 2

    def is_contiguous(self) -> bool:
        return True


def test_a_gpu_rank_above_0_travels_to_rank_0_as_an_exported_description(daemon):
    # TP rank r's worker describes its GPU KV (flexkvd.export_gpu_kv) and rank 0 registers it
    # (Client.register_exported_gpu_kv). Without a GPU here: libflexkv refuses to describe (no CUDA), rank 0 parses
    # a description in the exported format and the daemon answers its registration.
    g = flexkvd.Geometry(tokens_per_block=16, num_layers=2, kv_planes=2, kv_heads_per_rank=2, head_dim=64,
                        dtype_bytes=2, tp_size=2)
    with pytest.raises(flexkvd.Error, match="CUDA"):  # no CUDA driver here (or a libflexkv built without CUDA)
        WorkerLogic(config(daemon.socket, g), tp_rank=1).describe_kv(8, [_FakeCudaTensor(), _FakeCudaTensor()])
    with flexkvd.connect(daemon.socket) as c:
        c.attach("rank0", "vllm|pytest-tp2|main|bfloat16|tp2", g)
        with pytest.raises(flexkvd.InvalidArgument, match="not a GPU KV description"):
            c.register_exported_gpu_kv(b"\x01\x02junk")
        with pytest.raises(flexkvd.InvalidArgument, match="64-byte"):
            c.register_exported_gpu_kv(_field(3, 1) + _field(4, 8) + _field(11, _field(3, _field(1, b"x"))))
        with pytest.raises(flexkvd.Error) as answered:  # parsed, sent: the daemon answers (no GPU to open it here)
            c.register_exported_gpu_kv(exported_description(1, 2, 2 * 8 * 4096, 8))
        assert "not a GPU KV description" not in str(answered.value)
        assert "64-byte" not in str(answered.value)
    # The C ABI's import and export are inverses: what rank 0 imports is what rank r exported.
    import ctypes
    from flexkvd import _lib
    data = exported_description(1, 2, 2 * 8 * 4096, 8)
    kv = ctypes.c_void_p(0)
    _lib.check(_lib.lib.flexkv_gpu_kv_import(data, len(data), ctypes.byref(kv)))
    try:
        size = ctypes.c_size_t(0)
        _lib.check(_lib.lib.flexkv_gpu_kv_export(kv, None, 0, ctypes.byref(size)))
        small = ctypes.create_string_buffer(size.value - 1)
        assert _lib.lib.flexkv_gpu_kv_export(kv, small, size.value - 1, ctypes.byref(size)) == \
            flexkvd.StatusCode.OUT_OF_RANGE
        buf = ctypes.create_string_buffer(size.value)
        _lib.check(_lib.lib.flexkv_gpu_kv_export(kv, buf, size.value, ctypes.byref(size)))
        assert buf.raw[:size.value] == data
        assert _lib.lib.flexkv_gpu_kv_uuid(kv) == b"GPU-00000000-1111-2222-3333-444444444444"
    finally:
        _lib.lib.flexkv_gpu_kv_free(kv)
    w = WorkerLogic(config(daemon.socket, g))
    with pytest.raises(flexkvd.InvalidArgument, match="neither tensors nor an exported description"):
        w.register_kv([RankKv(0, "gpu", 8, tensors=[_FakeCudaTensor()]), RankKv(1, "gpu", 8)])
    described = pickle.loads(pickle.dumps(RankKv(1, "gpu", 8, exported=exported_description(1, 2, 65536, 8))))
    assert described.exported == exported_description(1, 2, 65536, 8)
    w.close()


# ---- configuration and the adapter ----

def test_extra_config_is_validated_and_the_namespace_separates_what_changes_kv():
    cfg = ConnectorConfig.from_extra_config({"socket": "/run/flexkvd/flexkvd.sock", "op_timeout_s": 1},
                                            default_namespace="ns", geometry=TEST_GEOMETRY)
    assert cfg.link.socket == "/run/flexkvd/flexkvd.sock" and cfg.op_timeout_s == 1.0 and cfg.namespace == "ns"
    with pytest.raises(flexkvd.InvalidArgument, match="unknown keys \\['sokcet'\\]"):
        ConnectorConfig.from_extra_config({"sokcet": "x"}, default_namespace="ns", geometry=TEST_GEOMETRY)
    with pytest.raises(flexkvd.InvalidArgument, match="op_timeout_s"):
        ConnectorConfig.from_extra_config({"op_timeout_s": "1"}, default_namespace="ns", geometry=TEST_GEOMETRY)
    names = {vllm_namespace("m", "bfloat16", 1), vllm_namespace("m", "fp8", 1), vllm_namespace("m", "bfloat16", 2),
             vllm_namespace("m", "bfloat16", 1, revision="abc"), vllm_namespace("m2", "bfloat16", 1)}
    assert len(names) == 5


def test_requests_that_cannot_be_keyed_are_neither_looked_up_nor_stored(daemon):
    s = SchedulerLogic(config(daemon.socket))
    p = prompt(17, 4 * BS)
    assert s.get_num_new_matched_tokens("r", p, 0, cacheable=False) == (0, False)
    assert s.request_finished("r", p, [0, 1, 2, 3], 4 * BS, cacheable=False) is False
    assert s.stats.lookups == 0 and s.stats.skipped_requests == 1
    s.close()


def test_the_adapter_imports_without_vllm_and_says_vllm_is_missing_when_the_class_is_requested(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not importable, whatever this machine has
    monkeypatch.delitem(sys.modules, "flexkvd.integrations.vllm", raising=False)
    module = importlib.import_module("flexkvd.integrations.vllm")
    assert module.SchedulerLogic is SchedulerLogic and module.WorkerLogic is WorkerLogic
    with pytest.raises(ImportError, match="FlexKVdConnector needs vLLM"):
        module.FlexKVdConnector
    with pytest.raises(ImportError, match="needs vLLM"):
        exec("from flexkvd.integrations.vllm import FlexKVdConnector", {})
    with pytest.raises(AttributeError):
        module.NoSuchThing


# ---- the adapter against a stand-in of vLLM's interface ----

class _StandInBase:
    """KVConnectorBase_V1's constructor and metadata binding as vllm/distributed/kv_transfer/kv_connector/v1/base.py
    has them (the rest of the interface is what FlexKVdConnector overrides)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._role = role

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata


@pytest.fixture
def standin_vllm(monkeypatch):
    """The few vLLM modules the adapter imports, as module objects (not vLLM: its interface, from its source)."""
    import dataclasses
    import enum
    import types

    role = enum.Enum("KVConnectorRole", {"SCHEDULER": 0, "WORKER": 1})

    @dataclasses.dataclass
    class KVConnectorStats:
        data: dict = dataclasses.field(default_factory=dict)

    modules = {
        "vllm": {}, "vllm.distributed": {}, "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {}, "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorBase_V1": _StandInBase, "KVConnectorMetadata": type("KVConnectorMetadata", (), {}),
            "KVConnectorRole": role},
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics": {"KVConnectorStats": KVConnectorStats},
        "vllm.distributed.parallel_state": {"get_tensor_model_parallel_rank": lambda: 0},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "flexkvd.integrations.vllm", raising=False)
    yield importlib.import_module("flexkvd.integrations.vllm"), role
    sys.modules.pop("flexkvd.integrations.vllm", None)


def test_the_adapter_translates_vllm_objects_for_the_logic_classes(daemon, standin_vllm, observer):
    from types import SimpleNamespace as NS_
    adapter, role = standin_vllm

    class BF16:
        itemsize = 2

        def __str__(self):
            return "torch.bfloat16"

    model = NS_(model="pytest-llama", revision=None, dtype=BF16(), use_mla=False, get_num_layers=lambda p: 2,
                get_num_kv_heads=lambda p: 2, get_head_size=lambda: 64)
    vllm_config = NS_(model_config=model, cache_config=NS_(block_size=16, cache_dtype="auto"),
                      parallel_config=NS_(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
                      kv_transfer_config=NS_(kv_connector_extra_config={"socket": daemon.socket},
                                             kv_load_failure_policy="fail"))
    assert adapter.geometry_from_vllm(vllm_config) == TEST_GEOMETRY
    # vLLM's default policy ends a request at a load error; flexkvd's blocks can go between lookup and load.
    with pytest.raises(ValueError, match='needs kv_load_failure_policy "recompute" \\(it is \'fail\'\\)'):
        adapter.FlexKVdConnector(vllm_config, role.SCHEDULER, None)
    vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
    sched = adapter.FlexKVdConnector(vllm_config, role.SCHEDULER, None)
    worker = adapter.FlexKVdConnector(vllm_config, role.WORKER, None)
    assert sched._config.namespace == NS and sched.get_finished_count() == 1
    assert worker.prefer_cross_layer_blocks  # one cross-layer tensor, whatever the attention backend
    assert adapter.FlexKVdConnector.get_required_kvcache_layout(vllm_config) == "NHD"  # the chunk order flexkvd keeps
    assert adapter.FlexKVdConnector.requires_piecewise_for_cudagraph({})  # layer waits must run
    assert not adapter.FlexKVdConnector.requires_piecewise_for_cudagraph({"load_mode": "whole"})
    worker._worker.create_host_kv(16)  # no GPU here: the worker's KV is host KV, registered by the logic class
    engine = HostKvEngine(worker._worker, 16)
    try:
        tokens = prompt(19, 4 * BS + 3)
        keys = flexkvd.block_keys(NS, tokens, BS)
        engine.compute(keys, [0, 1, 2, 3])
        req = NS_(request_id="r", all_token_ids=tokens, lora_request=None, mm_features=[],
                  num_computed_tokens=len(tokens), num_in_flight_tokens=0)
        assert sched.request_finished(req, [0, 1, 2, 3, 4]) == (True, None)  # Scheduler._connector_finished
        meta = sched.build_connector_meta(NS_(preempted_req_ids=set()))
        assert isinstance(meta, adapter.FlexKVdConnectorMetadata) and len(meta.stores) == 1
        meta = pickle.loads(pickle.dumps(meta))  # the executor sends the scheduler output to the worker processes
        assert isinstance(meta, adapter.FlexKVdConnectorMetadata)
        worker.bind_connector_metadata(meta)  # KVConnectorModelRunnerMixin._get_kv_connector_output
        worker.start_load_kv(None)
        worker._worker.wait_all()
        assert worker.get_finished({"r"}) == ({"r"}, None)
        sched.update_connector_output(NS_(finished_sending={"r"}, finished_recving=None))

        req2 = NS_(request_id="r2", all_token_ids=tokens, lora_request=None, mm_features=[], num_computed_tokens=0,
                   num_in_flight_tokens=0)
        # The adapter loads layer by layer by default: in the step that computes the request (not async).
        assert sched.get_num_new_matched_tokens(req2, 0) == (4 * BS, False)
        # The same tokens under a LoRA adapter are other blocks (keyed by the adapter's path and name): looked up,
        # missed.
        lora = NS_(request_id="r3", all_token_ids=tokens, mm_features=[],
                   lora_request=NS_(lora_name="adapter-a", lora_int_id=1, lora_path="/models/adapter-a"))
        assert sched.get_num_new_matched_tokens(lora, 0) == (0, False)
        # An adapter known only by name and int id (unique within one engine, not across the node): not cached.
        nameless = NS_(request_id="r3b", all_token_ids=tokens, mm_features=[],
                       lora_request=NS_(lora_name="adapter-a", lora_int_id=1))
        assert sched.get_num_new_matched_tokens(nameless, 0) == (0, False)
        # Media this connector cannot key (no features it knows): not cached at all.
        unreadable = NS_(request_id="r4", all_token_ids=tokens, lora_request=None, mm_features=[],
                         mm_inputs=[object()])
        assert sched.get_num_new_matched_tokens(unreadable, 0) == (0, False)
        sched.update_state_after_alloc(req2, NS_(get_block_ids=lambda: ([8, 9, 10, 11, 12],)), 4 * BS)
        worker.bind_connector_metadata(sched.build_connector_meta(NS_(preempted_req_ids=set())))
        worker.start_load_kv(None)
        for layer in range(2):  # the attention layers' wait_for_layer_load (host KV: the CPU waits for the layer)
            worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
        assert engine.holds(keys, [8, 9, 10, 11])
        assert worker.get_finished(set()) == (None, None) and worker.get_block_ids_with_load_errors() == set()
        assert engine.holds(keys, [8, 9, 10, 11])
        stats = pickle.loads(pickle.dumps(worker.get_kv_connector_stats()))  # from a worker process
        assert stats.data["loaded_blocks"] == 4 and stats.data["stored_blocks"] == 4
        total = stats.aggregate(sched.get_kv_connector_stats())
        assert total.reduce()["lookups"] == 2 and total.reduce()["skipped_requests"] == 2
        assert worker.get_kv_connector_stats() is None  # counters are per interval
    finally:
        sched.shutdown()
        worker.shutdown()
        engine.release()
    assert settled_status(observer).sessions == 0


def test_a_lookup_never_blocks_the_scheduler_when_the_engine_takes_not_yet(daemon):
    """vLLM's get_num_new_matched_tokens may answer None ("ask again later"): a daemon that is slow (here stopped)
    must not hold up the scheduler's step; the answer comes at a later call, and a lookup that never answers is a
    miss after op_timeout_s."""
    import signal
    import time as _time

    s = SchedulerLogic(dataclasses.replace(config(daemon.socket), op_timeout_s=1.5), may_defer=True)
    p = prompt(23, 4 * BS)
    client = flexkvd.connect(daemon.socket)
    client.attach("storer", NS, TEST_GEOMETRY)
    kv = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 8)
    stored = client.store(flexkvd.block_keys(NS, p, BS), [0, 1, 2, 3]).wait(timeout=10)
    assert stored.done_blocks == 4
    warm = (None, False)
    for _ in range(2000):  # the link is up (a loaded machine may take more than one step to answer)
        warm = s.get_num_new_matched_tokens("warm", prompt(99, BS), 0)
        if warm[0] is not None:
            break
        _time.sleep(0.005)
    assert warm == (0, False)

    def stop_daemon() -> None:
        # SIGSTOP is delivered asynchronously: on a loaded machine the daemon may still answer a request sent right
        # after kill(). Wait until the kernel reports it stopped (state T).
        os.kill(daemon.pid, signal.SIGSTOP)
        for _ in range(2000):
            with open(f"/proc/{daemon.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            _time.sleep(0.001)
        raise AssertionError("the daemon did not stop")

    stop_daemon()
    try:
        start = _time.monotonic()
        assert s.get_num_new_matched_tokens("r", p, 0) == (None, False)
        assert s.get_num_new_matched_tokens("r", p, 0) == (None, False)  # still in flight: the same lookup
        assert _time.monotonic() - start < 0.5
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    answer = None
    deadline = _time.monotonic() + 5
    while answer is None and _time.monotonic() < deadline:
        answer, _ = s.get_num_new_matched_tokens("r", p, 0)
        _time.sleep(0.005)
    assert answer == 4 * BS
    assert s.stats.lookups == 2 and s.stats.lookup_errors == 0  # one lookup each, however many calls it took
    # A daemon that stays stopped: a miss once op_timeout_s has passed since the lookup began.
    stop_daemon()
    try:
        q = prompt(24, 2 * BS)
        assert s.get_num_new_matched_tokens("q", q, 0) == (None, False)
        # A request aborted while its lookup is in flight: the lookup's result is taken later, not left behind.
        assert s.get_num_new_matched_tokens("aborted", prompt(25, 2 * BS), 0) == (None, False)
        assert s.request_finished("aborted", prompt(25, 2 * BS), [], 0) is False
        assert s.stray_matches == 1
        _time.sleep(1.6)
        assert s.get_num_new_matched_tokens("q", q, 0) == (0, False)
        assert s.stats.lookup_errors == 1
        assert s.stray_matches == 2  # and q's timed-out lookup
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    deadline = _time.monotonic() + 5
    while s.stray_matches and _time.monotonic() < deadline:
        s.build_connector_meta()  # each step takes the results that came
        _time.sleep(0.01)
    assert s.stray_matches == 0
    del kv
    client.close()
    s.close()


def test_not_yet_is_used_only_with_an_engine_whose_interface_documents_it():
    from flexkvd.integrations.vllm import engine_takes_not_yet

    class Documented:
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            """- An optional number of tokens ... If None, it means that the connector needs more time to determine
            the number of matched tokens, and the scheduler should query for this request again later."""

    class Older:
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            """- the number of tokens that can be loaded from the external KV cache beyond what is already computed."""

    assert engine_takes_not_yet(Documented) and not engine_takes_not_yet(Older) and not engine_takes_not_yet(object)
