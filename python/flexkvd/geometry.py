"""The shape of an engine's KV cache (flexkv::Geometry), its components (flexkv::ComponentSpec) and its layouts
(flexkv::KvLayout)."""
from __future__ import annotations

import ctypes
import dataclasses
import enum
from typing import List, Optional, Tuple

from . import _lib
from ._convert import U64_MAX, c_uint
from .errors import InvalidArgument, Unimplemented

MAX_COMPONENTS = 8  # flexkv::Geometry::kMaxComponents: component 0 (the full-attention layers) and 7 others


class Layout(enum.IntEnum):
    """How an engine lays out its KV cache; a chunk is one (layer, plane, block) of one TP rank."""

    LAYER_FIRST = 1  # [layer][plane][block][chunk]; GPU: a region per layer (vLLM FLASH_ATTN's tensors)
    BLOCK_FIRST = 2  # [block][layer][plane][chunk]
    LAYER_BLOCK = 3  # [layer][block][plane][chunk], the layers back to back in one region
    LAYER_BLOCK_REGIONS = 4  # [layer][block][plane][chunk]; GPU: a region per layer (FlashInfer's, Triton's)


class ComponentKind(enum.IntEnum):
    """What a prefix end e (in blocks) needs of a component (flexkv::ComponentKind)."""

    FULL = 1            # every block of the prefix, [0, e): the geometry's own fields (component 0)
    SLIDING_WINDOW = 2  # the trailing window only, [e - window_blocks, e)
    STATE = 3           # one snapshot taken at e (linear attention / Mamba state)


@dataclasses.dataclass
class ComponentSpec:
    """A component of a hybrid model beside its full-attention layers; the same TP size and tokens per block as
    the geometry.

    SLIDING_WINDOW: kv_planes, kv_heads_per_rank, head_dim, dtype_bytes as Geometry's fields, and window_tokens
    (1..1048576, rounded up to whole blocks); state_bytes_per_layer 0.
    STATE: state_bytes_per_layer, one layer's snapshot on one TP rank (a multiple of 16 in 16..1 GiB; sharded over
    TP ranks, never replicated); window_tokens 0.
    """

    kind: ComponentKind = ComponentKind.SLIDING_WINDOW
    num_layers: int = 0
    kv_planes: int = 2
    kv_heads_per_rank: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    window_tokens: int = 0
    state_bytes_per_layer: int = 0

    @classmethod
    def sliding_window(cls, num_layers: int, kv_heads_per_rank: int, head_dim: int, window_tokens: int,
                       kv_planes: int = 2, dtype_bytes: int = 2) -> "ComponentSpec":
        return cls(ComponentKind.SLIDING_WINDOW, num_layers, kv_planes, kv_heads_per_rank, head_dim, dtype_bytes,
                   window_tokens)

    @classmethod
    def state(cls, num_layers: int, state_bytes_per_layer: int) -> "ComponentSpec":
        # The attention fields are unused for a state; 0 as in the C++ presets.
        return cls(ComponentKind.STATE, num_layers, 0, 0, 0, 0, 0, state_bytes_per_layer)

    def _to_c(self, i: int) -> _lib.ComponentStruct:
        name = f"geometry.components[{i}]"
        try:
            kind = int(self.kind)
        except (TypeError, ValueError):
            raise TypeError(f"{name}.kind is a {type(self.kind).__name__}; expected a flexkvd.ComponentKind") from None
        return _lib.ComponentStruct(
            c_uint(kind, f"{name}.kind"), c_uint(self.num_layers, f"{name}.num_layers"),
            c_uint(self.kv_planes, f"{name}.kv_planes"), c_uint(self.kv_heads_per_rank, f"{name}.kv_heads_per_rank"),
            c_uint(self.head_dim, f"{name}.head_dim"), c_uint(self.dtype_bytes, f"{name}.dtype_bytes"),
            c_uint(self.window_tokens, f"{name}.window_tokens"), 0,
            c_uint(self.state_bytes_per_layer, f"{name}.state_bytes_per_layer", U64_MAX))


