"""SGLang's HiCache host pool as flexkvd sees it: its layouts, the flexkv Geometry of one page, and a page of it as
a [layer][plane][token][head][byte] view that copies to and from a BLOCK_FIRST flexkv block.

Plain NumPy, no SGLang or torch: the adapter (sglang.py) hands in the pool's buffer as a uint8 array. The shapes are
SGLang's (python/sglang/srt/mem_cache/pool_host/mha.py and mla.py, init_kv_buffer), with the last axis in bytes
(head_dim x dtype bytes):

  MHA (K and V)  layer_first        (2, layers, tokens, heads, bytes)
                 page_first         (2, tokens, layers, heads, bytes)
                 page_first_direct  (2, pages, layers, page_size, heads, bytes)
                 page_head          (2, pages, heads, page_size, layers, bytes)
  MLA (latent)   layer_first        (layers, tokens, 1, bytes)
                 page_first         (tokens, layers, 1, bytes)
                 page_first_direct  (pages, layers, page_size, 1, bytes)

Every layout maps to one flexkvd block per SGLang page (tokens_per_block = page_size), copied in flexkvd's own block
order; any other layout (Ascend's page_first_kv_split) is refused by name.

FlatPagePool is any other host pool (a hybrid model's Mamba state pool, an NSA indexer pool): flexkvd sees its pages
only as the bytes SGLang's own get_data_page(index, flat=True) gives and set_from_flat_data_page takes, one page in a
block of a byte-blob geometry (blob_geometry) padded to whole 16-byte chunks.
"""
from __future__ import annotations

from typing import Callable, Tuple

import numpy as np

from ..errors import InvalidArgument
from ..geometry import Geometry

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

# Axis order taking one page, as the layout slices it, to (layer, plane, token, head, byte).
_MHA_TO_BLOCK = {
    "layer_first": (1, 0, 2, 3, 4),        # (2, L, T, H, B)
    "page_first": (2, 0, 1, 3, 4),         # (2, T, L, H, B)
    "page_first_direct": (1, 0, 2, 3, 4),  # (2, L, T, H, B) once the page axis is dropped
    "page_head": (3, 0, 2, 1, 4),          # (2, H, T, L, B) once the page axis is dropped
}
_MLA_TO_BLOCK = {
    "layer_first": (0, 2, 1, 3),           # (L, T, 1, B)
    "page_first": (1, 2, 0, 3),            # (T, L, 1, B)
    "page_first_direct": (0, 2, 1, 3),     # (L, T, 1, B) once the page axis is dropped
}


