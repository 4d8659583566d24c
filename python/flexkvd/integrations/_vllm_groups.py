"""vLLM's KV cache groups as flexkvd geometry components (docs/integrations.md, "Hybrid models").

vLLM's hybrid memory allocator keeps one KV cache group per kind of layer, each with its own block table over one
shared block pool (block ids are unique across groups; id 0 is the null block, which stands for a position whose
block was freed: a sliding-window position that left the window, a Mamba state that is not kept). flexkvd keeps
one component per kind of cache. The mapping is one component per group: the full-attention (or MLA) group is
component 0, the others follow in group order: a sliding window as a SLIDING_WINDOW component of its window, a Mamba
(or linear-attention) group as a STATE component whose snapshot after block i lives at the group's position i.

Pure: no vLLM here. The adapter (vllm.py, describe_vllm_groups) turns vLLM's KVCacheSpec objects into KvGroup.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import flexkvd
from flexkvd.geometry import MAX_COMPONENTS, ComponentKind, ComponentSpec

NULL_BLOCK = 0  # vLLM's BlockPool.null_block: a freed position in a sliding-window or Mamba group's block table

FULL, MLA, SLIDING_WINDOW, MAMBA = "full_attention", "mla_attention", "sliding_window", "mamba"


@dataclasses.dataclass(frozen=True)
class KvGroup:
    """One vLLM KV cache group, in plain numbers (per TP rank, as vLLM's specs are).

    kind: FULL, MLA, SLIDING_WINDOW, MAMBA, or anything else (refused, with `spec` in the message).
    num_layers: the group's layers; block_size: its tokens per block; num_kv_heads, head_size, dtype_bytes: an
    attention group's shape; sliding_window: a window's tokens; state_bytes: a Mamba group's bytes per layer and
    block (vLLM's page_size_bytes); spec: how the engine named it (for messages); refusal: why the adapter could
    not describe it (a spec flexkvd cannot copy), or ""; layer_names: the group's layers as vLLM names them in
    register_kv_caches (the layers whose tensors make up this group's component).
    """

    kind: str
    num_layers: int
    block_size: int
    num_kv_heads: int = 0
    head_size: int = 0
    dtype_bytes: int = 2
    sliding_window: int = 0
    state_bytes: int = 0
    spec: str = ""
    refusal: str = ""
    layer_names: Tuple[str, ...] = dataclasses.field(default=(), compare=False)


@dataclasses.dataclass(frozen=True)
class GroupSlot:
    """Where vLLM group `group` goes: flexkvd component `component` of kind `kind` (window_blocks for a window);
    layer_names: the group's layers (KvGroup.layer_names)."""

    group: int
    component: int
    kind: ComponentKind
    window_blocks: int = 0
    layer_names: Tuple[str, ...] = dataclasses.field(default=(), compare=False)


@dataclasses.dataclass(frozen=True)
class StorePlan:
    """A hybrid store of `count` keys: one id list per component (component order), the state boundaries, and
    window_keys (how many trailing keys carry window blocks: every window block the engine still holds)."""

    component_ids: List[List[int]]
    boundaries: List[int]
    window_keys: int


class GroupMap:
    """The engine's groups as flexkvd components, and the id lists a load or store of each needs.

    Block ids travel as one list per vLLM group, in group order, each indexed by block position (vLLM's
    KVCacheBlocks.get_block_ids()). A plain full-attention engine has one group.
    """

    def __init__(self, slots: Sequence[GroupSlot], geometry: flexkvd.Geometry) -> None:
        self.slots: Tuple[GroupSlot, ...] = tuple(slots)
        self.geometry = geometry
        self._by_component = sorted(self.slots, key=lambda s: s.component)

    @classmethod
    def single(cls, geometry: flexkvd.Geometry) -> "GroupMap":
        """Group i is component i (kinds from the geometry): a full-attention engine, or a logic-class user whose
        block ids come in component order."""
        return cls([GroupSlot(i, i, geometry.component_kind(i), geometry.window_blocks(i))
                    for i in range(geometry.component_count)], geometry)

    @property
    def num_groups(self) -> int:
        return len(self.slots)

    def component_layers(self, component: int) -> Tuple[str, ...]:
        """The layer names of the group that is `component` (empty when the groups were not described by name)."""
        return self._by_component[component].layer_names

    @property
    def full_group(self) -> int:
        """The vLLM group that is component 0 (full attention)."""
        return self._by_component[0].group

    @property
    def is_hybrid(self) -> bool:
        return len(self.slots) > 1

    @property
    def has_state(self) -> bool:
        return any(s.kind == ComponentKind.STATE for s in self.slots)

    def as_groups(self, block_ids: Sequence) -> List[List[int]]:
        """block_ids as one list per group: a flat sequence of ints is the one group of a single-group engine.
        InvalidArgument for another number of groups."""
        if len(block_ids) == 0:  # no blocks (a request preempted, then aborted)
            return [[] for _ in self.slots]
        if not isinstance(block_ids[0], (list, tuple)):
            groups = [[int(b) for b in block_ids]]
        else:
            groups = [[int(b) for b in g] for g in block_ids]
        if len(groups) != len(self.slots):
            raise flexkvd.InvalidArgument(f"block ids of {len(groups)} KV cache groups; this engine has "
                                          f"{len(self.slots)} (one list per group, in vLLM's group order)")
        return groups

    def load_ids(self, groups: Sequence[Sequence[int]], first: int, end: int) -> Optional[List[List[int]]]:
        """The per-component id lists of a load of prefix end `end` past the engine's first `first` blocks: FULL
        [first, end), a window's [max(first, end - w), end), a state's position end - 1. None when a position it
        needs is the null block or missing (the engine does not hold a block there)."""
        out: List[List[int]] = []
        for s in self._by_component:
            ids = groups[s.group]
            if s.kind == ComponentKind.FULL:
                need = range(first, end)
            elif s.kind == ComponentKind.SLIDING_WINDOW:
                need = range(max(first, end - s.window_blocks), end)
            else:
                need = range(end - 1, end)
            part = [ids[i] if i < len(ids) else NULL_BLOCK for i in need]
            if self.is_hybrid and NULL_BLOCK in part:
                return None
            out.append(part)
        return out

    def positions_ids(self, groups: Sequence[Sequence[int]], start: int, end: int) -> List[int]:
        """Every group's ids at positions [start, end), the null block left out: what a load that did not fill
        those positions reports to vLLM (block ids are unique across groups)."""
        return [b for g in groups for b in g[start:end] if not (self.is_hybrid and b == NULL_BLOCK)]

    def store_plan(self, groups: Sequence[Sequence[int]], count: int) -> Optional[StorePlan]:
        """What a store of the first `count` blocks carries: FULL ids [0, count); each window the ids of the
        trailing positions the engine still holds (window_keys: the shortest run over the windows, at least each
        window's min(w, count)); the state boundaries b (1..count) where every state group holds the snapshot
        after block b - 1 and every window is there. None when the windows the store's end needs are gone."""
        if not self.is_hybrid:
            return StorePlan([list(groups[0][:count])], [], 0)
        window_keys = count
        need = 0
        for s in self.slots:
            if s.kind != ComponentKind.SLIDING_WINDOW:
                continue
            ids = groups[s.group][:count]
            held = 0
            while held < len(ids) and ids[len(ids) - 1 - held] != NULL_BLOCK:
                held += 1
            need = max(need, min(s.window_blocks, count))
            window_keys = min(window_keys, held)
        if window_keys < need:
            return None
        boundaries = []
        states = [s for s in self.slots if s.kind == ComponentKind.STATE]
        if states:
            first_end = count - window_keys + need  # the earliest end whose every window is stored
            for b in range(max(1, first_end), count + 1):
                if all(b - 1 < len(groups[s.group]) and groups[s.group][b - 1] != NULL_BLOCK for s in states):
                    boundaries.append(b)
        out: List[List[int]] = []
        for s in self._by_component:
            ids = groups[s.group]
            if s.kind == ComponentKind.FULL:
                out.append(list(ids[:count]))
            elif s.kind == ComponentKind.SLIDING_WINDOW:
                out.append(list(ids[count - window_keys:count]))
            else:
                out.append([ids[b - 1] for b in boundaries])
        sizes = {min(s.window_blocks, count) for s in self.slots if s.kind == ComponentKind.SLIDING_WINDOW}
        # 0 is the daemon's default, each window's trailing blocks (and what a geometry without windows takes).
        trailing_only = not sizes or (window_keys == need and len(sizes) == 1)
        return StorePlan(out, boundaries, 0 if trailing_only else window_keys)


def map_kv_cache_groups(groups: Sequence[KvGroup], *, block_size: int, tp_size: int) -> GroupMap:
    """The flexkvd geometry and group mapping of an engine's KV cache groups (vLLM's kv_cache_config.kv_cache_groups,
    described as KvGroup). Full attention or MLA: component 0 (exactly one such group); a sliding window: a
    SLIDING_WINDOW component of its window; Mamba: a STATE component of state_bytes per layer. InvalidArgument,
    naming the group and its spec, for a group flexkvd cannot represent: another kind, a second full-attention
    group, a block size other than the engine's, a state size that is not a multiple of 16, no full-attention
    group, or more than 8 groups."""
    if not groups:
        raise flexkvd.InvalidArgument("the engine has no KV cache groups; expected at least one full-attention group")

    def refuse(i: int, g: KvGroup, why: str) -> flexkvd.InvalidArgument:
        return flexkvd.InvalidArgument(f"KV cache group {i} ({g.spec or g.kind}, {g.num_layers} layers): {why}")

    if block_size <= 0 or block_size & (block_size - 1):
        raise flexkvd.InvalidArgument(f"the engine's block size is {block_size} tokens; flexkvd needs a power of two "
                                      "(vLLM may raise a hybrid model's attention block size to match its Mamba "
                                      "page: set a block size that is a power of two)")
    if len(groups) > MAX_COMPONENTS:
        raise flexkvd.InvalidArgument(f"the engine has {len(groups)} KV cache groups; flexkvd holds at most "
                                      f"{MAX_COMPONENTS} components (one per group)")
    full = None
    for i, g in enumerate(groups):
        if g.refusal:
            raise refuse(i, g, g.refusal)
        if g.kind not in (FULL, MLA, SLIDING_WINDOW, MAMBA):
            raise refuse(i, g, "flexkvd represents full attention, MLA, sliding-window and Mamba groups only")
        if g.block_size != block_size:
            raise refuse(i, g, f"block size {g.block_size}; flexkvd needs every group at the engine's block size "
                               f"{block_size}")
        if g.num_layers <= 0:
            raise refuse(i, g, "no layers")
        if g.kind in (FULL, MLA):
            if full is not None:
                raise refuse(i, g, f"a second full-attention group (group {full} is one); flexkvd has one "
                                   "full-attention component")
            full = i
        if g.kind == SLIDING_WINDOW and g.sliding_window <= 0:
            raise refuse(i, g, f"sliding window {g.sliding_window}; expected > 0 tokens")
        if g.kind == MAMBA and (g.state_bytes <= 0 or g.state_bytes % 16):
            raise refuse(i, g, f"state of {g.state_bytes} bytes per layer; flexkvd needs a positive multiple of 16")
    if full is None:
        raise flexkvd.InvalidArgument(f"no full-attention group among {[g.spec or g.kind for g in groups]}; flexkvd "
                                      "keys a prefix by its full-attention blocks (component 0)")
    f = groups[full]
    mla = f.kind == MLA
    components: List[ComponentSpec] = []
    slots = [GroupSlot(full, 0, ComponentKind.FULL, layer_names=f.layer_names)]
    for i, g in enumerate(groups):
        if i == full:
            continue
        if g.kind == SLIDING_WINDOW:
            components.append(ComponentSpec.sliding_window(g.num_layers, g.num_kv_heads, g.head_size,
                                                           g.sliding_window, dtype_bytes=g.dtype_bytes))
            slots.append(GroupSlot(i, len(components), ComponentKind.SLIDING_WINDOW,
                                   -(-g.sliding_window // block_size), g.layer_names))
        elif g.kind == MAMBA:
            components.append(ComponentSpec.state(g.num_layers, g.state_bytes))
            slots.append(GroupSlot(i, len(components), ComponentKind.STATE, layer_names=g.layer_names))
        else:
            raise refuse(i, g, "a second full-attention group; flexkvd has one full-attention component")
    geometry = flexkvd.Geometry(tokens_per_block=block_size, num_layers=f.num_layers, kv_planes=1 if mla else 2,
                                kv_heads_per_rank=1 if mla else f.num_kv_heads, head_dim=f.head_size,
                                dtype_bytes=f.dtype_bytes, tp_size=tp_size, components=components)
    return GroupMap(sorted(slots, key=lambda s: s.group), geometry)
