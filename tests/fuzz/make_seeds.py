#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/). Run from the repo root with
/usr/bin/python3 (needs python3-xxhash and python3-protobuf); the output is committed."""
import os
import struct

import xxhash

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    with open(os.path.join(ROOT, target, name), "wb") as f:
        f.write(data)


def slot_entry(slot, key, parent, content=0x5EED, committed=True):
    """Layout 2: the entry checksum covers the slot index, key, parent and the block's content checksum."""
    lo, hi = key
    plo, phi = parent
    words = struct.pack("<4Q", lo, hi, plo, phi)
    checksum = xxhash.xxh64_intdigest(struct.pack("<Q", slot) + words + struct.pack("<Q", content), seed=0x666C65786B76)
    state = 0x434F4D54 if committed else 0
    return struct.pack("<II", state, 0) + words + struct.pack("<QQ", checksum, content) + b"\0" * 8


def slot_table():
    # Two chains sharing a first block, one orphan, one torn entry (bad checksum), free slots.
    k = lambda i: (0x1000 + i, 0xABC0 + i)
    zero = (0, 0)
    entries = [slot_entry(0, k(1), zero), slot_entry(1, k(2), k(1)), slot_entry(2, k(3), k(2)),
               slot_entry(3, k(4), k(1)), slot_entry(4, k(9), k(8))]
    torn = bytearray(slot_entry(5, k(5), k(4)))
    torn[40] ^= 0xFF
    entries.append(bytes(torn))
    table = b"".join(entries)
    return table + b"\0" * (64 * 64 - len(table))


def pool_file():
    geometry = struct.pack("<7I", 1, 1, 1, 1, 8, 2, 1)
    block, capacity = 16, 64
    table_offset, data_offset = 4096, 2 << 20
    header = b"FLEXKVPL" + struct.pack("<I", 2) + geometry + struct.pack(
        "<5Q", block, capacity, table_offset, data_offset, data_offset + capacity * block)
    header += b"fuzz".ljust(257, b"\0") + b"\0" * 7
    header += struct.pack("<Q", xxhash.xxh64_intdigest(header, seed=0))
    head = header.ljust(4096, b"\0")
    return head + slot_table()


def ring_input(desc, arena, max_blocks=1 << 20, registered=8, gpu_missing=False, handles=(2, 4, 0, 0)):
    """fuzz_ring_descriptor input: header (limits, held handles 1..4) | SubmitDescriptor | arena."""
    header = struct.pack("<IIB4B3x", max_blocks - 1, registered, int(gpu_missing), *handles)
    return header + desc + arena


def submit(opcode, count, keys_offset=0, ids_offset=0, handle=0, flags=0, parent=(0, 0), reserved=0, user_data=1):
    """A SubmitDescriptor (ring layout version 2): parent is a Store's (lo, hi), all zero for the root."""
    return struct.pack("<QHHIQQQ2QQ", user_data, opcode, flags, count, keys_offset, ids_offset, handle, *parent,
                       reserved)


def ring_arena():
    # 4 keys at 0, ids 0..7 at 256, {3, 8} (8: one past 8 registered blocks) at 512; 1 KiB in all.
    keys = b"".join(struct.pack("<QQ", 0x1000 + i, 0xABC0 + i) for i in range(4))
    ids = struct.pack("<8I", *range(8))
    arena = bytearray(1024)
    arena[0:len(keys)] = keys
    arena[256:256 + len(ids)] = ids
    arena[512:520] = struct.pack("<II", 3, 8)
    return bytes(arena)


write("pool_recovery", "table-chains", b"\x01" + slot_table())
write("pool_recovery", "table-empty", b"\x01" + b"\0" * 64)
write("pool_recovery", "file-valid-header", b"\x00" + pool_file())
write("pool_recovery", "file-garbage", b"\x00" + b"FLEXKVPL" + b"\x07" * 64)

try:
    import sys
    sys.path.insert(0, os.environ.get("FLEXKV_PY_GEN", ""))
    from flexkv.v1 import control_pb2  # generated with protoc --python_out (see below)
    g = control_pb2.Geometry(tokens_per_block=16, num_layers=32, kv_planes=2, kv_heads_per_rank=8, head_dim=128,
                             dtype_bytes=2, tp_size=1)
    write("attach_request", "llama", control_pb2.AttachRequest(model_namespace="llama3-8b", protocol_version=1,
                                                               geometry=g).SerializeToString())
    g.kv_planes, g.kv_heads_per_rank, g.head_dim, g.num_layers = 1, 1, 576, 61
    write("attach_request", "mla", control_pb2.AttachRequest(model_namespace="ds", protocol_version=1,
                                                             geometry=g).SerializeToString())
    g.tokens_per_block = 12
    write("attach_request", "bad-tokens", control_pb2.AttachRequest(model_namespace="x", geometry=g).SerializeToString())