class HostPoolLayout:
    """One SGLang host pool (its buffer, layout and page size) and the flexkvd geometry of its pages.

    kv: the pool's whole buffer as a writable uint8 array in the layout's shape (above), its last axis the bytes of
    one head (head_dim x dtype_bytes). Immutable after construction; page views may be used from any thread (callers
    copy disjoint pages). Raises InvalidArgument naming what does not fit: an unknown layout, a buffer whose shape
    is not the layout's, a page size that is not a power of two, a head that is not whole dtype elements.
    """

    def __init__(self, kv: np.ndarray, layout: str, page_size: int, is_mla: bool, dtype_bytes: int) -> None:
        layouts = MLA_LAYOUTS if is_mla else MHA_LAYOUTS
        kind = "MLA" if is_mla else "MHA"
        if layout not in layouts:
            raise InvalidArgument(f"SGLang host pool layout {layout!r} is not supported for an {kind} pool; "
                                  f"expected one of {', '.join(layouts)}")
        if not isinstance(kv, np.ndarray) or kv.dtype != np.uint8:
            raise InvalidArgument("the host pool buffer must be a uint8 NumPy array (the pool's bytes)")
        if page_size < 1 or page_size & (page_size - 1):
            raise InvalidArgument(f"page_size {page_size} is not a power of two; flexkvd blocks need one "
                                  "(--page-size 16, 32, 64, ...)")
        if dtype_bytes not in (1, 2, 4):
            raise InvalidArgument(f"dtype of {dtype_bytes} bytes; expected 1, 2 or 4")
        expected_ndim = {("layer_first", False): 5, ("page_first", False): 5, ("page_first_direct", False): 6,
                         ("page_head", False): 6, ("layer_first", True): 4, ("page_first", True): 4,
                         ("page_first_direct", True): 5}[(layout, is_mla)]
        if kv.ndim != expected_ndim:
            raise InvalidArgument(f"{kind} {layout} host pool buffer has {kv.ndim} axes {kv.shape}; expected "
                                  f"{expected_ndim}")
        self.kv = kv
        self.layout = layout
        self.page_size = page_size
        self.is_mla = is_mla
        self.dtype_bytes = dtype_bytes
        self.layers, self.heads, self.head_bytes, self.num_pages = self._dimensions()
        if self.head_bytes % dtype_bytes:
            raise InvalidArgument(f"a head of {self.head_bytes} bytes is not whole {dtype_bytes}-byte elements")
        self.planes = 1 if is_mla else 2
        self.block_shape: Tuple[int, int, int, int, int] = (self.layers, self.planes, page_size, self.heads,
                                                            self.head_bytes)
        self.page_bytes = int(np.prod(self.block_shape))

    def _dimensions(self) -> Tuple[int, int, int, int]:
        """(layers, heads, bytes per head, pages) read off the buffer's shape."""
        s, t = self.kv.shape, self.page_size
        if self.is_mla:
            if self.layout == "layer_first":
                layers, tokens, heads, hb = s
            elif self.layout == "page_first":
                tokens, layers, heads, hb = s
            else:
                pages, layers, tokens_per_page, heads, hb = s
                self._check_page_axis(tokens_per_page)
                tokens = pages * t
        else:
            if s[0] != 2:
                raise InvalidArgument(f"MHA host pool buffer {s} does not start with the K/V axis of 2")
            if self.layout == "layer_first":
                _, layers, tokens, heads, hb = s
            elif self.layout == "page_first":
                _, tokens, layers, heads, hb = s
            elif self.layout == "page_first_direct":
                _, pages, layers, tokens_per_page, heads, hb = s
                self._check_page_axis(tokens_per_page)
                tokens = pages * t
            else:
                _, pages, heads, tokens_per_page, layers, hb = s
                self._check_page_axis(tokens_per_page)
                tokens = pages * t
        if tokens % t:
            raise InvalidArgument(f"host pool of {tokens} tokens is not whole pages of {t}")
        return layers, heads, hb, tokens // t

    def _check_page_axis(self, tokens_per_page: int) -> None:
        if tokens_per_page != self.page_size:
            raise InvalidArgument(f"{self.layout} host pool pages hold {tokens_per_page} tokens; the backend was "
                                  f"told page_size {self.page_size}")

    def geometry(self) -> Geometry:
        """The flexkvd geometry of one page as one block of this process's shard (tp_size 1: see sglang.py)."""
        return Geometry(tokens_per_block=self.page_size, num_layers=self.layers, kv_planes=self.planes,
                        kv_heads_per_rank=self.heads, head_dim=self.head_bytes // self.dtype_bytes,
                        dtype_bytes=self.dtype_bytes, tp_size=1)

    def page_of(self, first_token: int) -> int:
        """The page that starts at host token index `first_token`; InvalidArgument when it is not a page start
        inside the pool (SGLang allocates host memory in whole pages, so anything else is a caller's bug)."""
        if first_token % self.page_size or not 0 <= first_token < self.num_pages * self.page_size:
            raise InvalidArgument(f"host index {first_token} is not the start of a page of {self.page_size} tokens "
                                  f"in a pool of {self.num_pages} pages")
        return first_token // self.page_size

    def page_view(self, page: int) -> np.ndarray:
        """Page `page` of the pool as a (layer, plane, token, head, byte) view (writable, strided)."""
        t0 = page * self.page_size
        kv = self.kv
        if self.layout == "layer_first":
            part = kv[:, :, t0:t0 + self.page_size] if not self.is_mla else kv[:, t0:t0 + self.page_size]
        elif self.layout == "page_first":
            part = kv[:, t0:t0 + self.page_size] if not self.is_mla else kv[t0:t0 + self.page_size]
        else:
            part = kv[:, page] if not self.is_mla else kv[page]
        return self._to_block_order(part)

    def flat_page_view(self, flat: np.ndarray) -> np.ndarray:
        """A page as SGLang's get_data_page(flat=True) hands it (the layout's slice of one page, flattened) as a
        (layer, plane, token, head, byte) view. InvalidArgument when its size is not one page's."""
        data = np.asarray(flat).reshape(-1).view(np.uint8)
        if data.size != self.page_bytes:
            raise InvalidArgument(f"a flat page of {data.size} bytes; this pool's pages are {self.page_bytes}")
        L, P, T, H, B = self.block_shape
        shape = {
            ("layer_first", False): (2, L, T, H, B), ("page_first", False): (2, T, L, H, B),
            ("page_first_direct", False): (2, L, T, H, B), ("page_head", False): (2, H, T, L, B),
            ("layer_first", True): (L, T, 1, B), ("page_first", True): (T, L, 1, B),
            ("page_first_direct", True): (L, T, 1, B),
        }[(self.layout, self.is_mla)]
        return self._to_block_order(data.reshape(shape))

    def copy_to_block(self, page: int, block: np.ndarray) -> None:
        """Copies page `page` into a staging block (shape block_shape)."""
        np.copyto(block, self.page_view(page))

    def copy_from_block(self, block: np.ndarray, page: int) -> None:
        """Copies a staging block into page `page`."""
        np.copyto(self.page_view(page), block)

    def _to_block_order(self, part: np.ndarray) -> np.ndarray:
        """A view of one page (as the layout slices it, page axis dropped) in (layer, plane, token, head, byte)
        order; never a copy, so writes land in the pool."""
        if self.is_mla:  # (layer, 1, token, byte) after the transpose: the plane axis; add the one head
            return part.transpose(_MLA_TO_BLOCK[self.layout])[:, :, :, None, :]
        return part.transpose(_MHA_TO_BLOCK[self.layout])


