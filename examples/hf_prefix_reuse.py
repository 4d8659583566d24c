#!/usr/bin/env python3
"""A real model reuses a prefix through flexkvd: a Hugging Face Llama-architecture model on the GPU.

No weights can be downloaded where this runs, so the model is built from a config with fixed-seed random weights
(16 layers by default, hidden 2048, 16 heads, 8 KV heads of 128, bf16 and float32): every process that builds it
gets the same weights. Its KV lives, as in vLLM, in paged per-layer tensors
[2, num_blocks, block_size, kv_heads, head_dim] that the engine registers with flexkvd; the block keys are vLLM's
full blocks of the prompt.

Two engine processes, one after the other, against one flexkvd:
  A (--role store): for each prompt length N, prefills N tokens, writes their KV into its paged blocks and stores
    them through the vLLM connector's logic (flexkvd.integrations._vllm_logic: the scheduler side's store request,
    the worker side's store by block id).
  B (--role load): for each N, the prompt is A's N tokens plus a new turn (--suffix tokens). Without the hit: a full
    prefill of N + suffix tokens. With it: the connector's scheduler side matches the prompt, the worker side loads
    the cached blocks into freshly allocated paged blocks, the engine prefills only the suffix on top of them. It
    checks that the loaded KV equals the KV it computes itself for the prefix (byte for byte), that the first token
    equals the full prefill's, that the hit's logits are no farther from the full prefill's than a local
    prefix-then-suffix prefill's without flexkvd (the dtype's rounding for that split), and in float32 that 32 greedy
    tokens equal the full prefill's (in bf16 they are reported: a random-weight model's near-flat logits let the
    split's rounding flip a near-tie). Time to first token (prompt in, first token's argmax on the host), median of
    --repeats, with and without the hit, split into match / load / gather (HF needs a contiguous cache) / the rest.
Each dtype of --dtypes (bfloat16, float32) runs against a fresh daemon.
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

import flexkvd


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["driver", "store", "load"], default="driver")
    ap.add_argument("--socket", default=None, help="a running flexkvd's socket (driver: else it starts one)")
    ap.add_argument("--flexkvd", default=os.environ.get("FLEXKVD", "build/flexkvd"), help="driver: daemon binary")
    ap.add_argument("--pool-size", default="12GiB", help="driver: the daemon's pool (on /dev/shm)")
    ap.add_argument("--prompts", default="1024,4096,16384,32768", help="prompt lengths N (tokens)")
    ap.add_argument("--suffix", type=int, default=64, help="tokens of the new turn after the cached prefix")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens compared after the first")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per case (median reported)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (vLLM's block_size)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dtypes", default="bfloat16,float32",
                    help="driver: the model dtypes to run, each against a fresh daemon (bfloat16 is what engines run "
                    "and what TTFT is reported for; float32 shows the greedy tokens equal where bf16 rounding of the "
                    "split prefill can flip a near-tie of a random-weight model)")
    ap.add_argument("--float32-max-prompt", type=int, default=16384,
                    help="driver: longer prompts are run in bfloat16 only (float32 attention falls back to a kernel "
                    "that materialises the N x N scores: 64 GiB at 32k)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="store/load: model dtype")
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
        self.dtype = getattr(torch, args.dtype)
        self.model = model.to(self.dtype).eval()
        self.versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
        # A fingerprint of the weights: both engine processes must print the same.
        with torch.no_grad():
            self.fingerprint = float(sum(p.float().sum().item() for p in list(self.model.parameters())[:8]))
        bs = args.block_size
        self.num_blocks = (max_tokens + args.suffix) // bs + 8
        shape = (2, self.num_blocks, bs, args.kv_heads, self.head_dim)
        self.kv = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(args.layers)]

    def geometry(self) -> flexkvd.Geometry:
        a = self.args
        return flexkvd.Geometry(tokens_per_block=a.block_size, num_layers=a.layers, kv_heads_per_rank=a.kv_heads,
                               head_dim=self.head_dim, dtype_bytes=self.torch.finfo(self.dtype).bits // 8)

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
        """Whether these blocks hold exactly the cache's KV of their tokens (bytes compared as integers)."""
        t = self.torch
        bs = self.args.block_size
        idx = t.tensor(block_ids, dtype=t.long, device=self.device)
        n = len(block_ids) * bs
        for layer, kv in enumerate(self.kv):
            k, v = self._layer_kv(cache, layer)
            for plane, src in enumerate((k, v)):
                want = src[0, :, :n, :].transpose(0, 1).reshape(len(block_ids), bs, self.args.kv_heads, self.head_dim)
                as_int = t.int16 if self.dtype == t.bfloat16 else t.int32
                if not t.equal(kv[plane, idx].view(as_int), want.contiguous().view(as_int)):
                    return False
        return True

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)


