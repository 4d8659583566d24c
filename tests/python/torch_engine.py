#!/usr/bin/env python3
"""A PyTorch engine process for the GPU tests: a vLLM-shaped KV cache on the GPU, one tensor per layer of
[2, num_blocks, block_size, num_kv_heads, head_dim] bf16 (LAYER_FIRST), allocated by torch's allocator, so
PYTORCH_CUDA_ALLOC_CONF decides whether it is cudaMalloc memory (the default caching allocator) or cuMem/VMM
memory (expandable_segments:True).

  --role store: fills the layers with bytes that are a function of --seed, stores blocks 0..N-1
  --role load:  zeroes its layers, matches SEED's prompt, loads it into blocks FIRST..FIRST+N-1 (layer-wise),
                compares them with SEED's bytes, and checks that no other block was written
Prints one JSON line: {"role", "vmm", "hits", "done", "equal", "untouched", "gbps", "seconds", "uuid"} or
{"error": "..."}.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import time

import torch

import flexkvd

NAMESPACE = "torch-engine"


def geometry(args: argparse.Namespace) -> flexkvd.Geometry:
    return flexkvd.Geometry(tokens_per_block=args.block_size, num_layers=args.layers, kv_planes=2,
                           kv_heads_per_rank=args.heads, head_dim=args.head_dim, dtype_bytes=2, tp_size=1)


def seeded_layer(seed: int, layer: int, shape: tuple) -> torch.Tensor:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed * 1000 + layer)
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * 2,), dtype=torch.uint8, device="cuda", generator=g)
    return raw.view(torch.bfloat16).view(shape)


def is_vmm(ptr: int) -> bool:
    """True when ptr lies in cuMem/VMM memory (cuMemRetainAllocationHandle succeeds only there)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_ulonglong(0)
    if cuda.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)) != 0:
        return False
    cuda.cuMemRelease(handle)
    return True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--role", choices=["store", "load"], required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--blocks", type=int, default=256, help="blocks of the prompt to store / load")
    p.add_argument("--first", type=int, default=0, help="load: first destination block")
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    g = geometry(args)
    shape = (2, args.kv_blocks, args.block_size, args.heads, args.head_dim)
    # Something allocated first, so the KV tensors do not start at an allocation's first byte.
    _spacer = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    layers = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
    rng = random.Random(args.seed)
    tokens = [rng.randrange(128000) for _ in range(args.blocks * args.block_size)]
    keys = flexkvd.block_keys(NAMESPACE, tokens, args.block_size)
    out = {"role": args.role, "vmm": is_vmm(layers[0].data_ptr())}
    try:
        with flexkvd.connect(args.socket) as client:
            client.attach(f"torch-{args.role}", NAMESPACE, g)
            out["uuid"] = client.register_gpu_kv(layers, flexkvd.Layout.LAYER_FIRST, args.kv_blocks)
            n = args.blocks
            nbytes = n * g.host_block_bytes
            if args.role == "store":
                for i, layer in enumerate(layers):
                    layer.copy_(seeded_layer(args.seed, i, shape))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = client.store(keys, list(range(n))).wait(60)
                dt = time.perf_counter() - t0
                out.update(hits=r.matched_blocks, done=r.done_blocks, seconds=dt, gbps=nbytes / dt / 1e9)
            else:
                t0 = time.perf_counter()
                m = client.match(keys, pin=True).wait(10)
                ticket = client.load(m.match_handle, list(range(args.first, args.first + m.matched_blocks)),
                                     layerwise=True)
                r = ticket.wait(60)
                dt = time.perf_counter() - t0
                client.release(m.match_handle).wait(10)
                torch.cuda.synchronize()
                equal, untouched = True, True
                dst = slice(args.first, args.first + m.matched_blocks)
                for i, layer in enumerate(layers):
                    want = seeded_layer(args.seed, i, shape)[:, :m.matched_blocks]
                    equal &= bool(torch.equal(layer[:, dst].view(torch.int16), want.view(torch.int16)))
                    rest = layer.clone()
                    rest[:, dst] = 0
                    untouched &= bool(torch.count_nonzero(rest.view(torch.int16)).item() == 0)
                out.update(hits=m.matched_blocks, done=r.done_blocks, equal=equal, untouched=untouched, seconds=dt,
                           gbps=m.matched_blocks * g.host_block_bytes / dt / 1e9)
    except flexkvd.Error as e:
        out["error"] = f"{e.code.name}: {e.message}"
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