except ImportError:
    print("skipping attach_request seeds: set FLEXKV_PY_GEN to a protoc --python_out directory")

write("prefix_index", "mixed", bytes([7]) + bytes(range(1, 250)))
write("prefix_index", "tiny-pool", bytes([0, 3, 1, 5, 3, 2, 5, 1, 1, 5, 4, 3, 0, 1, 4, 5, 0, 0, 2, 0, 0]))
# Room in the window component (data[0] // 32): stores with windows, pinned matches, a restore + verify (op 0 with
# bits 1 and 2 of data[p] // 6), drops (op 2 with the top bit of the third byte), evicting stores.
write("prefix_index", "hybrid-window", bytes([7 + 32 * 3, 3, 1, 3, 3, 2, 5, 1, 1, 3, 18, 5, 3, 4, 3, 2, 2, 1, 0x80, 5, 1, 0,
                                              3, 4, 7, 3, 6, 9, 3, 7, 11, 1, 7, 11, 2, 3, 0x80, 0, 6, 9]) + bytes(range(1, 200)))
# fuzz_ssd_slot_index: byte 0 the geometry (7: 2 drives of 3 slots), one byte per slot at rebuild (0 empty, 1 unusable,
# 2-3 a block: id, generation, parent), then operations of 3 bytes (op % 9: 0-1 reserve, 2 commit/abort, 3 read,
# 4 read end, 5 erase, 6 clear, 7 touch, 8 look up; see the target).
write("ssd_slot_index", "fill-evict", bytes([7] + [0] * 6 + [0, 0, 6, 2, 0, 1, 0, 1, 0, 2, 0, 1, 0, 2, 1, 2, 0, 1,
                                                         0, 3, 0, 2, 0, 1, 0, 4, 6, 2, 0, 1, 0, 5, 4, 2, 0, 1,
                                                         0, 6, 6, 2, 0, 1, 3, 0, 0, 4, 0, 0, 7, 1, 2, 37, 8, 6,
                                                         55, 8, 6, 8, 2, 0, 5, 3, 0, 6, 0, 0, 0, 9, 1, 2, 0, 1]))
# Rebuilt from an id in two slots (newer, then a tie), an unusable header, a block naming itself its parent; reads
# of a block erased under them, the slots cleared, a failed write.
write("ssd_slot_index", "rebuilt", bytes([7, 2, 0, 0, 6, 3, 1, 0, 0, 1, 2, 1, 1, 0, 3, 0, 0, 6, 2, 7, 2, 7,
                                          3, 0, 0, 3, 0, 0, 5, 0, 0, 4, 0, 1, 4, 0, 0, 6, 0, 0, 6, 0, 0, 6, 0, 0,
                                          0, 9, 1, 2, 0, 0, 0, 9, 1, 2, 0, 1, 7, 1, 7, 3, 1, 0, 4, 0, 0, 1, 10, 6]))
write("ssd_slot_index", "mixed", bytes([17]) + bytes((i * 37 + 11) % 256 for i in range(600)))
arena = ring_arena()
write("ring_descriptor", "match-pin", ring_input(submit(1, 4, flags=1), arena))
write("ring_descriptor", "store", ring_input(submit(3, 4, keys_offset=0, ids_offset=256), arena))
write("ring_descriptor", "load", ring_input(submit(2, 2, ids_offset=256, handle=1), arena))
write("ring_descriptor", "load-layerwise-too-many", ring_input(submit(2, 4, ids_offset=256, handle=1, flags=1), arena))
write("ring_descriptor", "release", ring_input(submit(4, 0, handle=2), arena))
write("ring_descriptor", "keys-8-aligned", ring_input(submit(1, 18, keys_offset=8), arena))  # keys need 8, not 16
write("ring_descriptor", "keys-at-arena-end", ring_input(submit(1, 1, keys_offset=1024 - 16), arena))
write("ring_descriptor", "keys-overflow", ring_input(submit(1, 2, keys_offset=(1 << 64) - 16), arena))
write("ring_descriptor", "ids-unaligned", ring_input(submit(3, 1, ids_offset=258), arena))
write("ring_descriptor", "id-past-registered", ring_input(submit(2, 2, ids_offset=512, handle=1), arena))
write("ring_descriptor", "store-unregistered-gpu", ring_input(submit(3, 1, ids_offset=256), arena, registered=0,
                                                               gpu_missing=True))
write("ring_descriptor", "reserved-set", ring_input(submit(1, 1, reserved=7), arena))
write("ring_descriptor", "store-under-parent", ring_input(submit(3, 4, ids_offset=256, parent=(0x2000, 0xABCD)), arena))
write("ring_descriptor", "parent-on-match", ring_input(submit(1, 1, parent=(5, 0)), arena))
write("ring_descriptor", "count-max", ring_input(submit(1, 64, keys_offset=0), arena, max_blocks=64))
print("seeds written under", ROOT)
