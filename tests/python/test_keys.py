"""flexkvd.block_keys, BlockKey, BlockKeys (python/flexkvd/keys.py): the docs/protocol.md vectors from Python."""
from __future__ import annotations

import array
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import flexkvd
from conftest import REPO


def parse_tokens(spec: str) -> list:
    out = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", part)
        out.extend(range(int(m.group(1)), int(m.group(2)) + 1) if m else [int(part)])
    return out


def protocol_vectors() -> list:
    """(namespace, tokens_per_block, tokens, [hex keys]) of docs/protocol.md, "### Test vectors"."""
    with open(os.path.join(REPO, "docs", "protocol.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("### Test vectors", 1)[1]
    vectors = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            keys = [k.strip("` ") for k in cells[4].split("<br>")]
            vectors.append((cells[1].strip("`"), int(cells[2]), parse_tokens(cells[3].strip("`")), keys))
    return vectors


VECTORS = protocol_vectors()


def test_protocol_md_has_the_six_vectors():
    assert len(VECTORS) == 6


@pytest.mark.parametrize("namespace,tpb,tokens,expected", VECTORS, ids=[f"vector{i + 1}" for i in range(len(VECTORS))])
def test_keys_equal_the_protocol_vectors(namespace, tpb, tokens, expected):
    keys = flexkvd.block_keys(namespace, tokens, tpb)
    assert [k.hex() for k in keys] == expected
    assert keys.hex() == expected
    # The same keys from every accepted token container.
    assert flexkvd.block_keys(namespace, tuple(tokens), tpb) == keys
    assert flexkvd.block_keys(namespace, array.array("i", tokens), tpb) == keys
    assert flexkvd.block_keys(namespace, array.array("q", tokens), tpb) == keys
    for dtype in (np.int32, np.int64):
        assert flexkvd.block_keys(namespace, np.array(tokens, dtype=dtype), tpb) == keys
    assert flexkvd.block_keys(namespace.encode(), tokens, tpb) == keys
    big_endian = np.array(tokens, dtype=">i4")
    assert flexkvd.block_keys(namespace, big_endian, tpb) == keys
    strided = np.zeros(2 * len(tokens), dtype=np.int32)
    strided[::2] = tokens
    assert flexkvd.block_keys(namespace, strided[::2], tpb) == keys


def test_small_unsigned_and_range_inputs():
    ref = flexkvd.block_keys("tiny", [7, 7, 7], 1)
    assert flexkvd.block_keys("tiny", np.array([7, 7, 7], dtype=np.uint8), 1) == ref
    assert flexkvd.block_keys("tiny", bytes([7, 7, 7]), 1) == ref
    assert flexkvd.block_keys("llama3-8b", range(64), 16) == flexkvd.block_keys("llama3-8b", list(range(64)), 16)
    assert flexkvd.block_keys("llama3-8b", (t for t in range(64)), 16).hex()[0] == "153b1826ef42db47b22612177ef37a7d"


def test_partial_block_and_empty_inputs():
    assert len(flexkvd.block_keys("ns", range(31), 16)) == 1
    assert len(flexkvd.block_keys("ns", [], 16)) == 0
    assert len(flexkvd.block_keys("", range(16), 16)) == 1  # the empty namespace is valid


def test_bad_inputs_raise_with_the_reason():
    with pytest.raises(flexkvd.InvalidArgument, match="tokens_per_block is 0"):
        flexkvd.block_keys("ns", range(16), 0)
    with pytest.raises(flexkvd.InvalidArgument, match="2147483648"):
        flexkvd.block_keys("ns", [2**31], 1)
    with pytest.raises(flexkvd.InvalidArgument, match="2147483648"):
        flexkvd.block_keys("ns", np.array([2**31], dtype=np.int64), 1)
    with pytest.raises(flexkvd.InvalidArgument, match="2-D"):
        flexkvd.block_keys("ns", np.zeros((2, 16), dtype=np.int32), 16)
    with pytest.raises(TypeError):
        flexkvd.block_keys("ns", [1.5] * 16, 16)
    with pytest.raises(TypeError):
        flexkvd.block_keys("ns", np.zeros(16, dtype=np.float32), 16)
    with pytest.raises(flexkvd.InvalidArgument):
        flexkvd.block_keys("ns", range(16), -1)


def test_block_keys_is_a_compact_sequence():
    keys = flexkvd.block_keys("llama3-8b", range(64), 16)
    assert len(keys) == 4
    assert keys[0] == flexkvd.BlockKey.fromhex("153b1826ef42db47b22612177ef37a7d")
    assert keys[0].hi == 0x153b1826ef42db47 and keys[0].lo == 0xb22612177ef37a7d
    assert keys[-1].hex() == "bfd1c2a0c9e67aaad0ad930d82d99092"
    head = keys[1:3]
    assert isinstance(head, flexkvd.BlockKeys) and head.hex() == keys.hex()[1:3]
    assert keys[::2].hex() == [keys.hex()[0], keys.hex()[2]]
    assert isinstance(keys[5:], flexkvd.BlockKeys) and len(keys[5:]) == 0
    assert list(keys) == [keys[i] for i in range(4)]
    assert keys == list(keys) and keys == flexkvd.BlockKeys(list(keys))
    assert flexkvd.BlockKeys((k.lo, k.hi) for k in keys) == keys
    assert keys != flexkvd.block_keys("llama3-8b", range(1, 65), 16)
    with pytest.raises(IndexError):
        keys[4]
    with pytest.raises(IndexError):
        keys[-5]
    assert "153b1826ef42db47b22612177ef37a7d" in repr(keys)


def test_a_slice_knows_the_key_it_hangs_under():
    keys = flexkvd.block_keys("llama3-8b", range(30 * 16), 16)
    assert keys.parent is None  # a prompt's keys start at the root
    assert keys[20:30].parent == keys[19]
    assert keys[20:].parent == keys[19] and keys[-10:].parent == keys[19]
    assert keys[0:20].parent is None and keys[:0].parent is None
    assert keys[20:30][3:].parent == keys[22]  # a slice of a slice: the key before it in the prompt
    assert keys[20:30][:4].parent == keys[19]  # starting where its source starts: the source's parent
    assert keys[30:].parent == keys[29]
    assert keys[0:30:2].parent is None  # not a run of the prompt
    explicit = flexkvd.BlockKeys(list(keys[20:30]), parent=keys[19])
    assert explicit.parent == keys[19] and explicit == keys[20:30]
    assert flexkvd.BlockKeys(list(keys[20:30]), parent=(keys[19].lo, keys[19].hi)).parent == keys[19]
    assert keys[20:30] == list(keys)[20:30]  # equality ignores the parent
    assert keys[19].hex() in repr(keys[20:30])
    with pytest.raises(flexkvd.InvalidArgument, match="parent: hi is 18446744073709551616"):
        flexkvd.BlockKeys([], parent=(0, 2**64))


def test_the_package_does_not_need_numpy():
    """block_keys works (same keys) in an interpreter where NumPy cannot be imported, and never imports it."""
    code = ("import sys; sys.modules['numpy'] = None\n"
            "import flexkvd\n"
            "print(flexkvd.block_keys('llama3-8b', range(64), 16).hex()[3])\n"
            "import array; print(flexkvd.block_keys('tiny', array.array('l', [7, 7, 7]), 1).hex()[2])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["bfd1c2a0c9e67aaad0ad930d82d99092", "760eb60aa59c9dcdf27179800cd81f30"]


def test_key_halves_out_of_uint64_are_refused():
    with pytest.raises(flexkvd.InvalidArgument) as e:
        flexkvd.BlockKeys([(-1, 0)])  # a uint64 would hold it as 2**64 - 1
    assert e.value.message == "block key 0: lo is -1; expected an integer in 0..18446744073709551615"
    with pytest.raises(flexkvd.InvalidArgument, match="block key 2: hi is 18446744073709551616"):
        flexkvd.BlockKeys([(0, 0), (1, 1), (0, 2**64)])
    with pytest.raises(TypeError):
        flexkvd.BlockKeys([(0.5, 0)])
    top = flexkvd.BlockKeys([(2**64 - 1, 2**64 - 1)])
    assert top[0] == flexkvd.BlockKey(2**64 - 1, 2**64 - 1) and top.hex() == ["f" * 32]
    with pytest.raises(flexkvd.InvalidArgument, match="32 hex digits"):
        flexkvd.BlockKey.fromhex("-" + "0" * 31)  # int() would take the sign
    with pytest.raises(flexkvd.InvalidArgument, match="tokens_per_block is -1"):
        flexkvd.block_keys("ns", [1, 2], -1)


def test_namespace_hash_is_xxh3_64_of_the_namespace():
    """flexkvd.keys.namespace_hash: the keys' seed, and the '#<16 hex digits>' name KV events give a namespace the
    daemon knows only by its hash (docs/kv_events.md)."""
    from flexkvd.keys import namespace_hash
    assert namespace_hash("") == 0x2D06800538D394C2  # XXH3-64 of no bytes (xxHash's published value)
    assert namespace_hash("llama3-8b") == namespace_hash(b"llama3-8b")
    assert namespace_hash("llama3-8b") != namespace_hash("llama3-8c")


# ---- what changes KV besides token ids (issue 31): BlockExtras ----

TOKENS = list(range(1000, 1000 + 8 * 16))  # 8 blocks of 16


def keys_with(**kwargs):
    extras = flexkvd.BlockExtras(16, **kwargs)
    return list(flexkvd.block_keys("ns", TOKENS, 16, extras.for_blocks(8)))


def test_no_extra_keeps_the_plain_keys():
    plain = list(flexkvd.block_keys("ns", TOKENS, 16))
    assert keys_with() == plain
    assert flexkvd.BlockExtras(16).for_blocks(8) is None
    assert list(flexkvd.block_keys("ns", TOKENS, 16, [bytes(16)] * 8)) == plain  # all-zero extras: none


def test_two_requests_that_differ_only_in_salt_adapter_media_or_embeddings_share_no_block():
    plain = set(flexkvd.block_keys("ns", TOKENS, 16))
    zeros = [0] * len(TOKENS)  # what an engine puts for prompt embeddings
    embeds_a = np.arange(len(TOKENS) * 4, dtype=np.float32).reshape(len(TOKENS), 4)
    embeds_b = embeds_a.copy()
    embeds_b[100, 2] += 1.0  # one value in block 6
    variants = {
        "salt a": keys_with(cache_salt="tenant-a"),
        "salt b": keys_with(cache_salt="tenant-b"),
        "adapter a": keys_with(adapter="sql-lora"),
        "adapter b": keys_with(adapter="chat-lora"),
        "salt a + adapter a": keys_with(cache_salt="tenant-a", adapter="sql-lora"),
        "image x": keys_with(media=[("hash-x", 0, 40)]),
        "image y": keys_with(media=[("hash-y", 0, 40)]),
    }
    for name, keys in variants.items():
        assert not set(keys) & plain, name
    names = list(variants)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not set(variants[a]) & set(variants[b]), (a, b)
    # Prompt embeddings: token ids all zero; blocks differ from the first whose embeddings differ.
    ea = list(flexkvd.block_keys("ns", zeros, 16, flexkvd.BlockExtras(
        16, embeds=lambda s, e: embeds_a[s:e].tobytes(), embeds_tokens=len(TOKENS)).for_blocks(8)))
    eb = list(flexkvd.block_keys("ns", zeros, 16, flexkvd.BlockExtras(
        16, embeds=lambda s, e: embeds_b[s:e].tobytes(), embeds_tokens=len(TOKENS)).for_blocks(8)))
    assert ea[:6] == eb[:6] and not set(ea[6:]) & set(eb[6:])
    assert not set(ea) & set(flexkvd.block_keys("ns", zeros, 16))  # never the keys of a prompt of zeros


def test_media_changes_the_blocks_it_covers_and_every_later_one_only():
    plain = list(flexkvd.block_keys("ns", TOKENS, 16))
    # Placeholders over tokens 40..71: blocks 2, 3 and 4; blocks 0 and 1 keep their keys (a shared text prefix).
    keys = keys_with(media=[("img", 40, 32)])
    assert keys[:2] == plain[:2]
    assert all(k != p for k, p in zip(keys[2:], plain[2:]))
    # The same image at another position is another prompt.
    assert keys_with(media=[("img", 48, 32)])[2:] != keys[2:]


def test_bad_extras_are_refused_with_the_reason():
    with pytest.raises(flexkvd.InvalidArgument, match="extras\\[1\\] has 3 bytes"):
        flexkvd.block_keys("ns", TOKENS, 16, [bytes(16), b"abc"])
    with pytest.raises(flexkvd.InvalidArgument, match="tokens_per_block is 0"):
        flexkvd.BlockExtras(0)
    with pytest.raises(flexkvd.InvalidArgument, match="length > 0"):
        flexkvd.BlockExtras(16, media=[("img", 10, 0)])
