#!/usr/bin/env python3
"""An engine that behaves like one data-parallel rank of vLLM, using flexkvd as its node-wide prefix cache.

It allocates its paged KV cache the way vLLM does: one tensor per layer, [2, num_blocks, block_size, num_kv_heads,
head_dim] (K and V planes; flexkv's LAYER_FIRST layout), with torch on the GPU when torch and CUDA are present,
and registers them with Client.register_gpu_kv. With --host (or without a GPU) the KV cache lives in host memory
shared with the daemon (Client.create_host_kv), viewed through NumPy in the same shape.

Then it serves a few chat requests with shared prefixes (one system prompt, several users, several turns each):
  before prefill: match the prompt's block keys (pinned), load the cached prefix into freshly allocated KV blocks;
  "prefill":      write the KV of the remaining blocks (a deterministic function of each block's key, standing in
                  for the model, so that any rank can check bytes it loads);
  after prefill:  store the prompt's blocks, so this and every other rank on the node can skip them next time.
Every loaded block is checked byte for byte. It prints per request what was cached, the effective GB/s of each load
and store, and a summary with the tokens saved; the last line is `summary: {json}`.

Run two ranks one after the other against the same daemon and the second finds everything the first stored:
  build/flexkvd --socket /tmp/fkv.sock --pool-path /dev/shm/fkv/pool --pool-size 4GiB &
  FLEXKV_SOCKET=/tmp/fkv.sock python3 examples/vllm_dp_rank.py --dp-rank 0
  FLEXKV_SOCKET=/tmp/fkv.sock python3 examples/vllm_dp_rank.py --dp-rank 1
(PYTHONPATH=python and FLEXKV_LIBRARY=build/libflexkv.so.0 in a build tree.)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any, List, Optional, Tuple

import flexkvd


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="flexkvd socket (default: $FLEXKV_SOCKET, else the default)")
    ap.add_argument("--host", action="store_true", help="KV cache in host memory (create_host_kv), not on the GPU")
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--namespace", default="llama3-8b-example")
    ap.add_argument("--layers", type=int, default=32, help="default: Llama-3-8B's shape")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of this rank's cache")
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=512, help="system prompt shared by every request")
    ap.add_argument("--turn-tokens", type=int, default=192, help="tokens each turn adds to a user's conversation")
    ap.add_argument("--layerwise", action="store_true", help="layer-wise loads: report when layer 0 is usable")
    ap.add_argument("--layer-events", action="store_true",
                    help="GPU: layer-wise loads whose layers the compute stream waits on (CUDA events recorded by "
                         "flexkvd, no CPU wake-up between layers); verification then reads after those waits")
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args(argv)


class KvCache:
    """The rank's paged KV cache: per layer a [2, num_blocks, block_size, heads, head_dim] bf16 tensor, seen here as
    int16 [2, num_blocks, chunk_elems] so that KV bytes can be written and compared exactly (no NaN semantics)."""

    def __init__(self, args: argparse.Namespace, client: flexkvd.Client, geometry: flexkvd.Geometry) -> None:
        self.num_blocks = args.num_blocks
        self.chunk_elems = args.block_size * args.kv_heads * args.head_dim
        shape = (2, args.num_blocks, args.block_size, args.kv_heads, args.head_dim)
        self.torch = None
        if not args.host:
            try:
                import torch
                if torch.cuda.is_available():
                    self.torch = torch
            except ImportError:
                pass
        if self.torch is not None:
            torch = self.torch
            self.device = torch.device("cuda", args.dp_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            self.tensors = [torch.zeros(shape, dtype=torch.bfloat16, device=self.device) for _ in range(args.layers)]
            self.uuid = client.register_gpu_kv(self.tensors, flexkvd.Layout.LAYER_FIRST, args.num_blocks)
            self.layers = [t.view(torch.int16).view(2, args.num_blocks, self.chunk_elems) for t in self.tensors]
            self.where = (f"GPU {self.device} ({self.uuid}), torch {torch.__version__}, PYTORCH_CUDA_ALLOC_CONF="
                          f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
        else:
            import numpy
            self.np = numpy
            buf = client.create_host_kv(flexkvd.Layout.LAYER_FIRST, args.num_blocks)
            whole = numpy.frombuffer(buf, dtype=numpy.int16).reshape((args.layers,) + shape)
            self.tensors = list(whole)  # vLLM's per-layer shape, views of the shared buffer
            self.layers = [t.reshape(2, args.num_blocks, self.chunk_elems) for t in self.tensors]
            self.where = f"host memory shared with flexkvd ({len(buf) >> 20} MiB), NumPy {numpy.__version__}"
        self.block_bytes = geometry.host_block_bytes

    def _ids(self, ids: List[int]) -> Any:
        if self.torch is not None:
            return self.torch.tensor(ids, dtype=self.torch.long, device=self.device)
        return self.np.asarray(ids, dtype=self.np.int64)

    def _content(self, keys: flexkvd.BlockKeys, layer: int, plane: int) -> Any:
        """KV of these blocks in one (layer, plane): int16 [len(keys), chunk_elems], a function of each key."""
        mult = [(k.hi | 1) & 0x7FFF for k in keys]
        add = [(k.lo ^ (layer * 2 + plane) * 0x9E37) & 0xFFFF for k in keys]
        if self.torch is not None:
            t = self.torch
            ar = t.arange(self.chunk_elems, dtype=t.int64, device=self.device)  # int64 as NumPy: same bytes
            m = t.tensor(mult, dtype=t.int64, device=self.device)[:, None]
            a = t.tensor(add, dtype=t.int64, device=self.device)[:, None]
            return ((ar[None, :] * m + a) % 65536 - 32768).to(t.int16)
        np = self.np
        ar = np.arange(self.chunk_elems, dtype=np.int64)
        v = ar[None, :] * np.asarray(mult, dtype=np.int64)[:, None] + np.asarray(add, dtype=np.int64)[:, None]
        return (v % 65536 - 32768).astype(np.int16)

    def prefill(self, keys: flexkvd.BlockKeys, ids: List[int]) -> None:
        """Stands in for the model: writes the KV of these blocks."""
        if not ids:
            return
        idx = self._ids(ids)
        for layer, kv in enumerate(self.layers):
            for plane in range(2):
                kv[plane, idx] = self._content(keys, layer, plane)
        self.sync()

    def poison(self, ids: List[int]) -> None:
        """Garbage in blocks about to be loaded, so a load that wrote nothing cannot pass the check."""
        idx = self._ids(ids)
        for kv in self.layers:
            kv[:, idx] = -1
        self.sync()

    def verify(self, keys: flexkvd.BlockKeys, ids: List[int]) -> bool:
        idx = self._ids(ids)
        ok = True
        for layer, kv in enumerate(self.layers):
            for plane in range(2):
                ok &= bool((kv[plane, idx] == self._content(keys, layer, plane)).all())
        return ok

    def sync(self) -> None:
        """KV writes must be complete before the daemon copies the blocks (vLLM records an event per step)."""
        if self.torch is not None:
            self.torch.cuda.synchronize(self.device)


def workload(args: argparse.Namespace) -> List[Tuple[str, List[int]]]:
    """(label, prompt tokens) per request: every user's conversation grows by one turn per round."""
    rng = random.Random(args.seed)
    system = [rng.randrange(128000) for _ in range(args.system_tokens)]
    history = {u: list(system) for u in range(args.users)}
    requests = []
    for turn in range(args.turns):
        for user in range(args.users):
            history[user] += [rng.randrange(128000) for _ in range(args.turn_tokens)]
            requests.append((f"user {user} turn {turn}", list(history[user])))
    return requests


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def load_cached(client: flexkvd.Client, match_handle: int, ids: List[int],
                layerwise: bool, events: Optional[flexkvd.LayerEventSet] = None,
                stream: Any = None) -> Tuple[int, float, Optional[float]]:
    """Loads the pinned blocks of a match into KV blocks `ids`, then drops the pins, also when the load fails (a pin
    left behind keeps its blocks from being evicted for the rest of the session). Returns (blocks loaded, seconds,
    ms until layer 0 was usable with layerwise or events, else None). With `events`, `stream` (the compute stream)
    waits on each layer's event: whatever is enqueued on it afterwards reads the loaded bytes."""
    t0 = time.perf_counter()
    layer0_ms = None
    try:
        if events is not None:
            ticket = client.load(match_handle, ids, event_set=events)
            ticket.wait_launched(timeout=10.0)  # only now may the stream wait on the set's events
            layer0_ms = (time.perf_counter() - t0) * 1e3  # layer 0's compute could be enqueued from here
            for layer in range(events.num_layers):
                events.wait(layer, stream)
            done = ticket.wait(timeout=10.0).done_blocks
            return done, time.perf_counter() - t0, layer0_ms
        ticket = client.load(match_handle, ids, layerwise=layerwise)
        if layerwise:
            ticket.wait_layers(1, timeout=10.0)
            layer0_ms = (time.perf_counter() - t0) * 1e3
        done = ticket.wait(timeout=10.0).done_blocks
        load_s = time.perf_counter() - t0
    finally:
        client.release(match_handle).wait(timeout=1.0)
    return done, load_s, layer0_ms


