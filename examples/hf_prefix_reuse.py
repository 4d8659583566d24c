#!/usr/bin/env python3
# Over 700 lines: one self-contained file the GPU machine runs as it is (the model, the connector's calls, both
# engine processes with the whole and the layer-wise hit, and the driver's tables); split, it would need a package.
"""A real model reuses a prefix through flexkvd: a Hugging Face Llama-architecture model on the GPU.

No weights can be downloaded where this runs, so the model is built from a config with fixed-seed random weights
(16 layers by default, hidden 2048, 16 heads, 8 KV heads of 128, bf16 or float32): every process that builds it
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
    Each hit is taken twice, in alternating repeats, as the connector can load it:
      whole (ConnectorConfig load_mode "whole"): the worker loads every layer and the engine waits for all of it
        (vLLM: an asynchronous load, finished_recving), then the cache is gathered and the suffix prefilled;
      layer-wise (load_mode "layerwise", as the vLLM adapter runs by default): the scheduler answers (hit, False),
        the load is submitted in the same step with a CUDA event per layer (WorkerLogic.start), and a forward
        pre-hook on each decoder layer calls the worker's wait_layer (vLLM's wait_for_layer_load: the current CUDA
        stream waits on that layer's event, the CPU goes on) and then gathers that layer's prefix into the HF
        cache, so layer i computes as soon as its copies landed while later layers still copy (layer 0's wait and
        gather come right before the forward: HF takes the past length, hence positions and the causal mask, from
        layer 0's cache before any layer runs). The two variants share one worker (one KV registration); each has
        its scheduler side.
    The layer-wise hit must give the whole hit's logits bit for bit (the same bytes, the same computation), the
    full prefill's first token, and byte-exact KV. (--no-layerwise: the whole variant only.)
Each dtype of --dtypes (bfloat16; float32 on request) runs against a fresh daemon.
The driver (default role) starts flexkvd (or uses --socket), runs A then B, prints the tables and a `summary: {json}`
line, and exits non-zero when any check failed.

  python3 examples/hf_prefix_reuse.py --flexkvd build/flexkvd --prompts 4096,8192,16384,32768
(PYTHONPATH=python and FLEXKV_LIBRARY=build/libflexkv.so.0 in a build tree; needs torch with CUDA and transformers.)
"""
from __future__ import annotations

