"""GPU: a hybrid model's vLLM KV caches registered through the connector's registration path (plan_engine_kv,
describe_plans, WorkerLogic.register_kv: one registration per geometry component) with a real flexkvd's CUDA
backend, laid out as vLLM's hybrid allocator lays them out: raw per-layer buffers, each shared by one layer of each
KV cache group (block ids are unique across groups); attention layers viewing them as (2, num_blocks, block_size,
heads, head_dim) - FLASH_ATTN's planes-first tensors for a gpt-oss-like model (window group listed first), K and V
of a block interleaved for a Qwen3-Next-like one (as vLLM makes them beside Mamba layers); Mamba layers as conv and
SSM state views of one page per block. Engine A stores a prompt's full-attention blocks, its window and its state
snapshots; engine B loads them into other block ids, and every byte is compared. Skipped where torch or a CUDA GPU
is missing (the 2-core VM has neither)."""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Tuple

import pytest

torch = pytest.importorskip("torch", reason="vLLM hybrid GPU registration tests need torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("vLLM hybrid GPU registration tests need a CUDA GPU visible to torch", allow_module_level=True)

import flexkvd  # noqa: E402
from flexkvd.integrations._vllm_groups import FULL, MAMBA, SLIDING_WINDOW, KvGroup, map_kv_cache_groups  # noqa: E402
from flexkvd.integrations._vllm_logic import SchedulerLogic  # noqa: E402
from flexkvd.integrations._vllm_worker import WorkerLogic  # noqa: E402
from flexkvd.integrations.vllm import _cuda_fence, describe_plans, plan_engine_kv  # noqa: E402
from vllm_harness import config, prompt  # noqa: E402

BS, H, D, NB = 16, 2, 64, 48
HIDDEN = BS * H * D            # elements of one K or V chunk
PAGE = 2 * HIDDEN * 2          # bytes of an attention block (bf16); Mamba pages are padded to it, as vLLM does
ATTN = "model.layers.{}.self_attn.attn"
LINEAR = "model.layers.{}.linear_attn"
# a Mamba group's states per block: (shape, dtype), back to back from the page's start
STATES_A = [((4, 64), torch.bfloat16), ((2, 16, 12), torch.float32)]   # 512 + 1536 bytes of the 8 KiB page
STATES_B = [((2, 64), torch.bfloat16), ((8, 48), torch.float32)]       # 256 + 1536 bytes


def attention_view(raw: "torch.Tensor", interleaved: bool) -> "torch.Tensor":
    """A layer's (2, NB, BS, H, D) bf16 view of a raw buffer: planes first (FLASH_ATTN), or K and V of a block
    next to each other (vLLM's layout for attention layers that share buffers with Mamba layers)."""
    flat = raw.view(torch.bfloat16)
    if not interleaved:
        return flat.view(2, NB, BS, H, D)
    return flat.as_strided((2, NB, BS, H, D), (HIDDEN, 2 * HIDDEN, H * D, D, 1))


def state_views(raw: "torch.Tensor", states) -> List["torch.Tensor"]:
    """A Mamba layer's state tensors as vLLM makes them: (NB, *shape) each, a page apart, back to back in it."""
    out, offset = [], 0
    for shape, dtype in states:
        item = torch.tensor([], dtype=dtype).element_size()
        inner = torch.empty((1, *shape)).stride()[1:]
        out.append(torch.as_strided(raw.view(dtype), (NB, *shape), (PAGE // item, *inner), offset // item))
        size = item
        for d in shape:
            size *= d
        offset += size
    return out


def raw_buffers(n: int) -> List["torch.Tensor"]:
    """n raw per-layer buffers of NB pages, each the front of an allocation 64 KiB larger: no buffer starts right
    where another ends (as vLLM's do not, each a large allocation of its own; adjacent ones would register as one
    region)."""
    return [torch.zeros(NB * PAGE + (64 << 10), dtype=torch.uint8, device="cuda")[:NB * PAGE] for _ in range(n)]


def gpt_oss_like():
    """Window group first (layers 0, 2; a 3-block window), full attention second (layers 1, 3); buffer i is
    shared by window layer 2i and full layer 2i + 1."""
    groups = [KvGroup(SLIDING_WINDOW, 2, BS, H, D, 2, sliding_window=3 * BS, spec="SlidingWindowSpec",
                      layer_names=(ATTN.format(0), ATTN.format(2))),
              KvGroup(FULL, 2, BS, H, D, 2, spec="FullAttentionSpec", layer_names=(ATTN.format(1), ATTN.format(3)))]
    raws = raw_buffers(2)
    caches = {ATTN.format(i): attention_view(raws[i // 2], interleaved=False) for i in range(4)}
    return groups, caches, raws


def qwen3_next_like():
    """Full attention (layers 3, 7) and two Mamba groups (layers 0, 1 and 2, 4); buffer i is shared by one layer
    of each group."""
    groups = [KvGroup(FULL, 2, BS, H, D, 2, spec="FullAttentionSpec", layer_names=(ATTN.format(3), ATTN.format(7))),
              KvGroup(MAMBA, 2, BS, state_bytes=PAGE, spec="MambaSpec", layer_names=(LINEAR.format(0),
                                                                                     LINEAR.format(1))),
              KvGroup(MAMBA, 2, BS, state_bytes=PAGE, spec="MambaSpec", layer_names=(LINEAR.format(2),
                                                                                     LINEAR.format(4)))]
    raws = raw_buffers(2)
    caches = {ATTN.format(3): attention_view(raws[0], interleaved=True),
              ATTN.format(7): attention_view(raws[1], interleaved=True),
              LINEAR.format(0): state_views(raws[0], STATES_A), LINEAR.format(1): state_views(raws[1], STATES_A),
              LINEAR.format(2): state_views(raws[0], STATES_B), LINEAR.format(4): state_views(raws[1], STATES_B)}
    return groups, caches, raws


MODELS = {"gpt-oss": gpt_oss_like, "qwen3-next": qwen3_next_like}


class Engine:
    def __init__(self, socket: str, model: str) -> None:
        described, self.caches, self.raws = MODELS[model]()
        self.groups = map_kv_cache_groups(described, block_size=BS, tp_size=1)
        cfg = dataclasses.replace(config(socket, self.groups.geometry, f"vllm|gpu-hybrid-{model}|main|bfloat16|tp1",
                                         groups=self.groups), op_timeout_s=10.0, load_mode="whole")
        self.scheduler = SchedulerLogic(cfg)
        self.worker = WorkerLogic(cfg)
        self.worker.store_fence = _cuda_fence  # stores wait for the engine's stream, as the adapter sets it
        self.plans = plan_engine_kv(self.caches, cfg)  # register_kv_caches' path, without vLLM's TP gather
        self.worker.register_kv(describe_plans(0, cfg.geometry, self.plans))

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


@pytest.fixture
def engines(make_daemon):
    d = make_daemon(pool_size="256MiB")
    made: List[Engine] = []

    def make(model: str) -> Engine:
        made.append(Engine(d.socket, model))
        return made[-1]

    try:
        yield make
    finally:
        for e in made:
            e.close()


def words(t: "torch.Tensor") -> "torch.Tensor":
    """The tensor's elements as integers of their size (NaN-free comparisons of random bytes)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def blocks_of(value, ids: List[int]) -> List["torch.Tensor"]:
    """A layer's blocks `ids`: an attention view's [2][ids], each Mamba state's [ids]."""
    if isinstance(value, list):
        return [words(s)[ids] for s in value]
    return [words(value)[:, ids]]


# vLLM's block ids per group (0 is the null block: a window position that left it, a state not kept); ids are
# unique across groups. (the store's ids, the load's ids, and which source block each loaded block is)
PLANS: Dict[str, Tuple[List[List[int]], List[List[int]]]] = {
    "gpt-oss": ([[0, 0, 0, 21, 22, 23], [1, 2, 3, 4, 5, 6]],
                [[0, 0, 0, 41, 42, 43], [31, 32, 33, 34, 35, 36]]),
    "qwen3-next": ([[1, 2, 3, 4, 5, 6], [0, 0, 13, 0, 0, 16], [0, 0, 23, 0, 0, 26]],
                   [[31, 32, 33, 34, 35, 36], [0, 0, 0, 0, 0, 41], [0, 0, 0, 0, 0, 42]]),
}


@pytest.mark.parametrize("model", ["gpt-oss", "qwen3-next"])
def test_a_hybrid_prompt_round_trips_byte_exact_through_per_component_registrations(engines, model):
    a = engines(model)
    b = engines(model)
    g = a.groups.geometry
    assert [p.component for p in a.plans] == list(range(g.component_count))
    if model == "qwen3-next":
        assert [p.layout for p in a.plans] == [flexkvd.Layout.LAYER_BLOCK_REGIONS, flexkvd.Layout.LAYER_FIRST,
                                               flexkvd.Layout.LAYER_FIRST]
        assert [p.region_bytes for p in a.plans] == [NB * PAGE] * 3
    else:
        assert [p.layout for p in a.plans] == [flexkvd.Layout.LAYER_FIRST] * 2
    for raw in a.raws:  # the forward pass: every block of every layer written (blocks are unique across groups)
        raw.random_(0, 256)
    src, dst = PLANS[model]
    tokens = prompt(31, 6 * BS + 5)
    assert a.scheduler.request_finished("a", tokens, src, len(tokens))
    a.worker.start(a.scheduler.build_connector_meta())
    sending, finished, deadline = None, {"a"}, time.monotonic() + 60
    while not sending and time.monotonic() < deadline:
        sending, _ = a.worker.get_finished(finished)
        finished = set()
        time.sleep(0.01)
    assert sending == {"a"} and a.worker.stats.stored_blocks == 6 and a.worker.stats.store_failures == 0

    hit, asynchronous = b.scheduler.get_num_new_matched_tokens("b", tokens, 0)
    assert (hit, asynchronous) == (6 * BS, True)
    b.scheduler.update_state_after_alloc("b", dst, hit)
    b.worker.start(b.scheduler.build_connector_meta())
    received, deadline = None, time.monotonic() + 60
    while not received and time.monotonic() < deadline:
        _, received = b.worker.get_finished(set())
        time.sleep(0.01)
    assert received == {"b"}
    assert b.worker.take_load_errors() == set() and b.worker.stats.loaded_blocks == 6
    torch.cuda.synchronize()

    # Each group's loaded blocks hold the source's bytes: FULL every block, the window its 3 trailing blocks, each
    # state group the snapshot at the prefix end (position 5).
    for slot in a.groups.slots:
        kind = g.component_kind(slot.component)
        if kind == flexkvd.ComponentKind.FULL:
            pairs = list(zip(src[slot.group], dst[slot.group]))
        elif kind == flexkvd.ComponentKind.SLIDING_WINDOW:
            pairs = list(zip(src[slot.group][3:], dst[slot.group][3:]))
        else:
            pairs = [(src[slot.group][5], dst[slot.group][5])]
        for name in slot.layer_names:
            for s, t in pairs:
                for want, got in zip(blocks_of(a.caches[name], [s]), blocks_of(b.caches[name], [t])):
                    assert torch.equal(got, want), (model, name, s, t)
    # Nothing else was written: every other block of every layer is still zero in B.
    loaded = {t for ids in dst for t in ids if t}
    others = [i for i in range(NB) if i not in loaded]
    for name, value in b.caches.items():
        assert all(int(torch.count_nonzero(x)) == 0 for x in blocks_of(value, others)), (model, name)


def test_mamba_states_in_allocations_of_their_own_are_refused_at_registration():
    # An engine whose conv and SSM states are separate tensors (block stride = each state's size): block b's state
    # is not one page, so it is refused, naming the layer, before anything is registered.
    described, caches, _ = qwen3_next_like()
    caches[LINEAR.format(2)] = [torch.zeros((NB, 2, 64), dtype=torch.bfloat16, device="cuda"),
                                torch.zeros((NB, 8, 48), dtype=torch.float32, device="cuda")]
    groups = map_kv_cache_groups(described, block_size=BS, tp_size=1)
    cfg = config("/nonexistent/flexkvd.sock", groups.geometry, "vllm|gpu-hybrid-refused|main|bfloat16|tp1", groups=groups)
    with pytest.raises(flexkvd.InvalidArgument, match=r"Mamba layer 'model.layers.2.linear_attn'.*block stride is "
                                                      r"256 bytes, not the 8192-byte page"):
        plan_engine_kv(caches, cfg)