def main() -> int:
    args = parse_args()
    geometry = flexkvd.Geometry(tokens_per_block=args.block_size, num_layers=args.layers, kv_planes=2,
                               kv_heads_per_rank=args.kv_heads, head_dim=args.head_dim, dtype_bytes=2, tp_size=1)
    client = flexkvd.connect(args.socket)
    kv = None
    try:
        client.attach(f"vllm-dp{args.dp_rank}", args.namespace, geometry, dp_rank=args.dp_rank)
        kv = KvCache(args, client, geometry)
        return serve(args, client, kv, geometry)
    finally:
        # The KV buffers must outlive the session: until it ends, the daemon may still copy into or out of them
        # (GPU tensors freed while registered are memory the allocator hands to someone else). So end the session
        # first (close() also waits for calls in progress), then drop the tensors. Host KV views may go either way
        # round: close() keeps the shared mapping until the last view is gone.
        client.close()
        del kv


def serve(args: argparse.Namespace, client: flexkvd.Client, kv: KvCache, geometry: flexkvd.Geometry) -> int:
    """Runs the workload on an attached client and KV cache; prints each request and the summary."""
    print(f"rank {args.dp_rank}: KV cache {args.layers} x {tuple(kv.tensors[0].shape)} bf16 in {kv.where}; "
          f"{geometry.host_block_bytes >> 10} KiB per block", flush=True)
    free = list(range(args.num_blocks))
    random.Random(args.seed + 1000 * args.dp_rank).shuffle(free)  # a paged allocator's ids are scattered
    totals = {"requests": 0, "prompt_tokens": 0, "saved_tokens": 0, "loaded_bytes": 0, "load_s": 0.0,
              "stored_bytes": 0, "store_s": 0.0, "verified": True, "layer0_ms": []}
    events, stream = None, None
    if args.layer_events:
        if kv.torch is None:
            print("--layer-events needs a GPU KV cache (torch with CUDA, not --host)")
            return 2
        events = client.layer_events(args.layers)  # on the KV cache's device (KvCache set it current)
        stream = kv.torch.cuda.current_stream()
    try:
        return _serve_requests(args, client, kv, geometry, free, totals, events, stream)
    finally:
        if events is not None:
            events.close()