@dataclasses.dataclass
class Geometry:
    """KV cache shape; the first session's geometry fixes the daemon's cache domain.

    The daemon validates it at attach (InvalidArgument naming the field and its accepted range):
    tokens_per_block a power of two in 1..4096, num_layers 1..1024, kv_planes 2 (K and V) or 1 (MLA),
    kv_heads_per_rank 1..1024, head_dim 1..65536, dtype_bytes 1, 2 or 4, tp_size 1..256; a chunk
    (chunk_bytes_per_rank) a multiple of 16 bytes and a host block at most 4 GiB; for a hybrid model, each
    component's fields (components[i].field in the message). A geometry whose host layout differs from the cache
    domain's is refused with FailedPrecondition naming the first differing field.

    Hybrid models: the fields above are component 0 (the full-attention layers) and `components` lists the others
    (at most 7) in the order the engine registers and passes their buffers; component(i) is the single-component
    geometry of component i's slot (block or state snapshot), whose host_block_bytes is the slot size.
    """

    tokens_per_block: int = 16
    num_layers: int = 0
    kv_planes: int = 2
    kv_heads_per_rank: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    tp_size: int = 1
    components: List[ComponentSpec] = dataclasses.field(default_factory=list)
    # Set only in a state component's copy geometry (component(i)); never attach with it.
    state_bytes_per_layer: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_planes == 1 and self.state_bytes_per_layer == 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.components)

    @property
    def host_kv_heads(self) -> int:
        """KV heads in one host block: all TP shards for K/V; MLA stores its latent plane once."""
        return self.kv_heads_per_rank if self.is_mla else self.kv_heads_per_rank * self.tp_size

    @property
    def chunk_bytes_per_rank(self) -> int:
        """Bytes of one (layer, plane, block) chunk as one TP rank holds it (a state copy geometry: one layer's
        state on one rank)."""
        if self.state_bytes_per_layer:
            return self.state_bytes_per_layer
        return self.tokens_per_block * self.kv_heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host block of component 0: all layers, planes and TP shards (Llama-3-8B at 16 tokens:
        2 MiB)."""
        return self.num_layers * self.kv_planes * self.chunk_bytes_per_rank * (1 if self.is_mla else self.tp_size)

    @property
    def component_count(self) -> int:
        """Components including component 0 (the full-attention layers): 1 + len(components)."""
        return 1 + len(self.components)

    def component_kind(self, i: int) -> ComponentKind:
        self._check_index(i)
        return ComponentKind.FULL if i == 0 else ComponentKind(self.components[i - 1].kind)

    def component(self, i: int) -> "Geometry":
        """The single-component geometry of component i's slot, as flexkv::Geometry::Component: component 0 is this
        geometry without components; a sliding-window component has its layers' shape; a state component has
        tokens_per_block 1, one plane and state_bytes_per_layer set (one slot = one snapshot of every layer and TP
        rank). IndexError outside 0..component_count-1."""
        self._check_index(i)
        g = Geometry(self.tokens_per_block, self.num_layers, self.kv_planes, self.kv_heads_per_rank, self.head_dim,
                     self.dtype_bytes, self.tp_size)
        if i == 0:
            return g
        c = self.components[i - 1]
        g.num_layers = c.num_layers
        if c.kind == ComponentKind.STATE:
            g.tokens_per_block, g.kv_planes, g.kv_heads_per_rank, g.head_dim, g.dtype_bytes = 1, 1, 1, 1, 1
            g.state_bytes_per_layer = c.state_bytes_per_layer
        else:
            g.kv_planes, g.kv_heads_per_rank, g.head_dim, g.dtype_bytes = (c.kv_planes, c.kv_heads_per_rank,
                                                                           c.head_dim, c.dtype_bytes)
        return g

    def window_blocks(self, i: int) -> int:
        """A sliding-window component's window in blocks, ceil(window_tokens / tokens_per_block); 0 for other
        kinds."""
        if self.component_kind(i) != ComponentKind.SLIDING_WINDOW:
            return 0
        return -(-self.components[i - 1].window_tokens // self.tokens_per_block)

    def component_id_count(self, i: int, store: bool, count: int, state_count: int = 0) -> int:
        """How many block ids of component i a load of prefix end `count` (store=False) or a store of `count` keys
        with `state_count` boundaries carries (common/hybrid_ids.h ComponentIdCount)."""
        kind = self.component_kind(i)
        if kind == ComponentKind.FULL:
            return count
        if kind == ComponentKind.SLIDING_WINDOW:
            return min(self.window_blocks(i), count)
        return state_count if store else 1

    @property
    def total_layers(self) -> int:
        """Every component's layers together (num_layers for a full-attention geometry)."""
        return self.num_layers + sum(c.num_layers for c in self.components)

    def layer_order(self) -> List[Tuple[int, int]]:
        """The order of a layer-wise load's layers: entry i = (component, layer) is the load's layer i (the index
        Ticket.wait_layers counts and a LayerEventSet's event i), every component's layers merged by depth
        (flexkv::Geometry::LayerOrder, docs/hybrid.md "Layer-wise loads"). Computed by libflexkv; Unimplemented
        with a library that predates hybrid layer-wise loads, InvalidArgument for a geometry that does not
        validate."""
        if not _lib.has_hybrid_layerwise:
            raise Unimplemented("the layer order of a hybrid load: the libflexkv loaded has no flexkv_layer_order "
                                "(it predates hybrid layer-wise loads); expected a newer libflexkv")
        n = self.total_layers
        component = (ctypes.c_uint32 * max(n, 1))()
        layer = (ctypes.c_uint32 * max(n, 1))()
        got = ctypes.c_size_t(0)
        _lib.check(_lib.lib.flexkv_layer_order(ctypes.byref(self._to_c()), component, layer, n, ctypes.byref(got)),
                   "layer order")
        return [(int(component[i]), int(layer[i])) for i in range(got.value)]

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.component_count:
            raise IndexError(f"component {i} is not in this geometry; expected 0..{self.component_count - 1}")

    @classmethod
    def llama3_8b(cls) -> "Geometry":
        """32 layers, K/V, 8 KV heads, head_dim 128, bf16, 16 tokens per block: 2 MiB per block."""
        return cls(tokens_per_block=16, num_layers=32, kv_planes=2, kv_heads_per_rank=8, head_dim=128)

    @classmethod
    def qwen3_8b(cls) -> "Geometry":
        """36 layers, otherwise as llama3_8b: 2.25 MiB per block."""
        return cls(tokens_per_block=16, num_layers=36, kv_planes=2, kv_heads_per_rank=8, head_dim=128)

    @classmethod
    def deepseek_mla(cls) -> "Geometry":
        """61 layers, one 576-wide latent plane (MLA): 18 KiB per chunk."""
        return cls(tokens_per_block=16, num_layers=61, kv_planes=1, kv_heads_per_rank=1, head_dim=576)

    # Hybrid presets: the numbers of flexkv::GptOss20B & co (common/geometry.cc, where the models' published
    # config.json values are written out).

    @classmethod
    def gpt_oss_20b(cls) -> "Geometry":
        """openai/gpt-oss-20b: 12 full + 12 sliding-window (128 tokens) layers, 8 KV heads x 64, bf16."""
        return cls(tokens_per_block=16, num_layers=12, kv_planes=2, kv_heads_per_rank=8, head_dim=64,
                   components=[ComponentSpec.sliding_window(12, 8, 64, 128)])

    @classmethod
    def gemma3_27b(cls) -> "Geometry":
        """google/gemma-3-27b: 10 global + 52 local (1024-token window) layers, 16 KV heads x 128, bf16."""
        return cls(tokens_per_block=16, num_layers=10, kv_planes=2, kv_heads_per_rank=16, head_dim=128,
                   components=[ComponentSpec.sliding_window(52, 16, 128, 1024)])

    @classmethod
    def qwen3_next_80b(cls) -> "Geometry":
        """Qwen/Qwen3-Next-80B-A3B: 12 full-attention layers (2 KV heads x 256) + 36 Gated-DeltaNet layers, one state
        of 32 x 128 x 128 fp32 + 8192 x 3 bf16 = 2,146,304 bytes per layer (TP 1)."""
        return cls(tokens_per_block=16, num_layers=12, kv_planes=2, kv_heads_per_rank=2, head_dim=256,
                   components=[ComponentSpec.state(36, 32 * 128 * 128 * 4 + 8192 * 3 * 2)])

    @classmethod
    def jamba_like(cls) -> "Geometry":
        """ai21labs/Jamba-v0.1-like: 4 attention layers (8 KV heads x 128) + 28 Mamba layers, one state of
        8192 x 16 fp32 + 8192 x 3 bf16 = 573,440 bytes per layer."""
        return cls(tokens_per_block=16, num_layers=4, kv_planes=2, kv_heads_per_rank=8, head_dim=128,
                   components=[ComponentSpec.state(28, 8192 * 16 * 4 + 8192 * 3 * 2)])

    def _to_c(self) -> _lib.GeometryStruct:
        """The C struct; InvalidArgument naming a field a uint32 cannot hold (the daemon checks the real ranges),
        TypeError for a field that is not an integer. The component array lives as long as the struct (_keep)."""
        if self.state_bytes_per_layer:
            raise InvalidArgument(f"geometry.state_bytes_per_layer is {self.state_bytes_per_layer}; expected 0 (a "
                                  "component's copy geometry cannot attach: state sizes belong to a state component)")
        if len(self.components) > MAX_COMPONENTS - 1:
            raise InvalidArgument(f"geometry has {len(self.components)} components beside the full-attention layers; "
                                  f"expected at most {MAX_COMPONENTS - 1}")
        fields = [c_uint(getattr(self, name), f"geometry.{name}") for name in
                  ("tokens_per_block", "num_layers", "kv_planes", "kv_heads_per_rank", "head_dim", "dtype_bytes",
                   "tp_size")]
        comps: Optional[ctypes.Array] = None
        if self.components:
            comps = (_lib.ComponentStruct * len(self.components))(
                *(c._to_c(i) for i, c in enumerate(self.components)))
        g = _lib.GeometryStruct(*fields, len(self.components), comps)
        g._keep = comps  # the pointer in g must not outlive the array
        return g

