"""flexkvd.integrations._vllm_layouts: vLLM's KV cache tensors (fake tensors: pointers, shapes, strides) planned as
flexkvd registrations. Each accepted plan is checked chunk by chunk: the address flexkvd's CUDA backend computes for
(layer, plane, block) from the plan equals the address of that chunk in the engine's tensor, from its strides."""
from __future__ import annotations

import pytest

import flexkvd
from flexkvd.integrations._vllm_layouts import layer_number, plan_cross_layer_kv_cache, plan_kv_caches

GEOM = flexkvd.Geometry(tokens_per_block=16, num_layers=4, kv_planes=2, kv_heads_per_rank=2, head_dim=64,
                        dtype_bytes=2, tp_size=1)
MLA = flexkvd.Geometry(tokens_per_block=16, num_layers=3, kv_planes=1, kv_heads_per_rank=1, head_dim=576,
                       dtype_bytes=2, tp_size=1)
NB = 6


class FakeTensor:
    """What a CUDA torch.Tensor answers about its memory: data_ptr, shape, stride (elements), element_size."""

    is_cuda = True

    def __init__(self, ptr, shape, stride, itemsize=2, device="cuda:0"):
        self.ptr, self.shape, self._stride, self.itemsize, self.device = ptr, tuple(shape), tuple(stride), itemsize, \
            device

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return self._stride

    def element_size(self):
        return self.itemsize


def view(ptr, physical_shape, order, itemsize=2):
    """A tensor laid out C-contiguous as physical_shape, viewed with logical dim i = physical dim order.index(i)
    (vLLM: physical = logical permuted by the backend's stride order)."""
    strides, step = [0] * len(physical_shape), 1
    for d in reversed(range(len(physical_shape))):
        strides[d] = step
        step *= physical_shape[d]
    logical = [order.index(i) for i in range(len(order))]
    return FakeTensor(ptr, [physical_shape[p] for p in logical], [strides[p] for p in logical], itemsize)


def nbytes(shape, itemsize=2):
    n = itemsize
    for d in shape:
        n *= d
    return n


def chunk_in_tensor(t, geometry, plane, block):
    """Address of (plane, block)'s chunk in one layer's tensor, from its strides (token 0, head 0, dim 0)."""
    per = geometry.tokens_per_block // (t.shape[-3] if geometry.kv_planes == 2 else t.shape[-2])
    kb = block * per
    if geometry.kv_planes == 1:
        return t.ptr + kb * t.stride()[0] * t.itemsize
    pd, bd = (0, 1) if t.shape[0] == 2 else (1, 0)
    return t.ptr + (plane * t.stride()[pd] + kb * t.stride()[bd]) * t.itemsize


def chunk_in_plan(plan, geometry, layer, plane, block):
    """Address flexkvd's CUDA backend copies (layer, plane, block) at, from the registration."""
    chunk, P, B, L = geometry.chunk_bytes_per_rank, geometry.kv_planes, plan.num_blocks, geometry.num_layers
    if plan.layout == flexkvd.Layout.LAYER_FIRST:
        return plan.regions[layer] + plane * B * chunk + block * chunk
    if plan.layout == flexkvd.Layout.LAYER_BLOCK_REGIONS:
        return plan.regions[layer] + (block * P + plane) * chunk
    if plan.layout == flexkvd.Layout.LAYER_BLOCK:
        return plan.regions[0] + ((layer * B + block) * P + plane) * chunk
    return plan.regions[0] + ((block * L + layer) * P + plane) * chunk


def check_every_chunk(plan, geometry, layers):
    """layers: the engine's per-layer tensors in flexkvd's layer order. Chunks are contiguous runs of chunk bytes
    (checked by the plan); here every chunk's start must agree, and the regions must hold every chunk."""
    for l, t in enumerate(layers):
        for p in range(geometry.kv_planes):
            for b in range(plan.num_blocks):
                assert chunk_in_plan(plan, geometry, l, p, b) == chunk_in_tensor(t, geometry, p, b), (l, p, b)
                start = chunk_in_plan(plan, geometry, l, p, b)
                per_layer = plan.layout in (flexkvd.Layout.LAYER_FIRST, flexkvd.Layout.LAYER_BLOCK_REGIONS)
                region = plan.regions[l] if per_layer else plan.regions[0]
                assert region <= start and start + geometry.chunk_bytes_per_rank <= region + plan.region_bytes


def names(n):
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


# ---- per-layer tensors ----

