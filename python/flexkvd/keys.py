"""Block keys: 128-bit chained hashes naming a block of tokens together with every token before it.

Computed by libflexkv (flexkv_compute_block_keys), so they are the C++ client's keys bit for bit; the
construction and test vectors are in docs/protocol.md ("Block keys").
"""
from __future__ import annotations

import ctypes
import hashlib
from typing import Any, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union, overload

from . import _lib, _native
from ._convert import U64_MAX, c_int_array, c_uint
from .errors import InvalidArgument

_KEY_BYTES = ctypes.sizeof(_lib.BlockKeyStruct)
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


class BlockKey(NamedTuple):
    """One block key: the two 64-bit halves of XXH3-128 (flexkv::BlockKey)."""

    lo: int
    hi: int

    def hex(self) -> str:
        """32 lowercase hex digits, high half first (BlockKey::ToHex, XXH128's canonical form)."""
        return f"{self.hi:016x}{self.lo:016x}"

    @classmethod
    def fromhex(cls, text: str) -> "BlockKey":
        """The key whose hex() is `text`."""
        if len(text) != 32 or any(c not in _HEX_DIGITS for c in text):
            raise InvalidArgument(f"block key {text!r} is not 32 hex digits")
        return cls(lo=int(text[16:], 16), hi=int(text[:16], 16))


class BlockKeys(Sequence[BlockKey]):
    """An immutable sequence of BlockKey stored as one C array of {lo, hi} pairs, and the key its first one hangs
    under (`parent`; None when it is a prompt's first block, the root).

    This is what Client.match and Client.store take: the array is passed to libflexkv as it is, without a copy.
    Indexing gives a BlockKey; slicing gives a BlockKeys (a view sharing the array for step 1, a copy otherwise).
    A step-1 slice knows its parent: keys[20:30].parent == keys[19], and keys[0:k].parent == keys.parent; so
    store(keys[20:30], ids) stores the blocks where a match of the whole prompt reaches them. A slice with another
    step is not a run of a prompt: its parent is None. Equal to any sequence of the same keys (the parent is not
    compared).
    """

    __slots__ = ("_array", "_parent")

    def __init__(self, keys: Iterable[Union[BlockKey, Tuple[int, int]]] = (),
                 parent: Optional[Union[BlockKey, Tuple[int, int]]] = None) -> None:
        """parent: the key of the block before keys[0] in its prompt, or None (keys start a prompt).
        InvalidArgument for a half outside 0..2**64-1 (which a uint64 would wrap), naming the key."""
        items = list(keys)
        arr = (_lib.BlockKeyStruct * len(items))()
        for i, key in enumerate(items):
            lo, hi = key
            arr[i].lo = c_uint(lo, f"block key {i}: lo", U64_MAX)
            arr[i].hi = c_uint(hi, f"block key {i}: hi", U64_MAX)
        self._array = arr
        self._parent = None
        if parent is not None:
            lo, hi = parent
            self._parent = BlockKey(c_uint(lo, "parent: lo", U64_MAX), c_uint(hi, "parent: hi", U64_MAX))

    @classmethod
    def _wrap(cls, arr: ctypes.Array, parent: Optional[BlockKey] = None) -> "BlockKeys":
        keys = cls.__new__(cls)
        keys._array = arr
        keys._parent = parent
        return keys

    @property
    def parent(self) -> Optional[BlockKey]:
        """The key the first key hangs under: the key before this slice in its prompt, None for a prompt's start."""
        return self._parent

    def __len__(self) -> int:
        return len(self._array)

    @overload
    def __getitem__(self, index: int) -> BlockKey: ...

    @overload
    def __getitem__(self, index: slice) -> "BlockKeys": ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self._array))
            if step == 1:
                n = max(0, stop - start)
                parent = self[start - 1] if start > 0 else self._parent
                return BlockKeys._wrap((_lib.BlockKeyStruct * n).from_buffer(self._array, start * _KEY_BYTES), parent)
            return BlockKeys(self[i] for i in range(start, stop, step))
        k = self._array[index]  # IndexError past either end
        return BlockKey(k.lo, k.hi)

    def __iter__(self) -> Iterator[BlockKey]:
        for k in self._array:
            yield BlockKey(k.lo, k.hi)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockKeys):
            return len(self) == len(other) and bytes(self._array) == bytes(other._array)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return list(self) == [tuple(k) for k in other]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (mutable buffer underneath; compare, do not hash)

    def __repr__(self) -> str:
        shown = ", ".join(k.hex() for k in list(self[:3]))
        more = f", ... ({len(self)} keys)" if len(self) > 3 else ""
        parent = f", parent={self._parent.hex()}" if self._parent is not None else ""
        return f"BlockKeys([{shown}{more}]{parent})"

    def hex(self) -> list:
        """The keys' hex forms, in order."""
        return [k.hex() for k in self]


