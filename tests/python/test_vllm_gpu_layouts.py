"""GPU: the vLLM connector's logic with torch KV caches in the layouts of vLLM's attention backends - FLASH_ATTN's
per-layer tensors, FLASHINFER's and TRITON_ATTN's block-major layers (vLLM's cross-layer allocation, layers back to
back in one allocation, and each layer its own allocation), MLA's per-layer and cross-layer latent caches -
planned by _vllm_layouts and registered with a real flexkvd's CUDA backend. Engine A writes its KV with a kernel queued behind a long-running one and stores
it (the store waits for a CUDA event, the CPU does not wait for the stream); engine B loads it layer by layer into
other blocks of another layout, a kernel on its stream reading each layer right after wait_layer (vLLM's
wait_for_layer_load), and every chunk is compared byte for byte. Skipped where torch or a CUDA GPU is missing (the
2-core VM has neither)."""
from __future__ import annotations

import dataclasses
import time

import pytest

torch = pytest.importorskip("torch", reason="GPU layout tests need torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("GPU layout tests need a CUDA GPU visible to torch", allow_module_level=True)

import flexkvd  # noqa: E402
from flexkvd.integrations._vllm_layouts import plan_cross_layer_kv_cache, plan_kv_caches  # noqa: E402
from flexkvd.integrations._vllm_logic import SchedulerLogic  # noqa: E402
from flexkvd.integrations._vllm_worker import WorkerLogic, describe_rank_kv  # noqa: E402
from flexkvd.integrations.vllm import _cuda_fence  # noqa: E402
from vllm_harness import config, prompt  # noqa: E402

KV = flexkvd.Geometry(tokens_per_block=16, num_layers=4, kv_planes=2, kv_heads_per_rank=8, head_dim=128,
                      dtype_bytes=2, tp_size=1)
MLA = flexkvd.Geometry(tokens_per_block=16, num_layers=4, kv_planes=1, kv_heads_per_rank=1, head_dim=576,
                       dtype_bytes=2, tp_size=1)
NB = 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


class Cache:
    """One engine's KV cache in one backend's layout: the per-layer views vLLM's attention layers get, and the
    KvPlan the connector registers."""

    def __init__(self, form: str, g: flexkvd.Geometry) -> None:
        L, bs, h, d = g.num_layers, g.tokens_per_block, g.kv_heads_per_rank, g.head_dim
        bf16 = dict(dtype=torch.bfloat16, device="cuda")
        self.form = form
        if form == "flash_attn":      # per layer (2, NB, bs, h, d), each its own allocation
            self.layers = [torch.zeros((2, NB, bs, h, d), **bf16) for _ in range(L)]
        elif form == "flashinfer":    # vLLM's cross-layer tensor: physical (NB, L, 2, bs, h, d)
            self.cross = torch.zeros((NB, L, 2, bs, h, d), **bf16).permute(1, 0, 2, 3, 4, 5)
            self.layers = [self.cross[i] for i in range(L)]
        elif form == "triton":        # block-major layers back to back in one allocation
            whole = torch.zeros((L, NB, 2, bs, h, d), **bf16)
            self.layers = [whole[i] for i in range(L)]
        elif form == "flashinfer_layers":  # per layer (NB, 2, bs, h, d), each its own allocation, a gap between
            self.layers, self.gaps = [], []
            for _ in range(L):
                self.layers.append(torch.zeros((NB, 2, bs, h, d), **bf16))
                # 2 MiB, from the caching allocator's large pool as the layers are: the next layer never follows
                # right after this one (which would be LAYER_BLOCK)
                self.gaps.append(torch.zeros(1 << 20, **bf16))
        elif form == "mla":           # per layer (NB, bs, 576)
            self.layers = [torch.zeros((NB, bs, d), **bf16) for _ in range(L)]
        elif form == "mla_cross":     # cross-layer MLA: physical (NB, L, bs, 576)
            self.cross = torch.zeros((NB, L, bs, d), **bf16).permute(1, 0, 2, 3)
            self.layers = [self.cross[i] for i in range(L)]
        self.plan = plan_cross_layer_kv_cache(self.cross, g, NAMES) if hasattr(self, "cross") else \
            plan_kv_caches(dict(zip(NAMES, self.layers)), g)

    def chunk(self, layer: int, plane: int, block: int) -> "torch.Tensor":
        t = self.layers[layer]
        if self.form == "flash_attn":
            return t[plane, block]
        if self.form in ("flashinfer", "triton", "flashinfer_layers"):
            return t[block, plane]
        return t[block]

    def fill(self, layer: int, blocks, seed: int) -> None:
        """Random bytes into these blocks of a layer, written by kernels on the current stream."""
        g = torch.Generator(device="cuda")
        g.manual_seed(seed * 100 + layer)
        for b in blocks:
            for p in range(2 if self.form in ("flash_attn", "flashinfer", "triton", "flashinfer_layers") else 1):
                c = self.chunk(layer, p, b)
                c.copy_(torch.randn(c.shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16))


class Engine:
    def __init__(self, socket: str, form: str, g: flexkvd.Geometry, load_mode: str,
                 op_timeout_s: float = 10.0) -> None:
        cfg = dataclasses.replace(config(socket, g, f"vllm|gpu-layouts-{g.kv_planes}|main|bfloat16|tp1"),
                                  op_timeout_s=op_timeout_s, load_mode=load_mode)
        self.cache = Cache(form, g)
        self.scheduler = SchedulerLogic(cfg)
        self.worker = WorkerLogic(cfg)
        plan = self.cache.plan
        self.worker.store_fence = _cuda_fence
        self.worker.layer_stream = torch.cuda.current_stream
        self.worker.register_layer_names({n: i for i, n in enumerate(plan.layer_names)})
        self.worker.register_kv([describe_rank_kv(0, g, plan.num_blocks, plan.regions, plan.layout,
                                                  plan.region_bytes)])

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


@pytest.fixture
def engines(make_daemon):
    d = make_daemon(pool_size="1GiB")
    made = []

    def make(form: str, g: flexkvd.Geometry, load_mode: str = "layerwise", op_timeout_s: float = 10.0) -> Engine:
        made.append(Engine(d.socket, form, g, load_mode, op_timeout_s))
        return made[-1]

    try:
        yield make, d
    finally:
        for e in made:
            e.close()


def store_behind_a_running_kernel(a: Engine, tokens, ids) -> None:
    """A's forward: a long kernel, then the kernels that write the KV; the store is submitted at once and its
    bytes must be the ones written after the long kernel."""
    # The first fill of a process loads its kernels and the CUDA generator, which may wait for the device: warm up
    # before the long kernel, so that only start() is measured against the busy stream.
    a.cache.fill(0, ids[:1], seed=3)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time on the engine's stream
    for layer in range(len(a.cache.layers)):
        a.cache.fill(layer, ids, seed=3)
    assert a.scheduler.request_finished("a", tokens, ids, len(tokens))
    a.worker.start(a.scheduler.build_connector_meta())  # start_load_kv: must not wait for the stream
    assert not torch.cuda.current_stream().query(), "start() returned only after the stream had drained"
    assert a.worker.fenced_stores == 1  # parked behind the CUDA event
    sending = None
    deadline = time.monotonic() + 60
    finished = {"a"}
    while not sending and time.monotonic() < deadline:
        sending, _ = a.worker.get_finished(finished)
        finished = set()
        time.sleep(0.01)
    assert sending == {"a"} and a.worker.stats.stored_blocks == len(ids)


@pytest.mark.parametrize("writer,reader,g", [
    ("flash_attn", "flash_attn", KV), ("flash_attn", "flashinfer", KV), ("flashinfer", "triton", KV),
    ("triton", "flash_attn", KV), ("mla", "mla_cross", MLA), ("mla_cross", "mla", MLA),
    ("flashinfer_layers", "flash_attn", KV), ("flash_attn", "flashinfer_layers", KV),
    ("triton", "flashinfer_layers", KV), ("flashinfer_layers", "flashinfer_layers", KV)])
def test_layouts_round_trip_byte_exact_with_layer_wise_loads(engines, writer, reader, g):
    make, d = engines
    a = make(writer, g, load_mode="whole")
    b = make(reader, g)
    assert {"flash_attn": flexkvd.Layout.LAYER_FIRST, "mla": flexkvd.Layout.LAYER_FIRST,
            "flashinfer": flexkvd.Layout.BLOCK_FIRST, "mla_cross": flexkvd.Layout.BLOCK_FIRST,
            "triton": flexkvd.Layout.LAYER_BLOCK,
            "flashinfer_layers": flexkvd.Layout.LAYER_BLOCK_REGIONS}[reader] == b.cache.plan.layout
    tokens = prompt(21, 12 * g.tokens_per_block + 5)
    src = list(range(3, 15))
    store_behind_a_running_kernel(a, tokens, src)

    hit, asynchronous = b.scheduler.get_num_new_matched_tokens("b", tokens, 0)
    assert (hit, asynchronous) == (12 * g.tokens_per_block, False)
    dst = list(range(50, 62))
    b.scheduler.update_state_after_alloc("b", dst, hit)
    torch.cuda._sleep(int(2e8))  # the engine's stream is busy when the load starts: the waits must not assume
    b.worker.start(b.scheduler.build_connector_meta())  # start_load_kv: pins, loads, every copy enqueued
    planes = g.kv_planes
    seen = []
    for layer, name in enumerate(NAMES):
        b.worker.wait_layer(name)  # wait_for_layer_load: the stream waits on the layer's event
        # the layer's "attention": a kernel on the engine's stream reads the layer's loaded blocks
        seen.append([[b.cache.chunk(layer, p, blk).clone() for p in range(planes)] for blk in dst])
    assert b.worker.get_finished(set()) == (None, None)
    assert b.worker.take_load_errors() == set() and b.worker.stats.loaded_blocks == 12
    torch.cuda.synchronize()
    for layer in range(g.num_layers):
        for i, (s, t) in enumerate(zip(src, dst)):
            for p in range(planes):
                want = a.cache.chunk(layer, p, s).contiguous().view(torch.uint8)
                got = seen[layer][i][p].contiguous().view(torch.uint8)
                assert torch.equal(got, want), (writer, reader, layer, p, s, t)
    untouched = [blk for blk in range(NB) if blk not in dst]
    assert all(int(b.cache.chunk(0, 0, blk).abs().sum()) == 0 for blk in untouched[:8])


@pytest.mark.skipif(not flexkvd._lib.has_launch_deadlines,  # noqa: SLF001
                    reason="the libflexkv loaded has no flexkv_load_by (ring layout 6)")
def test_a_layer_wise_load_given_up_on_a_stopped_daemon_is_never_copied_into_the_engine(engines):
    # The daemon stops between the pin and the load: wait_launched gives up at op_timeout_s, the blocks are reported
    # as load errors; once it resumes, the load's launch deadline (the same time) keeps its copies off the GPU.
    make, d = engines
    a = make("flash_attn", KV, load_mode="whole")
    b = make("flash_attn", KV, op_timeout_s=0.5)
    tokens = prompt(23, 4 * KV.tokens_per_block + 1)
    store_behind_a_running_kernel(a, tokens, [3, 4, 5, 6])
    hit, _ = b.scheduler.get_num_new_matched_tokens("b", tokens, 0)
    assert hit == 4 * KV.tokens_per_block
    dst = [50, 51, 52, 53]
    b.scheduler.update_state_after_alloc("b", dst, hit)
    submit = b.worker._load  # noqa: SLF001

    def stop_then_submit(*args, **kw):
        d.freeze()
        return submit(*args, **kw)
    b.worker._load = stop_then_submit  # noqa: SLF001
    try:
        b.worker.start(b.scheduler.build_connector_meta())  # wait_launched gives up at the deadline
        for name in NAMES:
            b.worker.wait_layer(name)  # the given-up load has no events to wait on
        assert b.worker.get_finished(set()) == (None, None)
        assert b.worker.take_load_errors() == set(dst)
    finally:
        d.thaw()
    with flexkvd.connect(d.socket) as observer:
        until = time.monotonic() + 10
        while observer.status().pinned_blocks != 0 and time.monotonic() < until:
            b.worker.get_finished(set())  # retires the given-up load once it ended (DeadlineExceeded)
            time.sleep(0.02)
        assert observer.status().pinned_blocks == 0
    torch.cuda.synchronize()
    assert all(int(b.cache.chunk(layer, p, blk).abs().sum()) == 0
               for layer in range(KV.num_layers) for p in range(2) for blk in dst)


def test_block_major_layers_in_separate_allocations_register_a_region_per_layer(engines):
    # FlashInfer's per-layer tensors with a draft model's layer beside them: LAYER_BLOCK_REGIONS without the draft
    # layer; the daemon takes the registration (each layer's region checked against its blocks).
    make, d = engines
    layers, gaps = {}, []
    for n in NAMES + ["model.layers.4.self_attn.attn"]:
        layers[n] = torch.zeros((NB, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
        gaps.append(torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda"))  # no layer right after another
    plan = plan_kv_caches(layers, KV)
    assert plan.layout == flexkvd.Layout.LAYER_BLOCK_REGIONS
    assert plan.regions == [layers[n].data_ptr() for n in NAMES] and plan.region_bytes == layers[NAMES[0]].nbytes
    assert "model.layers.4.self_attn.attn" in plan.left_out
    with flexkvd.connect(d.socket) as c:
        c.attach("regions", "vllm|gpu-layouts-regions", KV)
        # one block more than the regions hold: refused before anything is opened, naming the layer
        with pytest.raises(flexkvd.InvalidArgument, match=r"region 0 \(layer 0\) has .* bytes; layout "
                                                          r"LAYER_BLOCK_REGIONS needs"):
            c.register_gpu_kv(plan.regions, plan.layout, plan.num_blocks + 1, region_bytes=plan.region_bytes)
        c.register_gpu_kv(plan.regions, plan.layout, plan.num_blocks, region_bytes=plan.region_bytes)


def test_a_store_overlapping_a_running_kernel_returns_without_waiting_for_it(engines):
    make, d = engines
    a = make("flash_attn", KV, load_mode="whole")
    tokens = prompt(22, 4 * KV.tokens_per_block)
    store_behind_a_running_kernel(a, tokens, [0, 1, 2, 3])
    with flexkvd.connect(d.socket) as c:
        c.attach("observer", "vllm|gpu-layouts-2|main|bfloat16|tp1", KV)
        assert c.match(flexkvd.block_keys("vllm|gpu-layouts-2|main|bfloat16|tp1", tokens, 16)).wait(
            timeout=5).matched_blocks == 4