def test_flash_attn_layers_in_their_own_allocations_register_layer_first():
    shape = (2, NB, 16, 2, 64)
    ptrs = [0x7F0000000000 + i * 0x1000000 + (i * 4096) for i in range(4)]  # anywhere, in no order
    tensors = {n: view(p, shape, [0, 1, 2, 3, 4]) for n, p in zip(names(4), reversed(ptrs))}
    # vLLM's dict order is not the layer order
    plan = plan_kv_caches(dict(reversed(list(tensors.items()))), GEOM)
    assert plan.layout == flexkvd.Layout.LAYER_FIRST
    assert plan.regions == [tensors[n].ptr for n in names(4)]
    assert plan.region_bytes == nbytes(shape) and plan.num_blocks == NB and plan.left_out == {}
    assert [plan.layer_index(n) for n in names(4)] == [0, 1, 2, 3]
    check_every_chunk(plan, GEOM, [tensors[n] for n in names(4)])


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON_ATTN"])
def test_block_major_layers_back_to_back_in_one_allocation_register_layer_block(backend):
    shape = (NB, 2, 16, 2, 64)
    base = 0x7F0000000000
    tensors = [view(base + i * nbytes(shape), shape, [0, 1, 2, 3, 4]) for i in range(4)]
    plan = plan_kv_caches(dict(zip(names(4), tensors)), GEOM)
    assert plan.layout == flexkvd.Layout.LAYER_BLOCK, backend
    assert plan.regions == [base] and plan.region_bytes == 4 * nbytes(shape)
    check_every_chunk(plan, GEOM, tensors)


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON_ATTN"])
def test_block_major_layers_in_separate_allocations_register_layer_block_regions(backend):
    # vLLM allocates each layer on its own (a draft model, a hybrid model, cross_layer_blocks off): the layers lie
    # anywhere, in no order, with gaps; each is one region, block b's K at b * 2 * chunk and V right after it.
    shape = (NB, 2, 16, 2, 64)
    ptrs = [0x7F0000000000 + i * 3 * nbytes(shape) + i * 4096 for i in range(4)]
    tensors = {n: view(p, shape, [0, 1, 2, 3, 4]) for n, p in zip(names(4), reversed(ptrs))}
    plan = plan_kv_caches(dict(reversed(list(tensors.items()))), GEOM)
    assert plan.layout == flexkvd.Layout.LAYER_BLOCK_REGIONS, backend
    assert plan.regions == [tensors[n].ptr for n in names(4)]
    assert plan.region_bytes == nbytes(shape) and plan.num_blocks == NB and plan.form == "blocks-first"
    assert [plan.layer_index(n) for n in names(4)] == [0, 1, 2, 3]
    assert [plan.layer_index_of_pointer(tensors[n].ptr) for n in names(4)] == [0, 1, 2, 3]
    check_every_chunk(plan, GEOM, [tensors[n] for n in names(4)])
    chunk = GEOM.chunk_bytes_per_rank
    t = tensors[names(4)[2]]
    assert chunk_in_plan(plan, GEOM, 2, 0, 5) == t.ptr + 5 * 2 * chunk            # K of block 5
    assert chunk_in_plan(plan, GEOM, 2, 1, 5) == t.ptr + 5 * 2 * chunk + chunk    # V of block 5


def test_block_major_layers_with_a_draft_model_register_layer_block_regions_without_the_draft_layers():
    # EAGLE/MTP: the draft layer (numbered after the target's) has its own allocation; the target's layers are
    # registered a region each, the draft layer left out with the reason.
    shape = (NB, 2, 16, 2, 64)
    layers = {n: view(0x7F0000000000 + i * 0x1000000, shape, [0, 1, 2, 3, 4]) for i, n in enumerate(names(4))}
    layers["model.layers.4.self_attn.attn"] = view(0x7F0009000000, shape, [0, 1, 2, 3, 4])
    plan = plan_kv_caches(layers, GEOM)
    assert plan.layout == flexkvd.Layout.LAYER_BLOCK_REGIONS and len(plan.regions) == 4
    assert "draft" in plan.left_out["model.layers.4.self_attn.attn"]
    check_every_chunk(plan, GEOM, [layers[n] for n in names(4)])