def _serve_requests(args: argparse.Namespace, client: flexkvd.Client, kv: KvCache, geometry: flexkvd.Geometry,
                    free: List[int], totals: dict, events: Optional[flexkvd.LayerEventSet], stream: Any) -> int:
    for label, prompt in workload(args):
        keys = flexkvd.block_keys(args.namespace, prompt, args.block_size)
        blocks_needed = -(-len(prompt) // args.block_size)  # the partial tail block too
        if blocks_needed > len(free):
            print(f"{label}: needs {blocks_needed} blocks, {len(free)} free; use a larger --num-blocks")
            return 2
        ids = [free.pop() for _ in range(blocks_needed)]

        hit = client.match(keys, pin=True).wait(timeout=1.0)
        n_hit = hit.matched_blocks
        line = f"{label}: {len(prompt)} tokens, {n_hit}/{len(keys)} blocks cached"
        if n_hit:
            kv.poison(ids[:n_hit])
            done, load_s, layer0_ms = load_cached(client, hit.match_handle, ids[:n_hit], args.layerwise, events,
                                                  stream)
            if layer0_ms is not None:
                totals["layer0_ms"].append(layer0_ms)
            ok = done == n_hit and kv.verify(keys[:n_hit], ids[:n_hit])
            totals["verified"] &= ok
            nbytes = done * kv.block_bytes
            totals["loaded_bytes"] += nbytes
            totals["load_s"] += load_s
            totals["saved_tokens"] += n_hit * args.block_size
            line += (f" ({n_hit * args.block_size} tokens saved): loaded {nbytes / 2**20:.1f} MiB in "
                     f"{load_s * 1e3:.2f} ms ({gbps(nbytes, load_s):.1f} GB/s), "
                     f"{'verified' if ok else 'MISMATCH'}")

        kv.prefill(keys[n_hit:], ids[n_hit:len(keys)])
        t0 = time.perf_counter()
        stored = client.store(keys, ids[:len(keys)]).wait(timeout=10.0) if len(keys) else None
        store_s = time.perf_counter() - t0
        if stored is not None and stored.done_blocks:
            nbytes = stored.done_blocks * kv.block_bytes
            totals["stored_bytes"] += nbytes
            totals["store_s"] += store_s
            line += (f"; stored {stored.done_blocks} blocks, {nbytes / 2**20:.1f} MiB in {store_s * 1e3:.2f} ms "
                     f"({gbps(nbytes, store_s):.1f} GB/s)")
        elif stored is not None:
            line += "; nothing new to store"
        print(line, flush=True)
        totals["requests"] += 1
        totals["prompt_tokens"] += len(prompt)
        free.extend(ids)  # the request finished: its KV blocks go back to the allocator

    st = client.status()
    layer0 = totals.pop("layer0_ms")
    summary = {
        "rank": args.dp_rank, "backend": "gpu" if kv.torch is not None else "host",
        "requests": totals["requests"], "prompt_tokens": totals["prompt_tokens"],
        "saved_tokens": totals["saved_tokens"],
        "load_gbps": round(gbps(totals["loaded_bytes"], totals["load_s"]), 2),
        "loaded_mib": round(totals["loaded_bytes"] / 2**20, 1),
        "store_gbps": round(gbps(totals["stored_bytes"], totals["store_s"]), 2),
        "stored_mib": round(totals["stored_bytes"] / 2**20, 1),
        "layer0_ms_p50": round(sorted(layer0)[len(layer0) // 2], 3) if layer0 else None,
        "layer_completion": "cuda-events" if events is not None else "progress" if args.layerwise else None,
        "verified": totals["verified"], "daemon_index_blocks": st.index_blocks,
    }
    print(f"rank {args.dp_rank}: {summary['requests']} requests, {summary['saved_tokens']} of "
          f"{summary['prompt_tokens']} prompt tokens saved ({100.0 * summary['saved_tokens'] / max(1, summary['prompt_tokens']):.1f} %); "
          f"loads {summary['loaded_mib']} MiB at {summary['load_gbps']} GB/s, stores {summary['stored_mib']} MiB "
          f"at {summary['store_gbps']} GB/s; every loaded block {'verified' if summary['verified'] else 'NOT verified'}")
    print("summary: " + json.dumps(summary), flush=True)
    return 0 if summary["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