# ---- the connector, as vLLM would drive it ------------------------------------------------------------------

class ConnectorLink:
    """The vLLM connector's two sides (flexkvd.integrations.vllm: SchedulerLogic + WorkerLogic) in one engine
    process, driven with the calls vLLM makes for one request at a time (docs/integrations.md, "The logic classes
    without vLLM"). The worker registers the model's paged per-layer KV tensors; flexkvd copies blocks between them
    and its host pool.
    """

    def __init__(self, args: argparse.Namespace, model: "Model", name: str) -> None:
        import torch
        from flexkvd.integrations.vllm import ConnectorConfig, LinkOptions, SchedulerLogic, WorkerLogic
        geometry = model.geometry()
        # Loads of 32k-token prompts pin 2k blocks at once: a generous timeout (vLLM's default 0.5 s is for a step).
        cfg = ConnectorConfig(namespace=f"hf-llama-random-seed{args.seed}|{args.dtype}|tp1", geometry=geometry,
                              link=LinkOptions(socket=args.socket, connect_timeout_s=5.0), op_timeout_s=10.0,
                              name=name)
        self.sched = SchedulerLogic(cfg)
        self.worker = WorkerLogic(cfg, sync=torch.cuda.synchronize)
        self.worker.register_gpu_kv(model.kv, model.num_blocks)
        self.block_bytes = geometry.host_block_bytes  # one block, every layer

    def _step(self, finished: set) -> tuple:
        """One engine step of the worker: submit what the scheduler planned, wait for it (vLLM would poll), report."""
        self.worker.start(self.sched.build_connector_meta())
        if not self.worker.wait_all(timeout=60.0):
            raise RuntimeError("flexkvd did not finish a load or store within 60 s")
        sending, recving = self.worker.get_finished(finished)
        errors = self.worker.take_load_errors()
        self.sched.update_connector_output(sending, recving, errors)
        return sending or set(), recving or set(), errors

    def store(self, request_id: str, tokens: List[int], block_ids: List[int]) -> Dict[str, int]:
        """The request ended with `tokens` computed into `block_ids`: its full blocks are stored (request_finished,
        then the worker's store, reported finished_sending). Returns the worker's counters for it."""
        before = dict(self.worker.stats.as_dict())
        hit, _ = self.sched.get_num_new_matched_tokens(request_id, tokens, 0)  # what vLLM asks at admission
        if hit:
            raise RuntimeError(f"{request_id}: flexkvd already holds {hit} tokens of a prompt A stores first")
        if not self.sched.request_finished(request_id, tokens, block_ids, len(tokens)):
            raise RuntimeError(f"{request_id}: the connector planned no store (daemon unreachable?)")
        sending, _, _ = self._step({request_id})
        if request_id not in sending:
            raise RuntimeError(f"{request_id}: the store was not reported finished")
        after = self.worker.stats.as_dict()
        delta = {k: after[k] - before.get(k, 0) for k in ("stores", "stored_blocks", "stored_bytes",
                                                           "store_failures")}
        if delta["store_failures"]:
            raise RuntimeError(f"{request_id}: the store failed ({delta})")
        return delta

    def match(self, request_id: str, tokens: List[int]) -> int:
        """Tokens of the prompt flexkvd holds (get_num_new_matched_tokens with no local hit)."""
        hit, _ = self.sched.get_num_new_matched_tokens(request_id, tokens, 0)
        return hit

    def load(self, request_id: str, tokens: List[int], block_ids: List[int], n_tokens: int) -> bool:
        """Loads the n_tokens matched by match() into block_ids (vLLM's allocation for them) and ends the request.
        True when every block arrived; False when some did not (load errors: the engine recomputes)."""
        if n_tokens == 0:
            return False
        self.sched.update_state_after_alloc(request_id, block_ids, n_tokens)
        _, recving, errors = self._step(set())
        # The request ends here for the connector (the engine goes on without it): nothing more to store.
        self.sched.request_finished(request_id, tokens, block_ids, n_tokens)
        return request_id in recving and not errors

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


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