def test_block_major_layers_with_padded_blocks_are_refused_naming_the_layer_and_the_layouts():
    # a block stride of three chunks (K, V and a gap): no layout of flexkvd's copies it
    padded = [view(0x7F0000000000 + i * 0x1000000, (NB, 3, 16, 2, 64), [0, 1, 2, 3, 4]) for i in range(4)]
    tensors = [FakeTensor(t.ptr, (NB, 2, 16, 2, 64), t.stride()) for t in padded]
    with pytest.raises(flexkvd.InvalidArgument) as refused:
        plan_kv_caches(dict(zip(names(4), tensors)), GEOM)
    text = str(refused.value)
    assert "model.layers.0.self_attn.attn" in text and "(6, 2, 16, 2, 64)" in text
    assert "strides (6144, 2048, 128, 64, 1)" in text
    assert "block stride is 12288 bytes" in text
    assert "LAYER_BLOCK_REGIONS" in text and "LAYER_BLOCK" in text and "BLOCK_FIRST" in text
    assert "FLASH_ATTN" in text


def test_hnd_chunks_are_refused_naming_the_setting():
    tensors = [view(0x7F0000000000 + i * 0x100000, (2, NB, 2, 16, 64), [0, 1, 3, 2, 4]) for i in range(4)]
    assert tensors[0].shape == (2, NB, 16, 2, 64)  # vLLM's logical shape, HND in the strides
    with pytest.raises(flexkvd.InvalidArgument, match="HND.*VLLM_KV_CACHE_LAYOUT=NHD"):
        plan_kv_caches(dict(zip(names(4), tensors)), GEOM)


def test_mla_layers_register_layer_first_with_one_plane():
    shape = (NB, 16, 576)
    tensors = [view(0x7E0000000000 + i * 0x800000, shape, [0, 1, 2]) for i in range(3)]
    plan = plan_kv_caches(dict(zip(names(3), tensors)), MLA)
    assert plan.layout == flexkvd.Layout.LAYER_FIRST and plan.region_bytes == nbytes(shape)
    check_every_chunk(plan, MLA, tensors)


def test_kernel_blocks_smaller_than_vllms_block_are_grouped():
    # vLLM's block_size 16 over a kernel block size 8: each block is two adjacent kernel blocks per plane.
    tensors = [view(0x7F0000000000 + i * 0x100000, (2, 2 * NB, 8, 2, 64), [0, 1, 2, 3, 4]) for i in range(4)]
    plan = plan_kv_caches(dict(zip(names(4), tensors)), GEOM)
    assert plan.layout == flexkvd.Layout.LAYER_FIRST and plan.num_blocks == NB
    check_every_chunk(plan, GEOM, tensors)
    blocks_first = [view(0x7F0000000000 + i * 0x100000, (2 * NB, 2, 8, 2, 64), [0, 1, 2, 3, 4]) for i in range(4)]
    with pytest.raises(flexkvd.InvalidArgument, match="kernel blocks that are not adjacent"):
        plan_kv_caches(dict(zip(names(4), blocks_first)), GEOM)


def test_draft_layers_are_left_out_with_the_reason():
    shape = (2, NB, 16, 2, 64)
    layers = {n: view(0x7F0000000000 + i * 0x100000, shape, [0, 1, 2, 3, 4]) for i, n in enumerate(names(4))}
    layers["model.layers.4.self_attn.attn"] = view(0x7F0000900000, shape, [0, 1, 2, 3, 4])  # EAGLE's layer
    plan = plan_kv_caches(layers, GEOM)
    assert len(plan.regions) == 4
    assert "draft" in plan.left_out["model.layers.4.self_attn.attn"]
    assert plan.layer_index("model.layers.4.self_attn.attn") is None


def test_missing_repeated_and_unnumbered_layers_are_refused():
    shape = (2, NB, 16, 2, 64)
    t = lambda i: view(0x7F0000000000 + i * 0x100000, shape, [0, 1, 2, 3, 4])  # noqa: E731
    with pytest.raises(flexkvd.InvalidArgument, match="missing: \\[3\\]"):
        plan_kv_caches({n: t(i) for i, n in enumerate(names(3))}, GEOM)
    twice = {n: t(i) for i, n in enumerate(names(4))}
    twice["draft.layers.2.attn"] = t(7)
    with pytest.raises(flexkvd.InvalidArgument, match="given twice: \\[2\\]"):
        plan_kv_caches(twice, GEOM)
    with pytest.raises(flexkvd.InvalidArgument, match="no layer number"):
        plan_kv_caches({"attn": t(0), "other": t(1)}, GEOM)
    assert layer_number("model.layers.12.self_attn.attn") == 12 and layer_number("layers.3") == 3