import argparse
import dataclasses
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
    ap.add_argument("--prompts", default="4096,8192,16384,32768", help="prompt lengths N (tokens)")
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
    ap.add_argument("--dtypes", default="bfloat16",
                    help="driver: the model dtypes to run, each against a fresh daemon (bfloat16 is what engines run "
                    "and what TTFT is reported for; add float32 (bfloat16,float32) to see the greedy tokens equal "
                    "where bf16 rounding of the split prefill can flip a near-tie of a random-weight model)")
    ap.add_argument("--no-layerwise", dest="layerwise", action="store_false",
                    help="only the whole load (no layer-wise variant of the hit)")
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
        self._fill: Optional[Dict[str, Any]] = None  # a layer-wise forward in progress (begin_layerwise)

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

    def _gather_layer(self, idx: Any, layer: int) -> tuple:
        """One layer's KV of the blocks `idx` (a device tensor of block ids), in order, as HF's cache holds it:
        keys and values [1, kv_heads, blocks * block_size, head_dim], contiguous; enqueued on the current stream."""
        n = int(idx.numel()) * self.args.block_size
        planes = []
        for plane in range(2):
            part = self.kv[layer][plane, idx].reshape(n, self.args.kv_heads, self.head_dim)
            planes.append(part.transpose(0, 1).unsqueeze(0).contiguous())
        return planes[0], planes[1]

    def cache_from_blocks(self, block_ids: List[int]) -> Any:
        """A DynamicCache holding these blocks' KV, in order (the engine's paged attention would read them in
        place; HF's attention needs them contiguous)."""
        t = self.torch
        idx = t.tensor(block_ids, dtype=t.long, device=self.device)
        cache = self.new_cache()
        for layer in range(len(self.kv)):
            k, v = self._gather_layer(idx, layer)
            cache.update(k, v, layer)
        return cache

    # Layer-wise: each decoder layer's prefix KV is put into the cache right before the layer runs, after the
    # current stream was made to wait for that layer's load (vLLM's wait_for_layer_load before its attention).
    def decoder_layers(self) -> List[Any]:
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if layers is None or len(layers) != self.args.layers:
            raise SystemExit(f"hf_prefix_reuse: expected model.model.layers to hold {self.args.layers} decoder layers "
                             f"({self.versions}); found "
                             f"{'none' if layers is None else len(layers)}")
        return list(layers)

    def install_layer_hooks(self) -> List[Any]:
        """A forward pre-hook on each decoder layer that fills its prefix while a layer-wise forward runs
        (begin_layerwise .. end_layerwise) and does nothing otherwise. Returns the handles (remove() them)."""
        self._fill = None
        handles = []
        for i, layer in enumerate(self.decoder_layers()):
            def hook(module: Any, args: Any, i: int = i) -> None:
                if self._fill is not None:
                    self._fill_layer(i)
            handles.append(layer.register_forward_pre_hook(hook))
        return handles

    def begin_layerwise(self, block_ids: List[int], wait_layer: Any) -> Any:
        """A new DynamicCache for a forward on top of these blocks, loaded layer by layer: wait_layer(i) makes the
        current stream wait for layer i's copies. Layer 0 is filled now: HF takes the past length (positions, the
        causal mask's size) from layer 0's cache before any layer runs; the hooks fill the others."""
        t = self.torch
        self._fill = {"cache": self.new_cache(), "idx": t.tensor(block_ids, dtype=t.long, device=self.device),
                      "wait": wait_layer, "filled": []}
        self._fill_layer(0)
        return self._fill["cache"]

    def _fill_layer(self, i: int) -> None:
        f = self._fill
        if i in f["filled"]:
            return
        if f["filled"] != list(range(i)):
            raise RuntimeError(f"layer-wise fill: decoder layer {i} runs after layers {f['filled']} were filled; "
                               "expected the layers in order, each once per forward")
        cache = f["cache"]
        if cache.get_seq_length(i) != 0:
            raise RuntimeError(f"layer-wise fill: the cache's layer {i} already holds {cache.get_seq_length(i)} "
                               "tokens before its prefix was put in; expected an empty layer")
        f["wait"](i)  # the stream waits for this layer's copies; the gather below runs after them
        k, v = self._gather_layer(f["idx"], i)
        cache.update(k, v, i)
        f["filled"].append(i)

    def end_layerwise(self) -> List[int]:
        """Ends the layer-wise forward; the layers whose prefix was filled (every layer, in order, when it ran)."""
        f, self._fill = self._fill, None
        return [] if f is None else list(f["filled"])

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

def _stream_fence() -> Any:
    """A CUDA event recorded now on the current stream: query() is True once the kernels enqueued before it ran
    (the worker's store_fence, as the vLLM adapter sets it: stores wait for it without the CPU waiting)."""
    import torch
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