def _first_divergence(xs: List[int], ys: List[int]) -> int:
    """The first index where the token lists differ, -1 when equal."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x != y:
            return i
    return -1 if len(xs) == len(ys) else min(len(xs), len(ys))


def run_load(args: argparse.Namespace, lengths: List[int]) -> Dict[str, Any]:
    """Engine B: each prompt (A's tokens + a new turn) with and without the prefix from flexkvd."""
    model = Model(args, max(lengths))
    t = model.torch
    link = ConnectorLink(args, model, "hf-engine-B")
    bs = args.block_size
    # Warm up the kernels (the first prefill of a shape pays for their selection).
    for n in (256, 1024):
        model.forward(model.tokens(n, salt=7), model.new_cache())
    model.sync()
    rows = []
    for n in lengths:
        prompt = model.tokens(n, salt=n) + model.tokens(args.suffix, salt=n + 1)
        row: Dict[str, Any] = {"dtype": args.dtype, "prompt": n, "total": len(prompt)}
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
        tokens_split = model.greedy(logits_split, local, args.greedy)
        row["split_logit_maxdiff"] = float((logits_split - logits_full).abs().max().item())
        del local
        # With the hit, through the connector: match, load into fresh blocks, prefill the rest.
        phases: Dict[str, List[float]] = {"ttft": [], "match": [], "load": [], "gather": [], "rest": []}
        ids = list(range(model.num_blocks - (n // bs), model.num_blocks))  # other blocks than A used
        cached = 0
        logits_hit, cache = None, None
        for rep in range(args.repeats):
            for kv in model.kv:
                kv.zero_()
            del cache
            model.sync()
            t0 = time.perf_counter()
            cached = link.match(f"B-{n}-{rep}", prompt)
            t1 = time.perf_counter()
            cached_blocks = cached // bs
            if not link.load(f"B-{n}-{rep}", prompt, ids[:cached_blocks], cached):
                cached_blocks, cached = 0, 0
            t2 = time.perf_counter()
            cache = model.cache_from_blocks(ids[:cached_blocks]) if cached_blocks else model.new_cache()
            model.sync()
            t3 = time.perf_counter()
            logits_hit = model.forward(prompt[cached:], cache)
            first_hit = int(logits_hit.argmax().item())
            t4 = time.perf_counter()
            for name, ms in (("ttft", t4 - t0), ("match", t1 - t0), ("load", t2 - t1), ("gather", t3 - t2),
                             ("rest", t4 - t3)):
                phases[name].append(ms * 1e3)
        row["cached_tokens"] = cached
        # The loaded KV must be exactly what this process computes for the prefix.
        ref = model.new_cache()
        if cached:
            model.forward(prompt[:cached], ref)
        row["kv_byte_exact"] = bool(cached) and model.blocks_equal_cache(ids[:cached // bs], ref)
        del ref
        tokens_hit = model.greedy(logits_hit, cache, args.greedy)
        del cache
        row["argmax_equal"] = first_hit == first
        row["greedy_tokens"] = len(tokens_full)
        row["greedy_equal"] = tokens_hit == tokens_full
        # Where the split prefill's rounding flips a near-tie, the full prefill's margin at that step says so.
        row["greedy_first_divergence"] = _first_divergence(tokens_hit, tokens_full)
        # flexkvd's bytes are the engine's own: the hit computes exactly what a local split prefill computes.
        row["hit_logits_equal_local_split"] = bool(t.equal(logits_hit, logits_split))
        row["hit_greedy_equal_local_split"] = tokens_hit == tokens_split
        row["hit_logit_maxdiff"] = float((logits_hit - logits_full).abs().max().item())
        top2 = logits_full.topk(2).values
        row["full_top2_margin"] = float((top2[0] - top2[1]).item())
        row["logit_absmax"] = float(logits_full.abs().max().item())
        row["ttft_miss_ms"] = _median(miss_ms)
        for name, xs in phases.items():
            row[f"{name}_ms" if name != "ttft" else "ttft_hit_ms"] = _median(xs)
        row["load_gbps"] = (cached // bs) * link.block_bytes / (row["load_ms"] / 1e3) / 1e9 if cached else 0.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    link.close()
    return {"role": "load", "fingerprint": model.fingerprint, "versions": model.versions, "rows": rows,
            "gpu": t.cuda.get_device_name(0)}


class Daemon:
    """A flexkvd of the driver's own (pool on /dev/shm, log in --log-dir), stopped on exit."""

    def __init__(self, args: argparse.Namespace, tmp: str, tag: str) -> None:
        self.socket = os.path.join(tmp, f"flexkvd-{tag}.sock")
        self.pool_dir = f"/dev/shm/hf-prefix-reuse-{os.getpid()}-{tag}"
        os.makedirs(self.pool_dir, exist_ok=True)
        log_path = os.path.join(args.log_dir or tmp, f"flexkvd-{tag}.log")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([args.flexkvd, "--socket", self.socket, "--pool-path",
                                      f"{self.pool_dir}/pool", "--pool-size", args.pool_size],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(400):
            if os.path.exists(self.socket) or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if self.proc.poll() is not None or not os.path.exists(self.socket):
            self.close()
            print(open(log_path).read(), file=sys.stderr)
            raise SystemExit(f"hf_prefix_reuse: flexkvd did not start on {self.socket}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.log.close()
        subprocess.call(["rm", "-rf", self.pool_dir])


def run_pair(args: argparse.Namespace, socket: str, dtype: str, lengths: List[int],
             tmp: str) -> Optional[List[Dict[str, Any]]]:
    """Engine process A (store) then B (load) for one dtype; their results, or None when one failed."""
    base = [sys.executable, os.path.abspath(__file__), "--socket", socket, "--prompts",
            ",".join(str(n) for n in lengths), "--dtype", dtype]
    for flag in ("suffix", "greedy", "repeats", "layers", "hidden", "heads", "kv_heads", "intermediate",
                 "vocab", "block_size", "seed"):
        base += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    results = []
    for role in ("store", "load"):
        out = os.path.join(tmp, f"{dtype}-{role}.json")
        print(f"== {dtype}: engine process {'A' if role == 'store' else 'B'} ({role})", flush=True)
        rc = subprocess.call(base + ["--role", role, "--out", out])
        if rc != 0:
            print(f"hf_prefix_reuse: the {dtype} {role} process exited with {rc}", file=sys.stderr)
            return None
        with open(out) as f:
            results.append(json.load(f))
    return results


def row_ok(r: Dict[str, Any]) -> bool:
    """What must hold. Every dtype: the whole prefix hit, the loaded KV byte-exact (flexkvd's part: the bytes the
    engine gets are the bytes it would compute), the same first token as a full prefill, and the hit's logits no
    farther from the full prefill's than a local split prefill's (prefix, then the rest, no flexkvd) are, beyond a
    factor of 2: that distance is the dtype's rounding noise for this split. float32: the 32 greedy tokens equal the
    full prefill's too. bfloat16: they are reported; a random-weight model's logits are nearly flat (top-2 margins of
    a few hundredths), so the split prefill's bf16 rounding, with or without flexkvd, can flip a near-tie after
    some steps."""
    good = (r["cached_tokens"] == r["prompt"] and r["kv_byte_exact"] and r["argmax_equal"] and
            r["hit_logit_maxdiff"] <= 2 * r["split_logit_maxdiff"] + 1e-6)
    if r["dtype"] == "float32":
        good = good and r["greedy_equal"]
    return bool(good)


def run_driver(args: argparse.Namespace, lengths: List[int]) -> int:
    tmp = tempfile.mkdtemp(prefix="hf-prefix-reuse-")
    ok = True
    summary: Dict[str, Any] = {}
    for dtype in [d for d in args.dtypes.split(",") if d]:
        if dtype not in ("bfloat16", "float32"):
            raise SystemExit(f"hf_prefix_reuse: --dtypes has {dtype!r}; expected bfloat16 and/or float32")
        daemon = Daemon(args, tmp, dtype) if args.socket is None else None
        try:
            these = [n for n in lengths if dtype != "float32" or n <= args.float32_max_prompt]
            results = run_pair(args, args.socket or daemon.socket, dtype, these, tmp)
        finally:
            if daemon is not None:
                daemon.close()
        if results is None:
            return 1
        a, b = results
        if a["fingerprint"] != b["fingerprint"]:
            print(f"weights differ between the processes: {a['fingerprint']} vs {b['fingerprint']}")
            ok = False
        print(f"\n{b['gpu']}, {b['versions']}; Llama-architecture, {args.layers} layers, hidden {args.hidden}, "
              f"{args.heads} heads, {args.kv_heads} KV heads, {dtype}, random weights (seed {args.seed}); "
              f"prompt = N cached tokens + {args.suffix} new; medians of {args.repeats}\n")
        print("| N | cached | TTFT full prefill ms | TTFT with hit ms | speedup | match / load / gather / rest ms "
              "| load GB/s | KV byte-exact | argmax | 32 greedy equal (first diff) | hit = local split: logits, greedy "
              "| max logit diff vs full: hit / local split (top-2 margin, max abs logit) | ok |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in b["rows"]:
            good = row_ok(r)
            ok &= good
            diverged = "" if r["greedy_equal"] else f" ({r['greedy_first_divergence']})"
            print(f"| {r['prompt']} | {r['cached_tokens']} | {r['ttft_miss_ms']:.1f} | {r['ttft_hit_ms']:.1f} | "
                  f"{r['ttft_miss_ms'] / r['ttft_hit_ms']:.1f}x | {r['match_ms']:.1f} / {r['load_ms']:.1f} / "
                  f"{r['gather_ms']:.1f} / {r['rest_ms']:.1f} | {r['load_gbps']:.1f} | {r['kv_byte_exact']} | "
                  f"{r['argmax_equal']} | {r['greedy_equal']}{diverged} | {r['hit_logits_equal_local_split']}, "
                  f"{r['hit_greedy_equal_local_split']} | {r['hit_logit_maxdiff']:.3g} / "
                  f"{r['split_logit_maxdiff']:.3g} "
                  f"({r['full_top2_margin']:.3g}, {r['logit_absmax']:.3g}) | "
                  f"{'yes' if good else 'NO'} |")
        summary[dtype] = {"stored": a["stored"], "rows": b["rows"]}
    print("summary: " + json.dumps({"ok": bool(ok), **summary}))
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
