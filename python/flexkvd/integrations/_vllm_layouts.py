"""vLLM's KV cache tensors as flexkvd registers them: a pure function over shapes, strides and pointers (no torch).

vLLM hands a connector its KV cache either per layer (register_kv_caches: {layer name: tensor}) or, for a model
whose layers all share one attention backend and the connector prefers it, as one cross-layer tensor
(register_cross_layers_kv_cache: dim 0 is the layer). Each attention backend fixes a per-layer logical shape
(get_kv_cache_shape) and a physical order of it (get_kv_cache_stride_order; vLLM permutes the views, so the tensors
carry the physical order in their strides):

  FLASH_ATTN            (2, num_blocks, block_size, kv_heads, head_dim)   K/V planes first
  FLASHINFER, TRITON    (num_blocks, 2, block_size, kv_heads, head_dim)   blocks first, K and V inside a block
  MLA backends          (num_blocks, block_size, head_dim)                one latent plane
  cross-layer           the above with a layer dimension, laid out (num_blocks, layers, ...) by the backends

flexkvd's GPU copies (docs/python.md "GPU KV caches"; the CUDA backend's views) take a chunk - one (layer, plane,
block) of block_size x kv_heads x head_dim elements - as one contiguous run, at

  LAYER_FIRST          one region per layer:  layer base + plane * num_blocks * chunk + block * chunk
  LAYER_BLOCK_REGIONS  one region per layer:  layer base + (block * planes + plane) * chunk
  LAYER_BLOCK          one region:            base + ((layer * num_blocks + block) * planes + plane) * chunk
  BLOCK_FIRST          one region:            base + ((block * layers + layer) * planes + plane) * chunk

plan_kv_caches / plan_cross_layer_kv_cache find which of the four the tensors are (from their pointers and
strides, not from a backend's name), or refuse, naming the layer, its shape and strides, and the layouts accepted.
Block-major layers (FLASHINFER, TRITON_ATTN) are LAYER_BLOCK when they lie back to back in one allocation (one
region to open) and LAYER_BLOCK_REGIONS wherever they lie otherwise (vLLM's per-layer allocations: a draft model,
hybrid models, cross_layer_blocks off).
Layers of a draft model (EAGLE, MTP: vLLM numbers them after the target model's layers and puts them in the same
kv_caches) are left out: the geometry (and the cache domain) is the target model's, a draft layer's KV is not
restored by a load (the drafter proposes worse on a loaded prefix until it computed it; outputs do not change,
the target model verifies every proposal).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import flexkvd

__all__ = ["KvPlan", "LayerTensor", "layer_tensor", "plan_cross_layer_kv_cache", "plan_kv_caches"]

ACCEPTED = ("per-layer (2, num_blocks, block_size, kv_heads, head_dim) tensors with K/V planes first (FLASH_ATTN, "
            "NHD; LAYER_FIRST) or MLA's per-layer (num_blocks, block_size, head_dim), each contiguous; block-major "
            "layers (num_blocks, 2, block_size, kv_heads, head_dim) (FLASHINFER, TRITON_ATTN, NHD), each contiguous "
            "wherever it lies (LAYER_BLOCK_REGIONS; LAYER_BLOCK when back to back in one allocation) or interleaved "
            "per block as vLLM's cross-layer allocation lays them out (BLOCK_FIRST); inside a chunk the NHD order "
            "(block_size, kv_heads, head_dim)")


@dataclasses.dataclass(frozen=True)
class LayerTensor:
    """One layer's KV tensor as this module reads it: a pointer, the logical shape, strides in elements, the
    element size and the device ("cuda:0")."""

    name: str
    ptr: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    itemsize: int
    device: str = "cuda:0"

    def describe(self) -> str:
        return (f"layer {self.name!r}: shape {self.shape}, strides {self.stride} (elements of {self.itemsize} bytes) "
                f"at {self.ptr:#x} on {self.device}")


def layer_tensor(name: str, tensor: Any) -> LayerTensor:
    """A torch tensor (or anything with data_ptr(), shape, stride(), element_size() and device) as a LayerTensor."""
    for attr in ("data_ptr", "shape", "stride", "element_size"):
        if not hasattr(tensor, attr):
            raise flexkvd.InvalidArgument(f"KV cache of layer {name!r} is a {type(tensor).__name__} without "
                                          f"{attr}; expected a torch.Tensor")
    if getattr(tensor, "is_cuda", True) is False:
        raise flexkvd.InvalidArgument(f"KV cache of layer {name!r} is on {getattr(tensor, 'device', 'the CPU')}; "
                                      "expected a CUDA tensor")
    return LayerTensor(name, int(tensor.data_ptr()), tuple(int(d) for d in tensor.shape),
                       tuple(int(s) for s in tensor.stride()), int(tensor.element_size()),
                       str(getattr(tensor, "device", "cuda")))


@dataclasses.dataclass
class KvPlan:
    """What Client.register_gpu_kv takes for one TP rank, and which vLLM layer is which flexkvd layer.

    layout, regions (int device pointers: one per layer for LAYER_FIRST and LAYER_BLOCK_REGIONS, else one),
    region_bytes, num_blocks:
    register_gpu_kv(regions, layout, num_blocks, region_bytes=region_bytes). layer_names: the registered layers in
    flexkvd's layer order (None where a layer's name is not known: a cross-layer tensor given without names).
    layer_ptrs: each registered layer's base pointer (for layer_index_of_pointer). left_out: layer name -> why it is
    not registered. form: what the tensors were ("planes-first", "blocks-first", "mla", each "cross-layer" too;
    "mamba-state"). component: the geometry component registered (register_gpu_kv(component=...)); a hybrid
    model's plans (_vllm_state_layouts.plan_hybrid_kv_caches) are one per component, in its copy geometry."""

    layout: flexkvd.Layout
    regions: List[int]
    region_bytes: int
    num_blocks: int
    layer_names: List[Optional[str]]
    layer_ptrs: List[int]
    left_out: Dict[str, str] = dataclasses.field(default_factory=dict)
    form: str = ""
    component: int = 0

    def layer_index(self, name: str) -> Optional[int]:
        """flexkvd's layer index of a vLLM layer name; None for a layer not registered (a draft layer)."""
        try:
            return self.layer_names.index(name)
        except ValueError:
            return None

    def layer_index_of_pointer(self, ptr: int) -> Optional[int]:
        """flexkvd's layer index of the layer whose KV view starts at `ptr` (a vLLM attention layer's kv_cache
        tensor's data_ptr()); None when no registered layer starts there."""
        try:
            return self.layer_ptrs.index(int(ptr))
        except ValueError:
            return None


