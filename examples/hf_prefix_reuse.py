#!/usr/bin/env python3
"""A real model reuses a prefix through flexkvd: a Hugging Face Llama-architecture model on the GPU.

No weights can be downloaded where this runs, so the model is built from a config with fixed-seed random weights
(16 layers by default, hidden 2048, 16 heads, 8 KV heads of 128, bf16): every process that builds it gets the same
weights. Its KV lives, as in vLLM, in paged per-layer tensors [2, num_blocks, block_size, kv_heads, head_dim] that
the engine registers with flexkvd; the block keys are vLLM's full blocks of the prompt.

Two engine processes, one after the other, against one flexkvd:
  A (--role store): for each prompt length N, prefills N tokens, writes their KV into its paged blocks and stores
    them through the vLLM connector's logic (flexkv.integrations._vllm_logic: the scheduler side's store request,
    the worker side's store by block id).
  B (--role load): for each N, the prompt is A's N tokens plus a new turn (--suffix tokens). Without the hit: a full
    prefill of N + suffix tokens. With it: the connector's scheduler side matches the prompt, the worker side loads
    the cached blocks into freshly allocated paged blocks, the engine prefills only the suffix on top of them. It
    checks that the loaded KV equals the KV it computes itself for the prefix (byte for byte), that the next-token
    argmax and 32 greedy tokens equal the full prefill's, and reports the largest logit difference (bf16 noise: the
    full prefill and prefix-then-suffix run different kernel shapes) next to the same difference for a local
    prefix-then-suffix prefill without flexkvd. Time to first token (prompt in, first token's argmax on the host),
    median of --repeats, with and without the hit.
The driver (default role) starts flexkvd (or uses --socket), runs A then B, prints the table and a `summary: {json}`
line, and exits non-zero when any check failed.

  python3 examples/hf_prefix_reuse.py --flexkvd build/flexkvd --prompts 1024,4096,16384,32768
(PYTHONPATH=python and FLEXKV_LIBRARY=build/libflexkv.so.0 in a build tree; needs torch with CUDA and transformers.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import flexkv


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["driver", "store", "load"], default="driver")
    ap.add_argument("--socket", default=None, help="a running flexkvd's socket (driver: else it starts one)")
    ap.add_argument("--flexkvd", default=os.environ.get("FLEXKVD", "build/flexkvd"), help="driver: daemon binary")
    ap.add_argument("--pool-size", default="8GiB", help="driver: the daemon's pool (on /dev/shm)")
    ap.add_argument("--prompts", default="1024,4096,16384,32768", help="prompt lengths N (tokens)")
    ap.add_argument("--suffix", type=int, default=64, help="tokens of the new turn after the cached prefix")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens compared after the first")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case (median reported)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (vLLM's block_size)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="store/load: write the JSON results here")
    ap.add_argument("--log-dir", default=None, help="driver: where the daemon's log goes (default: a temporary "
                    "directory)")
    return ap.parse_args(argv)


# ---- the model -------------------------------------------------------------------------------------------------

class Model:
    """A Llama-architecture model with fixed-seed random weights, bf16 on the GPU, plus paged KV tensors."""

    def __init__(self, args: argparse.Namespace, max_tokens: int) -> None:
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
        self.torch = torch
        self.args = args
        if not torch.cuda.is_available():
            raise SystemExit("hf_prefix_reuse: no CUDA device visible (torch.cuda.is_available() is False)")
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        self.head_dim = args.hidden // args.heads
        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, head_dim=self.head_dim,
                             max_position_embeddings=max_tokens + 1024, rope_theta=500000.0)
        config._attn_implementation = "sdpa"
        torch.manual_seed(args.seed)
        with torch.device(self.device):
            model = LlamaForCausalLM(config)
        self.model = model.to(torch.bfloat16).eval()
        self.versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
        # A fingerprint of the weights: both engine processes must print the same.
        with torch.no_grad():
            self.fingerprint = float(sum(p.float().sum().item() for p in list(self.model.parameters())[:8]))
        bs = args.block_size
        self.num_blocks = (max_tokens + args.suffix) // bs + 8
        shape = (2, self.num_blocks, bs, args.kv_heads, self.head_dim)
        self.kv = [torch.zeros(shape, dtype=torch.bfloat16, device=self.device) for _ in range(args.layers)]

    def geometry(self) -> flexkv.Geometry:
        a = self.args
        return flexkv.Geometry(tokens_per_block=a.block_size, num_layers=a.layers, kv_heads_per_rank=a.kv_heads,
                               head_dim=self.head_dim, dtype_bytes=2)

    def tokens(self, n: int, salt: int) -> List[int]:
        g = self.torch.Generator().manual_seed(self.args.seed * 1000003 + salt)
        return self.torch.randint(3, self.args.vocab, (n,), generator=g).tolist()

    def new_cache(self) -> Any:
        from transformers import DynamicCache
        return DynamicCache()

    def forward(self, ids: List[int], cache: Any) -> Any:
        """Runs `ids` on top of `cache` (extended in place); the last position's logits, float32 [vocab]."""
        t = self.torch
        with t.no_grad():
            x = t.tensor([ids], dtype=t.long, device=self.device)
            out = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def greedy(self, logits: Any, cache: Any, n: int) -> List[int]:
        """The argmax of `logits`, then n more greedy tokens on `cache`."""
        tok = int(logits.argmax().item())
        toks = [tok]
        for _ in range(n):
            tok = int(self.forward([tok], cache).argmax().item())
            toks.append(tok)
        return toks

    # Paged KV <-> the HF cache. A DynamicCache layer holds keys/values [1, kv_heads, seq, head_dim].
    @staticmethod
    def _layer_kv(cache: Any, layer: int) -> Any:
        if hasattr(cache, "layers"):
            return cache.layers[layer].keys, cache.layers[layer].values
        return cache.key_cache[layer], cache.value_cache[layer]

    def write_blocks(self, cache: Any, block_ids: List[int], start_token: int = 0) -> None:
        """Copies the cache's KV of tokens [start_token, start_token + len(block_ids) * bs) into these blocks."""
        t = self.torch
        bs = self.args.block_size
        idx = t.tensor(block_ids, dtype=t.long, device=self.device)
        n = len(block_ids) * bs
        for layer, kv in enumerate(self.kv):
            k, v = self._layer_kv(cache, layer)
            for plane, src in enumerate((k, v)):
                part = src[0, :, start_token:start_token + n, :].transpose(0, 1)  # [n, heads, hd]
                kv[plane, idx] = part.reshape(len(block_ids), bs, self.args.kv_heads, self.head_dim)
        t.cuda.synchronize(self.device)

    def cache_from_blocks(self, block_ids: List[int]) -> Any:
        """A DynamicCache holding these blocks' KV, in order (the engine's paged attention would read them in
        place; HF's attention needs them contiguous)."""
        t = self.torch
        idx = t.tensor(block_ids, dtype=t.long, device=self.device)
        cache = self.new_cache()
        n = len(block_ids) * self.args.block_size
        for layer, kv in enumerate(self.kv):
            planes = []
            for plane in range(2):
                part = kv[plane, idx].reshape(n, self.args.kv_heads, self.head_dim)
                planes.append(part.transpose(0, 1).unsqueeze(0).contiguous())
            cache.update(planes[0], planes[1], layer)
        return cache

    def blocks_equal_cache(self, block_ids: List[int], cache: Any) -> bool:
        """Whether these blocks hold exactly the cache's KV of their tokens (bytes compared as int16)."""
        t = self.torch
        bs = self.args.block_size
        idx = t.tensor(block_ids, dtype=t.long, device=self.device)
        n = len(block_ids) * bs
        for layer, kv in enumerate(self.kv):
            k, v = self._layer_kv(cache, layer)
            for plane, src in enumerate((k, v)):
                want = src[0, :, :n, :].transpose(0, 1).reshape(len(block_ids), bs, self.args.kv_heads, self.head_dim)
                if not t.equal(kv[plane, idx].view(t.int16), want.contiguous().view(t.int16)):
                    return False
        return True

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)