def test_shapes_the_geometry_does_not_describe_are_refused_naming_it():
    t = view(0x7F0000000000, (2, NB, 16, 4, 64), [0, 1, 2, 3, 4])
    with pytest.raises(flexkvd.InvalidArgument, match="2 KV heads per rank"):
        plan_kv_caches({n: t for n in names(4)}, GEOM)
    fp8 = [view(0x7F0000000000 + i * 0x100000, (2, NB, 16, 2, 64), [0, 1, 2, 3, 4], itemsize=1) for i in range(4)]
    with pytest.raises(flexkvd.InvalidArgument, match="1-byte elements"):
        plan_kv_caches(dict(zip(names(4), fp8)), GEOM)
    with pytest.raises(flexkvd.InvalidArgument, match="no dimension of 2"):
        plan_kv_caches({n: view(0x7F0000000000, (3, NB, 16, 2, 64), [0, 1, 2, 3, 4]) for n in names(4)}, GEOM)
    with pytest.raises(flexkvd.InvalidArgument, match="on cpu"):
        cpu = FakeTensor(0x1000, (2, NB, 16, 2, 64), (1, 1, 1, 1, 1))
        cpu.is_cuda, cpu.device = False, "cpu"
        plan_kv_caches({n: cpu for n in names(4)}, GEOM)


def test_layers_of_different_shapes_are_refused():
    a = view(0x7F0000000000, (2, NB, 16, 2, 64), [0, 1, 2, 3, 4])
    b = view(0x7F0000100000, (2, NB + 1, 16, 2, 64), [0, 1, 2, 3, 4])
    with pytest.raises(flexkvd.InvalidArgument, match="expected every layer in one shape"):
        plan_kv_caches(dict(zip(names(4), [a, a, a, b])), GEOM)


# ---- vLLM's cross-layer tensor ----

@pytest.mark.parametrize("backend,logical,order", [
    # physical (num_blocks, layers, 2, block_size, heads, head_dim) for every backend
    ("FLASH_ATTN", (4, 2, NB, 16, 2, 64), [2, 0, 1, 3, 4, 5]),
    ("FLASHINFER", (4, NB, 2, 16, 2, 64), [1, 0, 2, 3, 4, 5]),
])
def test_a_cross_layer_tensor_registers_block_first(backend, logical, order):
    physical = (NB, 4, 2, 16, 2, 64)
    whole = view(0x7D0000000000, physical, order)
    assert whole.shape == logical, backend
    plan = plan_cross_layer_kv_cache(whole, GEOM, names(4))
    assert plan.layout == flexkvd.Layout.BLOCK_FIRST and plan.regions == [whole.ptr]
    assert plan.region_bytes == nbytes(physical)
    per_layer = [FakeTensor(whole.ptr + l * whole.stride()[0] * 2, logical[1:], whole.stride()[1:]) for l in range(4)]
    check_every_chunk(plan, GEOM, per_layer)
    # wait_for_layer_load names a layer; the attention layer's kv_cache view tells which one by its pointer
    assert [plan.layer_index_of_pointer(t.ptr) for t in per_layer] == [0, 1, 2, 3]
    assert plan.layer_index("model.layers.2.self_attn.attn") == 2


def test_an_mla_cross_layer_tensor_registers_block_first():
    whole = view(0x7D0000000000, (NB, 3, 16, 576), [1, 0, 2, 3])
    plan = plan_cross_layer_kv_cache(whole, MLA)
    assert plan.layout == flexkvd.Layout.BLOCK_FIRST
    per_layer = [FakeTensor(whole.ptr + l * whole.stride()[0] * 2, whole.shape[1:], whole.stride()[1:])
                 for l in range(3)]
    check_every_chunk(plan, MLA, per_layer)


def test_a_cross_layer_tensor_with_other_layers_is_refused():
    whole = view(0x7D0000000000, (NB, 5, 2, 16, 2, 64), [1, 0, 2, 3, 4, 5])
    with pytest.raises(flexkvd.InvalidArgument, match="first dimension to be the geometry's 4 layers"):
        plan_cross_layer_kv_cache(whole, GEOM)
    # planes outermost, then blocks, then layers: no layout of flexkvd's; the refusal says how to avoid it
    planes_out = view(0x7D0000000000, (2, NB, 4, 16, 2, 64), [1, 2, 0, 3, 4, 5])
    assert planes_out.shape == (4, 2, NB, 16, 2, 64)
    with pytest.raises(flexkvd.InvalidArgument, match="<cross-layer 0>.*cross_layer_blocks to false"):
        plan_cross_layer_kv_cache(planes_out, GEOM)
    # layers first in memory (the identity order) and blocks K/V-interleaved: LAYER_BLOCK
    layered = view(0x7D0000000000, (4, NB, 2, 16, 2, 64), [0, 1, 2, 3, 4, 5])
    assert plan_cross_layer_kv_cache(layered, GEOM).layout == flexkvd.Layout.LAYER_BLOCK