def layer_number(name: str) -> Optional[int]:
    """The layer index in a vLLM layer name ("model.layers.12.self_attn.attn" -> 12): the first dotted number."""
    found = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(found.group(1)) if found else None


def plan_kv_caches(kv_caches: Mapping[str, Any], geometry: flexkvd.Geometry) -> KvPlan:
    """The registration of vLLM's per-layer KV tensors ({layer name: tensor}, as register_kv_caches gets them)
    for `geometry` (one TP rank's full-attention layers). Layers numbered geometry.num_layers and above are draft
    layers, left out (KvPlan.left_out says so). InvalidArgument, naming the layer, its shape and strides and the
    layouts accepted, for a layout flexkvd cannot copy, a layer the geometry does not describe, or layers missing
    or given twice."""
    named: List[Tuple[int, str, Any]] = []
    left_out: Dict[str, str] = {}
    for name, tensor in kv_caches.items():
        n = layer_number(name)
        if n is None:
            if len(kv_caches) != 1:
                raise flexkvd.InvalidArgument(f"KV cache layer name {name!r} has no layer number; expected vLLM's "
                                              "names (\"model.layers.<i>.self_attn.attn\")")
            n = 0
        if n >= geometry.num_layers:
            left_out[name] = (f"layer number {n} is past the model's {geometry.num_layers} layers: a draft model's "
                              "layer (EAGLE/MTP), not part of the cached geometry")
            continue
        named.append((n, name, tensor))
    named.sort(key=lambda item: item[0])
    numbers = [n for n, _, _ in named]
    if numbers != list(range(geometry.num_layers)):
        twice = sorted({n for n in numbers if numbers.count(n) > 1})
        missing = sorted(set(range(geometry.num_layers)) - set(numbers))
        raise flexkvd.InvalidArgument(
            f"vLLM registered KV layers numbered {numbers}; expected one per layer 0..{geometry.num_layers - 1} "
            f"(the geometry's num_layers)" + (f"; given twice: {twice}" if twice else "") +
            (f"; missing: {missing}" if missing else ""))
    layers = [layer_tensor(name, tensor) for _, name, tensor in named]
    plan = _plan(layers, geometry, cross_layer=False)
    plan.left_out = left_out
    return plan


