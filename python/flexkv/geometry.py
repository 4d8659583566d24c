"""The shape of an engine's KV cache (flexkv::Geometry) and its layouts (flexkv::KvLayout)."""
from __future__ import annotations

import dataclasses
import enum

from . import _lib
from ._convert import c_uint


class Layout(enum.IntEnum):
    """How an engine lays out its KV cache; a chunk is one (layer, plane, block) of one TP rank."""

    LAYER_FIRST = 1  # [layer][plane][block][chunk]: vLLM-style per-layer tensors
    BLOCK_FIRST = 2  # [block][layer][plane][chunk]
    LAYER_BLOCK = 3  # [layer][block][plane][chunk]


@dataclasses.dataclass
class Geometry:
    """KV cache shape; the first session's geometry fixes the daemon's cache domain.

    The daemon validates it at attach (InvalidArgument naming the field and its accepted range):
    tokens_per_block a power of two in 1..4096, num_layers 1..1024, kv_planes 2 (K and V) or 1 (MLA),
    kv_heads_per_rank 1..1024, head_dim 1..65536, dtype_bytes 1, 2 or 4, tp_size 1..256; a chunk
    (chunk_bytes_per_rank) a multiple of 16 bytes and a host block at most 4 GiB. A geometry whose host layout
    differs from the cache domain's is refused with FailedPrecondition naming the first differing field.
    """

    tokens_per_block: int = 16
    num_layers: int = 0
    kv_planes: int = 2
    kv_heads_per_rank: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    tp_size: int = 1

    @property
    def is_mla(self) -> bool:
        return self.kv_planes == 1

    @property
    def host_kv_heads(self) -> int:
        """KV heads in one host block: all TP shards for K/V; MLA stores its latent plane once."""
        return self.kv_heads_per_rank if self.is_mla else self.kv_heads_per_rank * self.tp_size

    @property
    def chunk_bytes_per_rank(self) -> int:
        """Bytes of one (layer, plane, block) chunk as one TP rank holds it."""
        return self.tokens_per_block * self.kv_heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host block: all layers, planes and TP shards (Llama-3-8B at 16 tokens: 2 MiB)."""
        return self.tokens_per_block * self.num_layers * self.kv_planes * self.host_kv_heads * self.head_dim * \
            self.dtype_bytes

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

    def _to_c(self) -> _lib.GeometryStruct:
        """The C struct; InvalidArgument naming a field a uint32 cannot hold (the daemon checks the real ranges),
        TypeError for a field that is not an integer."""
        return _lib.GeometryStruct(*(c_uint(getattr(self, f.name), f"geometry.{f.name}")
                                     for f in dataclasses.fields(self)))