class ConnectorLink:
    """The vLLM connector's two sides (flexkvd.integrations.vllm: SchedulerLogic + WorkerLogic) in one engine
    process, driven with the calls vLLM makes for one request at a time (docs/integrations.md, "The logic classes
    without vLLM"). The worker registers the model's paged per-layer KV tensors; flexkvd copies blocks between them
    and its host pool. It is wired as the vLLM adapter wires a GPU worker: store_fence (a CUDA event on the current
    stream), layer_stream (torch.cuda.current_stream: the stream layer waits bind) and the layers' names.

    layerwise: a second scheduler side with load_mode "layerwise" beside the whole one, over the same worker (one
    registration of the KV): the worker runs each planned load as its LoadSpec says (layerwise or not), so the
    two variants of a hit differ only in the scheduler's plan and the engine's waits.
    """

    def __init__(self, args: argparse.Namespace, model: "Model", name: str, layerwise: bool = False) -> None:
        import torch
        from flexkvd.integrations.vllm import ConnectorConfig, LinkOptions, SchedulerLogic, WorkerLogic
        geometry = model.geometry()
        # Loads of 32k-token prompts pin 2k blocks at once: a generous timeout (vLLM's default 0.5 s is for a step).
        cfg = ConnectorConfig(namespace=f"hf-llama-random-seed{args.seed}|{args.dtype}|tp1", geometry=geometry,
                              link=LinkOptions(socket=args.socket, connect_timeout_s=5.0), op_timeout_s=10.0,
                              name=name, load_mode="whole")
        self.sched = SchedulerLogic(cfg)
        self.sched_layerwise = None
        if layerwise:
            lw = dataclasses.replace(cfg, load_mode="layerwise", name=f"{name}-layerwise")
            if not lw.layerwise:
                raise SystemExit(f"hf_prefix_reuse: ConnectorConfig(load_mode='layerwise') is not layer-wise for "
                                 f"this geometry ({geometry}); layer-wise loads need TP 1 and full attention")
            self.sched_layerwise = SchedulerLogic(lw)
        self.worker = WorkerLogic(cfg, sync=torch.cuda.synchronize)
        self.worker.store_fence = _stream_fence
        self.worker.layer_stream = torch.cuda.current_stream
        # vLLM names attention layers "model.layers.<i>.self_attn.attn"; wait_layer takes them by these names.
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
        self.worker.register_layer_names({n: i for i, n in enumerate(self.layer_names)})
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

    # Layer-wise: vLLM's calls for a request whose hit is loaded in the step that computes the rest.
    def match_layerwise(self, request_id: str, tokens: List[int]) -> int:
        """get_num_new_matched_tokens on the layer-wise scheduler: the hit, answered synchronous (vLLM schedules
        the request in this step); RuntimeError if it were answered asynchronous."""
        hit, asynchronous = self.sched_layerwise.get_num_new_matched_tokens(request_id, tokens, 0)
        if asynchronous:
            raise RuntimeError(f"{request_id}: the layer-wise scheduler answered ({hit}, True); expected a "
                               "synchronous hit (load_mode 'layerwise')")
        return hit or 0

    def start_layerwise(self, request_id: str, block_ids: List[int], n_tokens: int) -> None:
        """update_state_after_alloc, then the step's start_load_kv: pins the prefix and submits one load with a
        CUDA event per layer; returns once its copies are enqueued (the engine's stream may then wait on them)."""
        self.sched_layerwise.update_state_after_alloc(request_id, block_ids, n_tokens)
        meta = self.sched_layerwise.build_connector_meta()
        if [bool(getattr(s, "layerwise", False)) for s in meta.loads] != [True] or meta.stores:
            raise RuntimeError(f"{request_id}: the layer-wise scheduler planned loads "
                               f"{[getattr(s, 'layerwise', None) for s in meta.loads]} and {len(meta.stores)} "
                               "stores; expected one layer-wise load and no store")
        self.worker.start(meta)

    def wait_layer(self, layer: int) -> None:
        """vLLM's wait_for_layer_load before layer `layer`'s attention: the current stream waits on its event."""
        self.worker.wait_layer(self.layer_names[layer])

    def finish_layerwise(self, request_id: str, tokens: List[int], block_ids: List[int], n_tokens: int,
                         loaded_before: int) -> Dict[str, Any]:
        """The step's get_finished and get_block_ids_with_load_errors after the forward was launched (the worker
        waits for the step's layer-wise loads on the CPU there), reported to the scheduler; then the request ends.
        Returns {"errors": failed block ids, "loaded_blocks": blocks the worker counted loaded for it}."""
        sending, recving = self.worker.get_finished(set())
        errors = self.worker.take_load_errors()
        self.sched_layerwise.update_connector_output(sending, recving, errors)
        if recving:
            raise RuntimeError(f"{request_id}: a layer-wise load was reported in finished_recving {recving}; "
                               "expected it never to be (vLLM did not wait for it)")
        self.sched_layerwise.request_finished(request_id, tokens, block_ids, n_tokens)
        return {"errors": sorted(errors), "loaded_blocks": self.worker.stats.loaded_blocks - loaded_before}

    def close(self) -> None:
        self.sched.close()
        if self.sched_layerwise is not None:
            self.sched_layerwise.close()
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
    link = ConnectorLink(args, model, "hf-engine-B", layerwise=args.layerwise)
    bs = args.block_size
    # Warm up the kernels (the first prefill of a shape pays for their selection).
    for n in (256, 1024):
        model.forward(model.tokens(n, salt=7), model.new_cache())
    model.sync()
    rows = []
    for n in lengths:
        prompt = model.tokens(n, salt=n) + model.tokens(args.suffix, salt=n + 1)
        row: Dict[str, Any] = {"dtype": args.dtype, "prompt": n, "total": len(prompt), "block_size": bs,
                               "layers": args.layers}
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
        # The KV this process computes for the prefix: what the loaded blocks must hold, byte for byte.
        ref = model.new_cache()
        model.forward(prompt[:n], ref)
        # With the hit, through the connector, in alternating repeats: the whole load (match, load into fresh
        # blocks, gather, prefill the rest), then the layer-wise one (match, start the load, prefill the rest with
        # each layer's wait and gather right before it runs).
        phases: Dict[str, List[float]] = {"ttft": [], "match": [], "load": [], "gather": [], "rest": []}
        lw_phases: Dict[str, List[float]] = {"ttft": [], "match": [], "start": [], "forward": []}
        ids = list(range(model.num_blocks - (n // bs), model.num_blocks))  # other blocks than A used
        cached, cached_lw = 0, 0
        logits_hit, cache, logits_lw, cache_lw, first_hit, first_lw = None, None, None, None, -1, -1
        lw_end: Dict[str, Any] = {"errors": [], "loaded_blocks": 0}
        lw_filled: List[int] = []
        layerwise = link.sched_layerwise is not None
        hooks: List[Any] = []
        try:
            for rep in range(args.repeats):
                last = rep == args.repeats - 1
                for kv in model.kv:
                    kv.zero_()
                cache, cache_lw = None, None
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
                if last:  # the loaded KV must be exactly what this process computes for the prefix
                    row["kv_byte_exact"] = cached == n and model.blocks_equal_cache(ids[:n // bs], ref)
                if not layerwise:
                    continue
                for kv in model.kv:
                    kv.zero_()
                # the layer waits are part of the model in vLLM: hooked in outside the timed window, only here
                # (the whole path and the miss run without hooks)
                hooks = model.install_layer_hooks()
                model.sync()
                rid = f"B-{n}-{rep}-layerwise"
                loaded_before = link.worker.stats.loaded_blocks
                t0 = time.perf_counter()
                cached_lw = link.match_layerwise(rid, prompt)
                t1 = time.perf_counter()
                if cached_lw % bs:
                    raise RuntimeError(f"{rid}: a layer-wise hit of {cached_lw} tokens, not whole blocks of {bs}; "
                                       "expected the prefix's N tokens (--suffix >= 1)")
                blocks_lw = cached_lw // bs
                if blocks_lw:
                    link.start_layerwise(rid, ids[:blocks_lw], cached_lw)
                t2 = time.perf_counter()
                if blocks_lw:
                    cache_lw = model.begin_layerwise(ids[:blocks_lw], link.wait_layer)
                    try:
                        logits_lw = model.forward(prompt[cached_lw:], cache_lw)
                    finally:
                        lw_filled = model.end_layerwise()
                    # the step's get_finished: the worker waits (CPU) for the load while the forward runs
                    lw_end = link.finish_layerwise(rid, prompt, ids[:blocks_lw], cached_lw, loaded_before)
                else:  # no hit: a full prefill
                    cache_lw = model.new_cache()
                    logits_lw = model.forward(prompt, cache_lw)
                    lw_filled, lw_end = [], {"errors": [], "loaded_blocks": 0}
                first_lw = int(logits_lw.argmax().item())
                t3 = time.perf_counter()
                for h in hooks:
                    h.remove()
                hooks = []
                for name, ms in (("ttft", t3 - t0), ("match", t1 - t0), ("start", t2 - t1), ("forward", t3 - t2)):
                    lw_phases[name].append(ms * 1e3)
                if last:
                    row["lw_kv_byte_exact"] = cached_lw == n and model.blocks_equal_cache(ids[:n // bs], ref)
        finally:
            for h in hooks:  # (a forward that raised: the hooks go with it)
                h.remove()
        del ref
        row["cached_tokens"] = cached
        tokens_hit = model.greedy(logits_hit, cache, args.greedy)
        cache = None
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
        if layerwise:
            row["layerwise"] = True
            row["lw_cached_tokens"] = cached_lw
            row["lw_load_errors"] = len(lw_end["errors"])
            row["lw_loaded_blocks"] = lw_end["loaded_blocks"]
            row["lw_layers_filled"] = len(lw_filled)
            # every layer's cache: the prefix, then the suffix the attention appended
            row["lw_cache_complete"] = all(cache_lw.get_seq_length(i) == len(prompt) for i in range(args.layers))
            # the same bytes as the whole hit's logits: the same KV, the same computation
            row["lw_logits_equal_whole"] = bool(logits_lw.dtype == logits_hit.dtype and
                                                t.equal(logits_lw.view(t.int32), logits_hit.view(t.int32)))
            row["lw_argmax_equal"] = first_lw == first
            tokens_lw = model.greedy(logits_lw, cache_lw, args.greedy)
            row["lw_greedy_equal_whole"] = tokens_lw == tokens_hit
            for name, xs in lw_phases.items():
                row[f"lw_{name}_ms"] = _median(xs)
        cache_lw = None
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
    if not args.layerwise:
        base.append("--no-layerwise")
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
    return bool(good and (not r.get("layerwise") or layerwise_ok(r)))


def layerwise_ok(r: Dict[str, Any]) -> bool:
    """The layer-wise hit: the whole prefix hit and loaded (every block counted, none reported failed), every layer
    filled before it ran and holding prefix + suffix after the forward, the loaded KV byte-exact, the logits equal
    to the whole hit's bit for bit (the same KV bytes, the same computation: a layer that ran before its copies
    landed would differ), and the full prefill's first token."""
    return bool(r["lw_cached_tokens"] == r["prompt"] and r["lw_load_errors"] == 0 and
                r["lw_loaded_blocks"] == r["prompt"] // r["block_size"] and r["lw_layers_filled"] == r["layers"] and
                r["lw_cache_complete"] and r["lw_kv_byte_exact"] and r["lw_logits_equal_whole"] and
                r["lw_argmax_equal"])


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
        lw_rows = [r for r in b["rows"] if r.get("layerwise")]
        if lw_rows:
            print(f"\nTTFT with the hit, whole load vs layer-wise load ({dtype}, medians of {args.repeats}, "
                  "alternating repeats); layer-wise: each decoder layer waits (on the GPU stream) for its own "
                  "layer's copies and gathers its prefix right before it runs\n")
            print("| N | cached (whole / layer-wise) | TTFT whole ms | TTFT layer-wise ms | whole / layer-wise | "
                  "whole: match / load / gather / rest ms | layer-wise: match / start / forward ms | layer-wise "
                  "logits = whole (bits) | first token = full | KV byte-exact | layers filled | 32 greedy = whole "
                  "hit | ok |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for r in lw_rows:
                good = layerwise_ok(r)
                print(f"| {r['prompt']} | {r['cached_tokens']} / {r['lw_cached_tokens']} | {r['ttft_hit_ms']:.1f} | "
                      f"{r['lw_ttft_ms']:.1f} | {r['ttft_hit_ms'] / r['lw_ttft_ms']:.2f}x | {r['match_ms']:.1f} / "
                      f"{r['load_ms']:.1f} / {r['gather_ms']:.1f} / {r['rest_ms']:.1f} | {r['lw_match_ms']:.1f} / "
                      f"{r['lw_start_ms']:.1f} / {r['lw_forward_ms']:.1f} | {r['lw_logits_equal_whole']} | "
                      f"{r['lw_argmax_equal']} | {r['lw_kv_byte_exact']} | {r['lw_layers_filled']}"
                      f"{'' if r['lw_cache_complete'] else ' (cache incomplete)'}"
                      f"{'' if not r['lw_load_errors'] else ' (%d load errors)' % r['lw_load_errors']} | "
                      f"{r['lw_greedy_equal_whole']} | {'yes' if good else 'NO'} |")
        summary[dtype] = {"stored": a["stored"], "rows": b["rows"]}
        if lw_rows:
            summary[dtype]["whole_vs_layerwise"] = [
                {"prompt": r["prompt"], "ttft_whole_ms": r["ttft_hit_ms"], "ttft_layerwise_ms": r["lw_ttft_ms"],
                 "logits_equal": r["lw_logits_equal_whole"], "first_token_equal_full": r["lw_argmax_equal"],
                 "ok": layerwise_ok(r)} for r in lw_rows]
    print("summary: " + json.dumps({"ok": bool(ok), **summary}))
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    lengths = [int(x) for x in args.prompts.split(",") if x]
    bad = [n for n in lengths if n <= 0 or n % args.block_size]
    if bad:
        raise SystemExit(f"hf_prefix_reuse: prompt lengths {bad} are not positive multiples of --block-size "
                         f"{args.block_size}")
    if args.suffix < 1 or args.repeats < 1:
        raise SystemExit(f"hf_prefix_reuse: --suffix {args.suffix} and --repeats {args.repeats}; expected both >= 1 "
                         "(the hit prefills the suffix on top of the cached prefix)")
    if args.role == "driver":
        return run_driver(args, lengths)
    result = run_store(args, lengths) if args.role == "store" else run_load(args, lengths)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