def plan_cross_layer_kv_cache(kv_cache: Any, geometry: flexkvd.Geometry,
                              layer_names: Optional[Sequence[str]] = None) -> KvPlan:
    """The registration of vLLM's cross-layer KV tensor (register_cross_layers_kv_cache): dim 0 is the layer, the
    rest one layer's logical shape, in the physical order the backend gave it. layer_names, when known, name its
    layers in order. InvalidArgument as plan_kv_caches."""
    whole = layer_tensor("<cross-layer>", kv_cache)
    if not whole.shape or whole.shape[0] != geometry.num_layers:
        raise flexkvd.InvalidArgument(
            f"cross-layer KV cache has shape {whole.shape}; expected its first dimension to be the geometry's "
            f"{geometry.num_layers} layers (a draft model's layers in it are not supported: they change the "
            "block's layout)")
    names: List[Optional[str]] = list(layer_names) if layer_names is not None else [None] * geometry.num_layers
    if len(names) != geometry.num_layers:
        raise flexkvd.InvalidArgument(f"{len(names)} layer names for a cross-layer KV cache of "
                                      f"{geometry.num_layers} layers; expected one per layer")
    step = whole.stride[0] * whole.itemsize
    layers = [LayerTensor(names[i] or f"<cross-layer {i}>", whole.ptr + i * step, whole.shape[1:], whole.stride[1:],
                          whole.itemsize, whole.device) for i in range(geometry.num_layers)]
    plan = _plan(layers, geometry, cross_layer=True)
    plan.layer_names = names
    return plan


@dataclasses.dataclass
class _Layer:
    t: LayerTensor
    num_blocks: int
    block_stride: int   # bytes
    plane_stride: int   # bytes; 0 for one plane
    form: str


def _plan(layers: List[LayerTensor], geometry: flexkvd.Geometry, cross_layer: bool) -> KvPlan:
    parsed = [_read_layer(t, geometry) for t in layers]
    first = parsed[0]
    for p in parsed[1:]:
        if (p.num_blocks, p.t.device, p.form) != (first.num_blocks, first.t.device, first.form):
            raise flexkvd.InvalidArgument(
                f"{p.t.describe()} differs from {first.t.describe()} ({p.num_blocks} vs {first.num_blocks} blocks, "
                f"{p.form} vs {first.form}); expected every layer in one shape on one GPU")
    chunk = geometry.chunk_bytes_per_rank
    planes = geometry.kv_planes
    L, B = len(parsed), first.num_blocks
    names: List[Optional[str]] = [p.t.name for p in parsed]
    ptrs = [p.t.ptr for p in parsed]
    form = first.form + (" cross-layer" if cross_layer else "")
    # LAYER_FIRST: each layer a region [plane][block][chunk].
    if all(p.block_stride == chunk and (planes == 1 or p.plane_stride == B * chunk) for p in parsed):
        return KvPlan(flexkvd.Layout.LAYER_FIRST, ptrs, planes * B * chunk, B, names, ptrs, form=form)
    # One region: the planes of a block adjacent (or one plane), layers at a fixed step from the first's base.
    if all(planes == 1 or p.plane_stride == chunk for p in parsed):
        base = ptrs[0]
        if all(p.block_stride == planes * chunk for p in parsed) and \
                ptrs == [base + i * B * planes * chunk for i in range(L)]:
            return KvPlan(flexkvd.Layout.LAYER_BLOCK, [base], L * B * planes * chunk, B, names, ptrs, form=form)
        if all(p.block_stride == L * planes * chunk for p in parsed) and \
                ptrs == [base + i * planes * chunk for i in range(L)]:
            return KvPlan(flexkvd.Layout.BLOCK_FIRST, [base], B * L * planes * chunk, B, names, ptrs, form=form)
    # LAYER_BLOCK_REGIONS: each layer a region [block][plane][chunk] of its own, wherever it lies.
    if planes == 2 and all(p.plane_stride == chunk and p.block_stride == planes * chunk for p in parsed):
        return KvPlan(flexkvd.Layout.LAYER_BLOCK_REGIONS, ptrs, planes * B * chunk, B, names, ptrs, form=form)
    bad = next((p for p in parsed if not (p.block_stride == chunk and (planes == 1 or p.plane_stride == B * chunk))),
               parsed[0])
    why = (f"its block stride is {bad.block_stride} bytes and plane stride {bad.plane_stride} bytes for "
           f"{chunk}-byte chunks, and the layers' bases {[hex(p) for p in ptrs[:4]]}... match no layout")
    if cross_layer:
        why += ("; set kv_connector_extra_config.cross_layer_blocks to false to have vLLM allocate the layers "
                "one by one")
    raise flexkvd.InvalidArgument(f"FlexKVdConnector cannot copy the KV cache of {bad.t.describe()}: {why}; "
                                  f"flexkvd accepts {ACCEPTED}")