# A blob geometry's limits (the daemon's ranges for a Geometry: docs/protocol.md) and the largest host block.
_MAX_HEAD_BYTES = 65536          # head_dim at dtype_bytes 1
_MAX_HEADS = 1024
_MAX_LAYERS = 1024
_MAX_BLOCK_BYTES = 4 << 30


def blob_geometry(nbytes: int) -> Tuple[int, Geometry]:
    """(block bytes, Geometry) of a flexkvd block that holds `nbytes` opaque bytes: one token, one plane (as MLA,
    so the block is not multiplied by TP shards), bytes as 1-byte elements spread over layers and heads, each chunk
    a multiple of 16 bytes. The block is at most nbytes + 16 x layers x heads bytes (the padding, zero). InvalidArgument
    for 0 bytes or more than a 4 GiB block."""
    if nbytes < 1:
        raise InvalidArgument("a host pool page of 0 bytes; expected at least 1")
    max_chunk = _MAX_HEADS * _MAX_HEAD_BYTES
    layers = max(1, -(-nbytes // max_chunk))
    chunk = _round16(-(-nbytes // layers))
    heads = -(-chunk // _MAX_HEAD_BYTES)
    head_bytes = _round16(-(-chunk // heads))
    block = layers * heads * head_bytes
    if layers > _MAX_LAYERS or block > _MAX_BLOCK_BYTES:
        raise InvalidArgument(f"a host pool page of {nbytes} bytes; flexkvd blocks hold at most 4 GiB")
    return block, Geometry(tokens_per_block=1, num_layers=layers, kv_planes=1, kv_heads_per_rank=heads,
                           head_dim=head_bytes, dtype_bytes=1, tp_size=1)


def _round16(n: int) -> int:
    return -(-n // 16) * 16


class FlatPagePool:
    """A host pool seen through SGLang's flat-page calls: page `index` (the host index of its first slot) is the
    `page_bytes` bytes read_page(index) returns, and write_page(index, data) puts such bytes back.

    name: the pool's name in messages. page_size: host slots per page (1 for a Mamba state pool: one state per
    slot). num_slots: the pool's size in slots. The callbacks may be called from several threads at once for
    different pages. Raises InvalidArgument for a page size below 1, an empty pool or a page a block cannot hold.
    """

    def __init__(self, name: str, page_size: int, num_slots: int, page_bytes: int,
                 read_page: Callable[[int], np.ndarray], write_page: Callable[[int, np.ndarray], None]) -> None:
        if page_size < 1:
            raise InvalidArgument(f"host pool {name!r} has page_size {page_size}; expected at least 1")
        if num_slots < page_size:
            raise InvalidArgument(f"host pool {name!r} has {num_slots} slots; expected at least one page of "
                                  f"{page_size}")
        self.name = name
        self.page_size = page_size
        self.num_slots = num_slots
        self.page_bytes = page_bytes
        self.block_bytes, self._geometry = blob_geometry(page_bytes)
        self.block_shape: Tuple[int, ...] = (self.block_bytes,)
        self._read = read_page
        self._write = write_page

    def geometry(self) -> Geometry:
        return self._geometry

    def page_of(self, first_index: int) -> int:
        """The page that starts at host index `first_index` (its own index: SGLang's flat-page calls take it);
        InvalidArgument when it is not a page start inside the pool."""
        if first_index % self.page_size or not 0 <= first_index < self.num_slots:
            raise InvalidArgument(f"host index {first_index} is not the start of a page of {self.page_size} slots "
                                  f"in host pool {self.name!r} of {self.num_slots} slots")
        return first_index

    def copy_to_block(self, page: int, block: np.ndarray) -> None:
        data = np.asarray(self._read(page)).reshape(-1).view(np.uint8)
        if data.size != self.page_bytes:
            raise InvalidArgument(f"host pool {self.name!r} gave a page of {data.size} bytes for index {page}; "
                                  f"its pages are {self.page_bytes}")
        block[:self.page_bytes] = data
        block[self.page_bytes:] = 0

    def copy_from_block(self, block: np.ndarray, page: int) -> None:
        self._write(page, block[:self.page_bytes])
