"""A hybrid model's vLLM KV tensors as one flexkvd registration per geometry component (pure: no torch).

vLLM's hybrid allocator gives each KV cache group's layers views of raw per-layer buffers (shared between groups:
block ids are unique across groups, so a block of one group never aliases a block of another). The connector maps
group to component (_vllm_groups.GroupMap) and registers each component's layers, in its copy geometry
(Geometry.component(c)), as a component of its own (Client.register_gpu_kv(component=c)):

  attention components (full, sliding window)  the component's layer names through _vllm_layouts' planner (any
                                               layout it accepts), layers ordered by their layer number
  Mamba state components                       one region per layer, LAYER_FIRST with one plane of
                                               state_bytes_per_layer per block: block b's state is the page
                                               [base + b * page, base + (b + 1) * page)

A Mamba layer's kv_caches entry is a list of state tensors (conv, SSM, ...) viewing one raw buffer: each tensor
(num_blocks, *state shape), its block stride one page. It registers only when its states lie back to back from the
page's start, each dense, all with the block stride page == the component's state_bytes_per_layer, ending inside
the page (a padded page's tail is copied with it): then copying the page copies the whole state and nothing of
another block. Anything else is refused, naming the layer, what was found and what is needed.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import flexkvd
from flexkvd.geometry import ComponentKind

from ._vllm_groups import GroupMap
from ._vllm_layouts import KvPlan, LayerTensor, _dense_strides, _plan, layer_number, layer_tensor

__all__ = ["plan_hybrid_kv_caches", "plan_state_layers"]


def plan_hybrid_kv_caches(kv_caches: Mapping[str, Any], groups: GroupMap) -> List[KvPlan]:
    """One KvPlan per component of groups.geometry (component order; KvPlan.component set) from vLLM's per-layer
    KV ({layer name: tensor, or a Mamba layer's list of state tensors}, as register_kv_caches gets them).
    InvalidArgument, naming the layer and what was expected, for: a group described without layer names, a layer
    in two groups or a group's layer count other than its component's, a group's layer missing from kv_caches, a
    kv_caches layer in no group (its KV would not be restored), and what plan_state_layers and _vllm_layouts'
    planner refuse."""
    geometry = groups.geometry
    owner: Dict[str, int] = {}
    by_component: List[List[str]] = []
    for c in range(geometry.component_count):
        names = list(groups.component_layers(c))
        want = geometry.component(c).num_layers
        if not names:
            raise flexkvd.InvalidArgument(
                f"component {c} ({geometry.component_kind(c).name}) has no layer names; the connector needs each "
                "KV cache group's layer_names (kv_cache_config.kv_cache_groups) to register a hybrid model's GPU KV")
        for name in names:
            if name in owner:
                raise flexkvd.InvalidArgument(
                    f"KV layer {name!r} is given twice (in components {owner[name]} and {c}); expected each layer "
                    "in exactly one KV cache group")
            owner[name] = c
        if len(names) != want:
            raise flexkvd.InvalidArgument(f"component {c} names {len(names)} layers; its geometry has {want}")
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise flexkvd.InvalidArgument(
                f"vLLM registered no KV for layer(s) {missing} of component {c} "
                f"({geometry.component_kind(c).name}); expected a tensor for every layer of every KV cache group")
        by_component.append(sorted(names, key=lambda n: (_number(n), n)))
    stray = sorted(n for n in kv_caches if n not in owner)
    if stray:
        raise flexkvd.InvalidArgument(
            f"vLLM registered KV for layer(s) {stray} that belong to no KV cache group the connector mapped "
            f"({sorted(owner)[:8]}...); their KV would not be stored or restored")
    plans: List[KvPlan] = []
    for c, names in enumerate(by_component):
        g = geometry.component(c)
        if geometry.component_kind(c) == ComponentKind.STATE:
            plan = plan_state_layers([(n, kv_caches[n]) for n in names], g)
        else:
            layers = []
            for n in names:
                t = kv_caches[n]
                if isinstance(t, (list, tuple)):
                    raise flexkvd.InvalidArgument(
                        f"KV of layer {n!r} (component {c}, {geometry.component_kind(c).name}) is a list of "
                        f"{len(t)} tensors; expected one attention KV tensor")
                layers.append(layer_tensor(n, t))
            plan = _plan(layers, g, cross_layer=False)
        plan.component = c
        plans.append(plan)
    return plans


def plan_state_layers(layers: Sequence[Tuple[str, Any]], geometry: flexkvd.Geometry) -> KvPlan:
    """The registration of a state component's layers ((name, state tensors) in flexkvd's layer order) for its
    copy geometry (Geometry.component(c) of a STATE component): LAYER_FIRST, one region of num_blocks pages per
    layer. InvalidArgument, naming the layer, what was found and what is needed, unless every layer's block b is
    the contiguous page [base + b * page, base + (b + 1) * page) holding all its states, page ==
    geometry.state_bytes_per_layer, and every layer has the same number of blocks on one device."""
    page = geometry.state_bytes_per_layer
    if page <= 0:
        raise flexkvd.InvalidArgument("plan_state_layers needs a state component's copy geometry "
                                      "(state_bytes_per_layer > 0)")
    if len(layers) != geometry.num_layers:
        raise flexkvd.InvalidArgument(f"{len(layers)} state layers; the component has {geometry.num_layers}")
    ptrs: List[int] = []
    names: List[str] = []
    first: Tuple[int, str] = (0, "")
    for name, value in layers:
        base, blocks, device = _state_page(name, value, page)
        if not ptrs:
            first = (blocks, device)
        elif (blocks, device) != first:
            raise flexkvd.InvalidArgument(
                f"Mamba layer {name!r} has {blocks} blocks on {device}; layer {names[0]!r} has {first[0]} on "
                f"{first[1]}: expected every state layer with the same blocks on one GPU")
        ptrs.append(base)
        names.append(name)
    return KvPlan(flexkvd.Layout.LAYER_FIRST, ptrs, first[0] * page, first[0], list(names), list(ptrs),
                  form="mamba-state")


def _state_page(name: str, value: Any, page: int) -> Tuple[int, int, str]:
    """(base, num_blocks, device) of one Mamba layer's state tensors, after checking that block b's states are
    the page [base + b * page, base + (b + 1) * page)."""
    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    if not tensors:
        raise flexkvd.InvalidArgument(f"Mamba layer {name!r} has no state tensors; expected vLLM's list of state "
                                      "views (conv, SSM, ...) of one buffer")
    states = [layer_tensor(f"{name}[{i}]", t) for i, t in enumerate(tensors)]

    def refuse(why: str) -> flexkvd.InvalidArgument:
        found = "; ".join(s.describe() for s in states)
        return flexkvd.InvalidArgument(
            f"FlexKVdConnector cannot copy the state of Mamba layer {name!r}: {why} (found {found}); flexkvd needs "
            f"each block's states back to back in one {page}-byte page (the component's state_bytes_per_layer, "
            "vLLM's page_size_bytes) at a block stride of one page, every state tensor (num_blocks, ...) dense "
            "inside a block")

    for s in states:
        if len(s.shape) != len(s.stride) or len(s.shape) < 1:
            raise refuse(f"{s.name} has shape {s.shape} and strides {s.stride}")
    blocks = states[0].shape[0]
    if blocks <= 0:
        raise refuse("no blocks")
    extents: List[Tuple[int, int, LayerTensor]] = []
    for s in states:
        if s.shape[0] != blocks:
            raise refuse(f"{s.name} has {s.shape[0]} blocks, {states[0].name} {blocks}")
        if s.device != states[0].device:
            raise refuse(f"{s.name} is on {s.device}, {states[0].name} on {states[0].device}")
        if s.stride[0] * s.itemsize != page:
            raise refuse(f"{s.name}'s block stride is {s.stride[0] * s.itemsize} bytes, not the {page}-byte page")
        inner = s.shape[1:]
        if any(d == 0 for d in inner):
            raise refuse(f"{s.name} holds no bytes per block")
        if [st for d, st in zip(inner, s.stride[1:]) if d != 1] != \
                [st for d, st in zip(inner, _dense_strides(inner)) if d != 1]:
            raise refuse(f"{s.name}'s state strides {s.stride[1:]} are not dense {tuple(_dense_strides(inner))}")
        size = s.itemsize
        for d in inner:
            size *= d
        extents.append((s.ptr, size, s))
    extents.sort(key=lambda e: e[0])
    base = extents[0][0]
    end = base
    for ptr, size, s in extents:
        if ptr != end:
            raise refuse(f"{s.name} starts {ptr - end:+d} bytes from where the states before it end (at offset "
                         f"{end - base} of the page); expected the states back to back")
        end = ptr + size
    if end - base > page:
        raise refuse(f"its states hold {end - base} bytes a block, more than the {page}-byte page")
    return base, blocks, states[0].device


def _number(name: str) -> int:
    n = layer_number(name)
    return -1 if n is None else n