def _read_layer(t: LayerTensor, geometry: flexkvd.Geometry) -> _Layer:
    """One layer's blocks: how many, their stride, the plane stride, after checking the chunk dims."""
    bs, heads, dim = geometry.tokens_per_block, geometry.kv_heads_per_rank, geometry.head_dim
    if len(t.shape) != len(t.stride):
        raise flexkvd.InvalidArgument(f"{t.describe()}: {len(t.shape)} dims but {len(t.stride)} strides")
    if geometry.kv_planes == 1:
        if len(t.shape) != 3:
            raise _refuse(t, geometry, f"{len(t.shape)} dims; an MLA layer is (num_blocks, block_size, head_dim)")
        blocks_dim, plane_dim, chunk_dims, form = 0, None, (1, 2), "mla"
        tail: Tuple[int, ...] = (dim,)
    else:
        if len(t.shape) != 5:
            raise _refuse(t, geometry, f"{len(t.shape)} dims; a K/V layer has 5")
        if t.shape[0] == 2:
            blocks_dim, plane_dim, form = 1, 0, "planes-first"
        elif t.shape[1] == 2:
            blocks_dim, plane_dim, form = 0, 1, "blocks-first"
        else:
            raise _refuse(t, geometry, "no dimension of 2 (K and V) in front")
        chunk_dims, tail = (2, 3, 4), (heads, dim)
    chunk_shape = tuple(t.shape[d] for d in chunk_dims)
    kernel_bs = chunk_shape[0]
    if chunk_shape[1:] != tail:
        raise _refuse(t, geometry, f"(block_size, ...) dims {chunk_shape}; the geometry has {(bs,) + tail}")
    if kernel_bs == 0 or bs % kernel_bs:
        raise _refuse(t, geometry, f"a block of {kernel_bs} tokens; the geometry's block is {bs} tokens (vLLM's "
                                   "block_size must be a multiple of the kernel's)")
    per_block = bs // kernel_bs  # vLLM blocks split into kernel blocks: per_block consecutive kernel blocks each
    elems = 1
    for d in chunk_shape:
        elems *= d
    if elems * t.itemsize * per_block != geometry.chunk_bytes_per_rank:
        raise _refuse(t, geometry, f"{t.itemsize}-byte elements; the geometry has {geometry.dtype_bytes}-byte "
                                   "ones")
    strides = [t.stride[d] for d in chunk_dims]
    dense = _dense_strides(chunk_shape)
    if strides != dense:
        hnd = len(chunk_dims) == 3 and strides == [dim, chunk_shape[0] * dim, 1]
        raise _refuse(t, geometry, "its chunk (block_size, kv_heads, head_dim) is in HND order; flexkvd keeps "
                                   "NHD chunks (blocks of two orders in one cache would not be the same bytes): "
                                   "set VLLM_KV_CACHE_LAYOUT=NHD" if hnd else
                      f"its (block_size, ...) strides {tuple(strides)} are not one contiguous chunk "
                      f"{tuple(dense)}")
    kernel_chunk = elems * t.itemsize
    kernel_blocks = t.shape[blocks_dim]
    kernel_stride = t.stride[blocks_dim] * t.itemsize
    if kernel_blocks % per_block:
        raise _refuse(t, geometry, f"{kernel_blocks} kernel blocks, not a multiple of the {per_block} in a block")
    if per_block > 1 and kernel_stride != kernel_chunk:
        raise _refuse(t, geometry, f"a {bs}-token block is {per_block} kernel blocks that are not adjacent")
    plane_stride = 0 if plane_dim is None else t.stride[plane_dim] * t.itemsize
    return _Layer(t, kernel_blocks // per_block, kernel_stride * per_block, plane_stride, form)


def _dense_strides(shape: Sequence[int]) -> List[int]:
    """C-order strides (elements) of `shape`, innermost last."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return list(reversed(out))


def _refuse(t: LayerTensor, geometry: flexkvd.Geometry, why: str) -> flexkvd.InvalidArgument:
    return flexkvd.InvalidArgument(
        f"FlexKVdConnector cannot copy the KV cache of {t.describe()}: {why} (geometry: block_size "
        f"{geometry.tokens_per_block}, {geometry.kv_heads_per_rank} KV heads per rank, head_dim "
        f"{geometry.head_dim}, {geometry.dtype_bytes}-byte elements); flexkvd accepts {ACCEPTED}")
