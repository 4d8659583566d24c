#!/usr/bin/env python3
"""A Python engine stand-in that tests start as a separate process (the Python twin of flexkv-test-client).

Attaches with the small test geometry, creates host KV buffers in --layout, then runs the --do steps in order,
printing one line per event on stdout (flushed):
  ATTACHED <session_id>
  STORED <already_cached> <stored> <digest,...>         store:SEED:N:FIRST   blocks FIRST.. hold SEED's blocks 0..N-1
  LOADED <hits> <loaded> <equal 0|1> <digest,...>      load:SEED:N:FIRST    match+pin, load into FIRST.., release
  UNTOUCHED <0|1>                                      untouched:FIRST:N    1 when every block outside FIRST..+N is 0
  PINNED <hits> <handle>                               pin:SEED:N           match+pin, never released
  INFLIGHT <count>                                     inflight-store:SEED:COUNT  COUNT 8-block stores, never waited
  HOLDING                                              hold                 sleeps until killed
  ERROR <CODE> <message>
Block contents and tokens of SEED are a pure function of SEED (and the block index), so another process can
check them; a digest is the SHA-256 (12 hex digits) of a block's bytes in canonical [layer][plane][chunk] order.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from typing import List

import numpy as np

import flexkvd

TEST_NAMESPACE = "pytest-model"
# 2 layers, K/V, 2 heads of 64, bf16, 16 tokens per block: 4 KiB chunks, 16 KiB blocks.
TEST_GEOMETRY = flexkvd.Geometry(tokens_per_block=16, num_layers=2, kv_planes=2, kv_heads_per_rank=2, head_dim=64,
                                dtype_bytes=2, tp_size=1)


def tokens(seed: int, blocks: int, geometry: flexkvd.Geometry = TEST_GEOMETRY) -> List[int]:
    """The first `blocks` blocks of SEED's prompt (a prefix of any longer prompt of the same seed)."""
    rng = random.Random(seed)
    return [rng.randrange(128000) for _ in range(blocks * geometry.tokens_per_block)]


def block_content(seed: int, i: int, geometry: flexkvd.Geometry = TEST_GEOMETRY) -> np.ndarray:
    """Block i of SEED as [layer][plane][chunk] bytes."""
    rng = np.random.default_rng([seed, i])
    return rng.integers(0, 256, size=(geometry.num_layers, geometry.kv_planes, geometry.chunk_bytes_per_rank),
                        dtype=np.uint8)


def kv_array(buf: memoryview, layout: flexkvd.Layout, num_blocks: int,
             geometry: flexkvd.Geometry = TEST_GEOMETRY) -> np.ndarray:
    """The host KV buffer as a NumPy array in its layout's axis order."""
    L, P, C = geometry.num_layers, geometry.kv_planes, geometry.chunk_bytes_per_rank
    shape = {flexkvd.Layout.LAYER_FIRST: (L, P, num_blocks, C), flexkvd.Layout.BLOCK_FIRST: (num_blocks, L, P, C),
             flexkvd.Layout.LAYER_BLOCK: (L, num_blocks, P, C),
             # one memfd: the per-layer regions back to back, LAYER_BLOCK's bytes (docs/protocol.md, "KV layouts")
             flexkvd.Layout.LAYER_BLOCK_REGIONS: (L, num_blocks, P, C)}[layout]
    return np.frombuffer(buf, dtype=np.uint8).reshape(shape)


def block_view(kv: np.ndarray, layout: flexkvd.Layout, b: int) -> np.ndarray:
    """Block b of a KV array as a [layer][plane][chunk] view (writable)."""
    if layout == flexkvd.Layout.LAYER_FIRST:
        return kv[:, :, b, :]
    if layout == flexkvd.Layout.BLOCK_FIRST:
        return kv[b]
    return kv[:, b, :, :]


def digest(block: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(block).tobytes()).hexdigest()[:12]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--name", default="py-engine")
    ap.add_argument("--layout", default="BLOCK_FIRST", choices=[l.name for l in flexkvd.Layout])
    ap.add_argument("--kv-blocks", type=int, default=128)
    ap.add_argument("--do", action="append", default=[])
    args = ap.parse_args()
    layout = flexkvd.Layout[args.layout]

    def say(*words: object) -> None:
        print(*words, flush=True)

    try:
        client = flexkvd.connect(args.socket)
        session = client.attach(args.name, TEST_NAMESPACE, TEST_GEOMETRY)
        kv = kv_array(client.create_host_kv(layout, args.kv_blocks), layout, args.kv_blocks)
        kv[...] = 0  # fresh memfd pages are zero already; say so explicitly
        say("ATTACHED", session)
        kept = []  # tickets and handles a killed process still holds
        for step in args.do:
            op, *nums = step.split(":")
            n = [int(x) for x in nums]
            if op == "store":
                seed, count, first = n
                for i in range(count):
                    block_view(kv, layout, first + i)[...] = block_content(seed, i)
                keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(seed, count), TEST_GEOMETRY.tokens_per_block)
                r = client.store(keys, range(first, first + count)).wait(30)
                say("STORED", r.matched_blocks, r.done_blocks,
                    ",".join(digest(block_view(kv, layout, first + i)) for i in range(count)))
            elif op == "load":
                seed, count, first = n
                keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(seed, count), TEST_GEOMETRY.tokens_per_block)
                hit = client.match(keys, pin=True).wait(30)
                loaded, equal, digests = 0, 1, []
                if hit.matched_blocks:
                    loaded = client.load(hit.match_handle, range(first, first + hit.matched_blocks)).wait(30).done_blocks
                    client.release(hit.match_handle).wait(30)
                    for i in range(hit.matched_blocks):
                        got = block_view(kv, layout, first + i)
                        equal &= int(np.array_equal(got, block_content(seed, i)))
                        digests.append(digest(got))
                say("LOADED", hit.matched_blocks, loaded, equal, ",".join(digests) or "-")
            elif op == "untouched":
                first, count = n
                mask = np.ones(args.kv_blocks, dtype=bool)
                mask[first:first + count] = False
                say("UNTOUCHED", int(all(not block_view(kv, layout, b).any() for b in np.nonzero(mask)[0])))
            elif op == "pin":
                seed, count = n
                keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(seed, count), TEST_GEOMETRY.tokens_per_block)
                hit = client.match(keys, pin=True).wait(30)
                kept.append(hit.match_handle)
                say("PINNED", hit.matched_blocks, hit.match_handle)
            elif op == "inflight-store":
                seed, count = n
                for j in range(count):
                    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(seed + j, 8), TEST_GEOMETRY.tokens_per_block)
                    kept.append(client.store(keys, range(8 * (j % (args.kv_blocks // 8)),
                                                          8 * (j % (args.kv_blocks // 8)) + 8)))
                say("INFLIGHT", count)
            elif op == "hold":
                say("HOLDING")
                while True:
                    time.sleep(3600)
            else:
                raise SystemExit(f"unknown step {step!r}")
        del kv
        client.close()
        return 0
    except flexkvd.Error as e:
        say("ERROR", e.code.name, e.message)
        return 3


if __name__ == "__main__":
    sys.exit(main())