def as_block_keys(keys: Union[BlockKeys, Iterable[Any]]) -> BlockKeys:
    """`keys` as BlockKeys (a BlockKeys is returned as is; any other sequence of (lo, hi) pairs is copied, as keys
    that start a prompt: parent None)."""
    return keys if isinstance(keys, BlockKeys) else BlockKeys(keys)


def block_keys(namespace: Union[str, bytes], tokens: Any, tokens_per_block: int,
               extras: Optional[Sequence[bytes]] = None) -> BlockKeys:
    """The keys of the whole blocks of `tokens` under `namespace` (flexkv::ComputeBlockKeys).

    namespace: the model namespace (str, encoded as UTF-8, or bytes); the empty namespace is valid.
    tokens: token ids as any 1-D sequence of ints or buffer of integers (a NumPy array of any integer dtype
      works, NumPy is not needed otherwise); each must fit int32.
    tokens_per_block: > 0. A trailing partial block gets no key, so len(result) == len(tokens) // tokens_per_block.

    extras: what changes a block's KV besides its tokens, one 16-byte digest per block (block_extras() makes them;
      16 zero bytes: none; blocks past the list have none). A block with an extra gets another key, and so does
      every block after it (flexkv::BlockExtra).

    Raises InvalidArgument for tokens_per_block == 0, a token out of int32 or an extra that is not 16 bytes,
    TypeError for non-integers. Needs no daemon.
    """
    tokens_per_block = c_uint(tokens_per_block, "tokens_per_block")  # 0 is refused by libflexkv, naming it
    ns = namespace.encode("utf-8") if isinstance(namespace, str) else bytes(namespace)
    if extras is not None and any(extras):
        return _block_keys_extra(ns, tokens, tokens_per_block, extras)
    ext = _native.ext
    if ext is not None:  # reads a list or buffer in C; None for what only the ctypes path below reads (or refuses)
        raw = ext.block_keys(ns, tokens, tokens_per_block)
        if raw is not None:
            return BlockKeys._wrap((_lib.BlockKeyStruct * (len(raw) // _KEY_BYTES)).from_buffer(raw))
    toks, n = c_int_array(tokens, ctypes.c_int32, "tokens")
    capacity = n // tokens_per_block if tokens_per_block else 0
    out = (_lib.BlockKeyStruct * capacity)()
    count = ctypes.c_size_t(0)
    rc = _lib.lib.flexkv_compute_block_keys(ns, len(ns), toks, n, tokens_per_block, out, capacity,
                                            ctypes.byref(count))
    if rc != 0:
        _lib.check(rc)
    assert count.value == capacity, (count.value, capacity)
    return BlockKeys._wrap(out)



def namespace_hash(namespace: Union[str, bytes]) -> int:
    """XXH3-64 of the model namespace (flexkv::NamespaceHash): the seed of its block keys, and what names a domain the
    daemon knows only by this hash in KV events ("#" + 16 lowercase hex digits: an SSD block whose namespace has not
    been attached since the daemon started). Needs no daemon."""
    if not _lib.has_namespace_hash:
        from .errors import Unimplemented
        raise Unimplemented("this libflexkv has no flexkv_namespace_hash; update it")
    ns = namespace.encode("utf-8") if isinstance(namespace, str) else bytes(namespace)
    return int(_lib.lib.flexkv_namespace_hash(ns, len(ns)))


_NO_EXTRA = bytes(16)


def _block_keys_extra(ns: bytes, tokens: Any, tokens_per_block: int, extras: Sequence[bytes]) -> BlockKeys:
    """block_keys with per-block extras (flexkv_compute_block_keys_extra)."""
    packed = bytearray()
    for i, extra in enumerate(extras):
        extra = _NO_EXTRA if extra is None else bytes(extra)
        if len(extra) != 16:
            raise InvalidArgument(f"extras[{i}] has {len(extra)} bytes; expected a 16-byte digest (or None)")
        packed += extra
    toks, n = c_int_array(tokens, ctypes.c_int32, "tokens")
    capacity = n // tokens_per_block if tokens_per_block else 0
    out = (_lib.BlockKeyStruct * capacity)()
    count = ctypes.c_size_t(0)
    rc = _lib.lib.flexkv_compute_block_keys_extra(ns, len(ns), toks, n, tokens_per_block, bytes(packed),
                                                  len(packed) // 16, out, capacity, ctypes.byref(count))
    if rc != 0:
        _lib.check(rc)
    assert count.value == capacity, (count.value, capacity)
    return BlockKeys._wrap(out)


class BlockExtras:
    """What changes a request's KV besides its token ids, as block_keys' per-block extras: one function for every
    engine integration, so that two requests that differ only in it never share a block.

    cache_salt: a tenant's isolation of the prefix cache (vLLM's `cache_salt`; str or bytes).
    adapter: the LoRA adapter the request runs with (its name; str or bytes).
    media: (identifier, offset, length) of each multimodal item: its content hash (vLLM's mm hash) and the token
      range its placeholders cover; every block overlapping the range carries (identifier, offset within the
      block), so that the same media at another position, or other media under the same placeholders, differ.
    embeds: for prompt embeddings (whose token ids an engine fills with zeros), `embeds(start, end)` returns the
      bytes of the embeddings of tokens [start, end); embeds_tokens is how many tokens have them. Each block in that
      range carries a hash of its embeddings' bytes.

    The salt and the adapter go into the first block's extra: through the chain, every later key differs too.
    Blocks with nothing of this keep their plain keys (for_blocks answers None when no block has an extra).
    Digests are BLAKE2b-128 over a tagged encoding; computed once per block and kept.
    """

    def __init__(self, tokens_per_block: int, *, cache_salt: Union[str, bytes, None] = None,
                 adapter: Union[str, bytes, None] = None, media: Iterable[Tuple[Any, int, int]] = (),
                 embeds: Optional[Any] = None, embeds_tokens: int = 0) -> None:
        if tokens_per_block <= 0:
            raise InvalidArgument(f"tokens_per_block is {tokens_per_block}; expected > 0")
        self.tokens_per_block = tokens_per_block
        self._head = b"".join(_tagged(tag, value) for tag, value in (("salt", cache_salt), ("adapter", adapter))
                              if value is not None)
        self._media = sorted((int(offset), int(length), _as_bytes(ident)) for ident, offset, length in media)
        for offset, length, _ in self._media:
            if offset < 0 or length <= 0:
                raise InvalidArgument(f"media at offset {offset} with {length} tokens; expected offset >= 0, "
                                      "length > 0")
        self._embeds = embeds
        self._embeds_tokens = int(embeds_tokens) if embeds is not None else 0
        self._digests: List[Optional[bytes]] = []

    @property
    def empty(self) -> bool:
        """Whether no block has an extra (plain keys)."""
        return not self._head and not self._media and self._embeds_tokens == 0

    def for_blocks(self, n: int) -> Optional[List[bytes]]:
        """The extras of blocks [0, n) for block_keys, or None when none of them has one."""
        if self.empty:
            return None
        while len(self._digests) < n:
            self._digests.append(self._digest(len(self._digests)))
        out = [d if d is not None else _NO_EXTRA for d in self._digests[:n]]
        return out if any(d is not None for d in self._digests[:n]) else None

    def _digest(self, block: int) -> Optional[bytes]:
        start = block * self.tokens_per_block
        end = start + self.tokens_per_block
        parts = [self._head] if block == 0 and self._head else []
        for offset, length, ident in self._media:
            if offset < end and start < offset + length:
                parts.append(_tagged("media", ident + (offset - start).to_bytes(8, "little", signed=True)))
        if start < self._embeds_tokens:
            raw = self._embeds(start, min(end, self._embeds_tokens))
            parts.append(_tagged("embeds", hashlib.blake2b(bytes(raw), digest_size=32).digest()))
        if not parts:
            return None
        return hashlib.blake2b(b"".join(parts), digest_size=16, person=b"flexkv-extra").digest()


def _as_bytes(value: Union[str, bytes, Any]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return str(value).encode("utf-8")


def _tagged(tag: str, value: Union[str, bytes, Any]) -> bytes:
    raw = _as_bytes(value)
    return tag.encode("ascii") + b"\0" + len(raw).to_bytes(8, "little") + raw