# ---- the engine processes ----------------------------------------------------------------------------------------

def _median(xs: List[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def run_store(args: argparse.Namespace, lengths: List[int]) -> Dict[str, Any]:
    """Engine A: prefill each prompt and store its full blocks through the connector."""
    model = Model(args, max(lengths))
    link = ConnectorLink(args, model, "hf-engine-A")
    stored = {}
    for n in lengths:
        tokens = model.tokens(n, salt=n)
        cache = model.new_cache()
        model.forward(tokens, cache)
        blocks = n // args.block_size
        ids = list(range(blocks))  # A's paged blocks for this prompt (reused for the next: the store has ended)
        model.write_blocks(cache, ids)
        stored[str(n)] = link.store(f"A-{n}", tokens, ids)
        del cache
    link.close()
    return {"role": "store", "fingerprint": model.fingerprint, "versions": model.versions, "stored": stored}


def run_load(args: argparse.Namespace, lengths: List[int]) -> Dict[str, Any]:
    """Engine B: each prompt (A's tokens + a new turn) with and without the prefix from flexkvd."""
    t = None
    model = Model(args, max(lengths))
    import torch as t
    link = ConnectorLink(args, model, "hf-engine-B")
    bs = args.block_size
    # Warm up the kernels (the first prefill of a shape pays for their selection).
    for n in (256, 1024):
        model.forward(model.tokens(n, salt=7), model.new_cache())
    model.sync()
    rows = []
    for n in lengths:
        prompt = model.tokens(n, salt=n) + model.tokens(args.suffix, salt=n + 1)
        row: Dict[str, Any] = {"prompt": n, "total": len(prompt)}
        # Without the hit: a full prefill.
        miss_ms = []
        for _ in range(args.repeats):
            model.sync()
            t0 = time.perf_counter()
            cache = model.new_cache()
            logits_full = model.forward(prompt, cache)
            first = int(logits_full.argmax().item())
            miss_ms.append((time.perf_counter() - t0) * 1e3)
            del cache
        cache = model.new_cache()
        logits_full = model.forward(prompt, cache)
        tokens_full = model.greedy(logits_full, cache, args.greedy)
        del cache
        # The same split without flexkvd: the prefix prefilled here, then the suffix on top of it.
        local = model.new_cache()
        model.forward(prompt[:n], local)
        logits_split = model.forward(prompt[n:], local)
        row["split_logit_maxdiff"] = float((logits_split - logits_full).abs().max().item())
        del local
        # With the hit, through the connector: match, load into fresh blocks, prefill the rest.
        hit_ms, load_ms = [], []
        ids = list(range(model.num_blocks - (n // bs), model.num_blocks))  # other blocks than A used
        cached = 0
        logits_hit = None
        for rep in range(args.repeats):
            model.kv[0].fill_(0)
            model.sync()
            t0 = time.perf_counter()
            cached = link.match(f"B-{n}-{rep}", prompt)
            cached_blocks = cached // bs
            ok = link.load(f"B-{n}-{rep}", prompt, ids[:cached_blocks], cached)
            t1 = time.perf_counter()
            if not ok:
                cached_blocks, cached = 0, 0
            cache = model.cache_from_blocks(ids[:cached_blocks]) if cached_blocks else model.new_cache()
            logits_hit = model.forward(prompt[cached:], cache)
            first_hit = int(logits_hit.argmax().item())
            t2 = time.perf_counter()
            hit_ms.append((t2 - t0) * 1e3)
            load_ms.append((t1 - t0) * 1e3)
            if rep + 1 < args.repeats:
                del cache
        row["cached_tokens"] = cached
        # The loaded KV must be exactly what this process computes for the prefix.
        ref = model.new_cache()
        model.forward(prompt[:cached], ref) if cached else None
        row["kv_byte_exact"] = bool(cached) and model.blocks_equal_cache(ids[:cached // bs], ref)
        del ref
        tokens_hit = model.greedy(logits_hit, cache, args.greedy)
        del cache
        row["argmax_equal"] = first_hit == first
        row["greedy_equal"] = tokens_hit == tokens_full
        row["greedy_tokens"] = len(tokens_full)
        row["hit_logit_maxdiff"] = float((logits_hit - logits_full).abs().max().item())
        row["logit_absmax"] = float(logits_full.abs().max().item())
        row["ttft_miss_ms"] = _median(miss_ms)
        row["ttft_hit_ms"] = _median(hit_ms)
        row["load_ms"] = _median(load_ms)
        row["load_gbps"] = (cached // bs) * link.block_bytes / (row["load_ms"] / 1e3) / 1e9 if cached else 0.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    link.close()
    return {"role": "load", "fingerprint": model.fingerprint, "versions": model.versions, "rows": rows,
            "gpu": t.cuda.get_device_name(0)}


def run_driver(args: argparse.Namespace, lengths: List[int]) -> int:
    daemon = None
    tmp = tempfile.mkdtemp(prefix="hf-prefix-reuse-")
    socket = args.socket
    if socket is None:
        socket = os.path.join(tmp, "flexkvd.sock")
        pool_dir = f"/dev/shm/hf-prefix-reuse-{os.getpid()}"
        os.makedirs(pool_dir, exist_ok=True)
        log_path = os.path.join(args.log_dir or tmp, "flexkvd.log")
        log = open(log_path, "w")
        daemon = subprocess.Popen([args.flexkvd, "--socket", socket, "--pool-path", f"{pool_dir}/pool",
                                   "--pool-size", args.pool_size], stdout=log, stderr=subprocess.STDOUT)
        for _ in range(400):
            if os.path.exists(socket) or daemon.poll() is not None:
                break
            time.sleep(0.05)
        if daemon.poll() is not None or not os.path.exists(socket):
            log.close()
            print(open(log_path).read(), file=sys.stderr)
            raise SystemExit(f"hf_prefix_reuse: flexkvd did not start on {socket}")
    results = []
    try:
        base = [sys.executable, os.path.abspath(__file__), "--socket", socket, "--prompts", args.prompts]
        for flag in ("suffix", "greedy", "repeats", "layers", "hidden", "heads", "kv_heads", "intermediate",
                     "vocab", "block_size", "seed"):
            base += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        for role in ("store", "load"):
            out = os.path.join(tmp, f"{role}.json")
            print(f"== engine process {'A' if role == 'store' else 'B'} ({role})", flush=True)
            rc = subprocess.call(base + ["--role", role, "--out", out])
            if rc != 0:
                print(f"hf_prefix_reuse: the {role} process exited with {rc}", file=sys.stderr)
                return 1
            results.append(json.load(open(out)))
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=60)
            subprocess.call(["rm", "-rf", pool_dir])
    a, b = results
    ok = a["fingerprint"] == b["fingerprint"]
    if not ok:
        print(f"weights differ between the processes: {a['fingerprint']} vs {b['fingerprint']}")
    print(f"\n{b['gpu']}, {b['versions']}; Llama-architecture, {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads, {args.kv_heads} KV heads, bf16, random weights (seed {args.seed}); "
          f"prompt = N cached tokens + {args.suffix} new\n")
    print("| N | cached | TTFT full prefill ms | TTFT with hit ms | speedup | load ms (GB/s) | KV byte-exact "
          "| argmax | 32 greedy equal | max logit diff hit / local split (|logit| max) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in b["rows"]:
        good = r["kv_byte_exact"] and r["argmax_equal"] and r["greedy_equal"] and r["cached_tokens"] == r["prompt"]
        ok &= good
        print(f"| {r['prompt']} | {r['cached_tokens']} | {r['ttft_miss_ms']:.1f} | {r['ttft_hit_ms']:.1f} | "
              f"{r['ttft_miss_ms'] / r['ttft_hit_ms']:.1f}x | {r['load_ms']:.1f} ({r['load_gbps']:.1f}) | "
              f"{r['kv_byte_exact']} | {r['argmax_equal']} | {r['greedy_equal']} | "
              f"{r['hit_logit_maxdiff']:.4f} / {r['split_logit_maxdiff']:.4f} ({r['logit_absmax']:.2f}) |")
    print("summary: " + json.dumps({"ok": bool(ok), "stored": a["stored"], "rows": b["rows"]}))
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    lengths = [int(x) for x in args.prompts.split(",") if x]
    bad = [n for n in lengths if n <= 0 or n % args.block_size]
    if bad:
        raise SystemExit(f"hf_prefix_reuse: prompt lengths {bad} are not positive multiples of --block-size "
                         f"{args.block_size}")
    if args.role == "driver":
        return run_driver(args, lengths)
    result = run_store(args, lengths) if args.role == "store" else run_load(args, lengths)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
