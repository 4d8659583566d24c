#!/usr/bin/env python3
"""Hybrid models reuse a prefix through flexkvd: Hugging Face gpt-oss and Qwen3-Next built from configs on the GPU.

The hybrid counterpart of hf_prefix_reuse.py (read that first). No weights can be downloaded where this runs, so
each model is built from its transformers config with few layers, a small hidden size, few experts and fixed-seed
random weights (every process that builds it gets the same weights):

  gpt-oss     GptOssForCausalLM: sliding-window (128 tokens) and full-attention layers alternating, attention
              sinks, MoE. flexkvd geometry: FULL = the full-attention layers, SLIDING_WINDOW = the sliding layers.
  qwen3-next  Qwen3NextForCausalLM: three Gated-DeltaNet (linear attention) layers per full-attention layer, MoE.
              flexkvd geometry: FULL = the full-attention layers, STATE = per linear layer its conv state and its
              recurrent state, packed back to back (padded to 16 bytes) in one state slot.

The engine's memory is kept as vLLM keeps it: per full or sliding layer a paged tensor [2, num_blocks, block_size,
kv_heads, head_dim] (the sliding layers' tensors are the window component's), per linear layer a state tensor
[num_slots, state_bytes] (uint8); each component's tensors are registered with flexkvd as that component
(LAYER_FIRST). HF's attention needs a contiguous cache, so after a load the engine rebuilds the HF cache from the
paged blocks: full layers from every block, sliding layers from the window blocks, linear layers from the state
slot (the "gather" phase).

Two engine processes per model, one after the other, against a fresh flexkvd:
  A (--role store): for each prompt length N prefills N tokens, writes the full layers' KV of every block, the
    sliding layers' KV of the window's blocks and the linear layers' states at N into its paged memory, and stores
    them (one state boundary at N, the trailing window).
  B (--role load): the prompt is A's N tokens plus a new turn (--suffix tokens). Miss: a full prefill. Hit: match,
    load into other block ids and another state slot, rebuild the HF cache, prefill only the suffix. Checked: the
    loaded blocks and state equal, byte for byte, what B computes itself for the prefix; the rebuilt HF cache equals
    the HF cache B's own prefix prefill leaves (every tensor, the sequence lengths); the hit's logits equal, exactly,
    a split prefill's (prefix, then suffix, in this process, no flexkvd); its first token equals the full prefill's
    (unless the full prefill's top two are closer than the split's own rounding). A second variant holds the first
    half of the prefix's blocks on the GPU already and loads only the rest (first_block): its logits must equal the
    whole load's, with only the missing blocks moved.
  TTFT (prompt in, first token's argmax on the host), median of --repeats: miss, and hit split into match / load /
    gather / rest. Layer-wise (where the link loads layer by layer: the connector with load_mode "layerwise", or
    the client with a layer-event set): the forward starts once the load is launched, each decoder layer's
    pre-hook makes the stream wait for that layer's copies (its index in the geometry's layer order: the states
    first, then the attention layers by depth) and puts its prefix into the HF cache; its logits must equal the
    whole load's exactly. Beside it, a bare layer-wise load (progress completions, nothing computed): its time and
    when its last layer landed.

How the engine talks to flexkvd (--link): "connector" drives the vLLM connector's logic classes with per-group block
ids (SchedulerLogic / WorkerLogic with GroupMap: needs a flexkvd whose connector is SupportsHMA); "client" uses the
plain client (match with pin, load with per-component ids and first_block, store with state boundaries); "auto"
(default) takes the connector when it has KV cache groups, else the client, and says which.

The model side (configs, the HF cache as this transformers version keeps it, the paged memory, the rebuild) is
hf_hybrid_model.py beside this file.

Diagnostics: every process prints the transformers cache class it got, each layer's kind and what it holds after a
prefill (shapes, dtypes, attributes), the geometry, and whether a multi-token prefill continues a linear-attention
state (some transformers versions restart the state for a multi-token step; then the suffix runs token by token,
and the row says so). The driver prints a table per model and a `summary: {json}` line; it exits non-zero when any
check failed.

  python3 examples/hf_hybrid_reuse.py --flexkvd build/flexkvd --models gpt-oss,qwen3-next --prompts 4096,32768
(PYTHONPATH=python and FLEXKV_LIBRARY=build/libflexkv.so.0 in a build tree; needs torch with CUDA and transformers 5.)
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import flexkvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_hybrid_model import HybridModel, log  # noqa: E402

MODELS = ("gpt-oss", "qwen3-next")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["driver", "store", "load"], default="driver")
    ap.add_argument("--model", choices=MODELS, default="gpt-oss", help="store/load: the model")
    ap.add_argument("--models", default=",".join(MODELS), help="driver: the models to run, each with a fresh daemon")
    ap.add_argument("--socket", default=None, help="a running flexkvd's socket (driver: else it starts one)")
    ap.add_argument("--flexkvd", default=os.environ.get("FLEXKVD", "build/flexkvd"), help="driver: daemon binary")
    ap.add_argument("--pool-size", default="6GiB", help="driver: the daemon's pool (on /dev/shm)")
    ap.add_argument("--prompts", default="4096,8192,16384,32768", help="prompt lengths N (tokens)")
    ap.add_argument("--suffix", type=int, default=64, help="tokens of the new turn after the cached prefix")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case (median reported)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--experts", type=int, default=4, help="MoE experts (2 routed per token)")
    ap.add_argument("--sliding-window", type=int, default=128, help="gpt-oss: the sliding layers' window (tokens)")
    ap.add_argument("--chunk", type=int, default=2048,
                    help="gpt-oss: prefill chunk (tokens); its eager attention (the sinks) materialises chunk x N "
                    "scores")
    ap.add_argument("--suffix-mode", choices=["auto", "multi", "token"], default="auto",
                    help="how the suffix runs on a loaded linear-attention state: one forward, token by token, or as "
                    "the continuation self-test finds right")
    ap.add_argument("--link", choices=["auto", "connector", "client"], default="auto")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (vLLM's block_size)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=None, help="store/load: write the JSON results here")
    ap.add_argument("--log-dir", default=None, help="driver: where the daemon's logs go (default: a temporary "
                    "directory)")
    return ap.parse_args(argv)


# ---- the engine's link to flexkvd --------------------------------------------------------------------------------

class _LinkBase:
    """What both links share: a probe of a layer-wise load of this geometry."""

    model: HybridModel

    def probe_layerwise(self, client: flexkvd.Client, prompt: List[int], groups: List[List[int]]) -> Dict[str, Any]:
        """A layer-wise load (progress completions) of the prompt's hit into these blocks, nothing computed: when
        each layer of the geometry's layer order landed and when the load ended, or the refusal."""
        m = self.model
        keys = flexkvd.block_keys(self.namespace, self._keyed(prompt), m.args.block_size)
        hit = client.match(keys, pin=True).wait(timeout=10.0)
        e = hit.matched_blocks
        if not e:
            return {"ok": False, "refused": "no hit to load"}
        try:
            t0 = time.perf_counter()
            ticket = client.load(hit.match_handle, m.component_ids(groups, 0, e), layerwise=True)
            arrivals = []
            for layer in range(m.geometry().total_layers):
                ticket.wait_layers(layer + 1, timeout=10.0)
                arrivals.append((time.perf_counter() - t0) * 1e3)
            ticket.wait(timeout=10.0)
            return {"ok": True, "layer_ms": arrivals, "load_ms": (time.perf_counter() - t0) * 1e3}
        except flexkvd.Error as err:
            return {"ok": False, "refused": f"{type(err).__name__}: {err}"}
        finally:
            client.release(hit.match_handle).wait(timeout=10.0)

    def _keyed(self, tokens: List[int]) -> List[int]:
        """The tokens keyed for a lookup: with a state component the last one is left out (an engine recomputes the
        last prompt token, which must not run twice on a loaded state)."""
        return tokens[:-1] if self.model.states else tokens


def register_components(client: flexkvd.Client, model: Any) -> List[memoryview]:
    """Registers every component's buffers with the session: the model's GPU tensors (LAYER_FIRST, one per layer),
    or, for a model whose components have no tensors (None: no GPU, as the tests run the links), host KV in memory
    shared with the daemon; returns those host buffers (component order), or [] for GPU tensors."""
    views = []
    for c, (kind, tensors, nb) in enumerate(model.components()):
        if tensors is None:
            views.append(client.create_host_kv(flexkvd.Layout.LAYER_FIRST, nb, component=c))
        else:
            client.register_gpu_kv(tensors, flexkvd.Layout.LAYER_FIRST, nb, component=c)
    return views


class ClientLink(_LinkBase):
    """The plain flexkvd client, as an engine without the connector would use it."""

    kind = "client"
    layerwise = True  # start_layerwise / end_layerwise: loads naming a layer-event set

    def __init__(self, args: argparse.Namespace, model: HybridModel, name: str) -> None:
        self.model, self.namespace = model, model.namespace()
        self.client = flexkvd.connect(args.socket, timeout=5.0)
        self.client.attach(name, self.namespace, model.geometry())
        self.host_views = register_components(self.client, model)
        self._pins: Dict[str, Tuple[int, int]] = {}
        self.moved = {"blocks": 0, "bytes": 0}

    def store(self, rid: str, tokens: List[int], groups: List[List[int]]) -> Dict[str, int]:
        m = self.model
        e = len(tokens) // m.args.block_size
        ids = [groups[0][:e]]
        c = 1
        if m.window_kv:
            ids.append(groups[c][max(0, e - m.window_blocks):e])
            c += 1
        if m.states:
            ids.append([groups[c][e - 1]])
        keys = flexkvd.block_keys(self.namespace, tokens, m.args.block_size)
        r = self.client.store(keys, ids, state_boundaries=[e] if m.states else None).wait(timeout=60.0)
        return {"stored_blocks": r.done_blocks, "stored_bytes": r.bytes}

    def match(self, rid: str, prompt: List[int], local_tokens: int) -> int:
        bs = self.model.args.block_size
        keys = flexkvd.block_keys(self.namespace, self._keyed(prompt), bs)
        r = self.client.match(keys, pin=True).wait(timeout=10.0)
        if r.matched_blocks * bs <= local_tokens:
            if r.match_handle:
                self.client.release(r.match_handle).wait(timeout=10.0)
            return 0
        self._pins[rid] = (r.match_handle, r.matched_blocks)
        return r.matched_blocks * bs - local_tokens

    def load(self, rid: str, prompt: List[int], groups: List[List[int]], local_tokens: int, hit: int) -> bool:
        handle, e = self._pins.pop(rid)
        first = local_tokens // self.model.args.block_size
        try:
            r = self.client.load(handle, self.model.component_ids(groups, first, e), first_block=first).wait(60.0)
            self.moved = {"blocks": r.done_blocks, "bytes": r.bytes}
            return r.done_blocks == e - first
        finally:
            self.client.release(handle).wait(timeout=10.0)

    def probe(self, prompt: List[int], groups: List[List[int]]) -> Dict[str, Any]:
        return self.probe_layerwise(self.client, prompt, groups)

    def start_layerwise(self, rid: str, prompt: List[int], groups: List[List[int]]) -> Optional[Any]:
        """Match, then a load naming the session's layer-event set; once launched, returns wait(li): the current
        stream waits for model layer li's event (its index in the geometry's layer order). None without a hit."""
        import torch
        m = self.model
        keys = flexkvd.block_keys(self.namespace, self._keyed(prompt), m.args.block_size)
        hit = self.client.match(keys, pin=True).wait(timeout=10.0)
        if not hit.matched_blocks:
            return None
        if getattr(self, "events", None) is None:
            self.events = self.client.layer_events(m.geometry().total_layers)
        index = {step: i for i, step in enumerate(m.geometry().layer_order())}
        self._lw = (hit.match_handle, self.client.load(hit.match_handle, m.component_ids(groups, 0,
                                                                                        hit.matched_blocks),
                                                       event_set=self.events))
        self._lw[1].wait_launched(timeout=10.0)
        return lambda li: self.events.wait(index[m.layer_component(li)], torch.cuda.current_stream())

    def end_layerwise(self, rid: str, prompt: List[int], groups: List[List[int]], hit: int) -> bool:
        handle, ticket = self._lw
        try:
            r = ticket.wait(timeout=60.0)
            self.moved = {"blocks": r.done_blocks, "bytes": r.bytes}
            return r.done_blocks == hit // self.model.args.block_size  # every block of the hit came
        except flexkvd.Error:
            return False
        finally:
            self.client.release(handle).wait(timeout=10.0)

    def close(self) -> None:
        if getattr(self, "events", None) is not None:
            self.events.close()
        self.client.close()


class ConnectorLink(_LinkBase):
    """The vLLM connector's two sides (SchedulerLogic + WorkerLogic) with KV cache groups (GroupMap), driven with
    the calls vLLM makes for one request at a time; the worker registers every component's paged tensors."""

    kind = "connector"

    def __init__(self, args: argparse.Namespace, model: HybridModel, name: str) -> None:
        from flexkvd.geometry import ComponentKind
        from flexkvd.integrations._vllm_groups import GroupMap, GroupSlot
        from flexkvd.integrations.vllm import ConnectorConfig, LinkOptions, SchedulerLogic, WorkerLogic
        self.model, self.namespace = model, model.namespace()
        geometry = model.geometry()
        slots = [GroupSlot(0, 0, ComponentKind.FULL)]
        if model.window_kv:
            slots.append(GroupSlot(len(slots), len(slots), ComponentKind.SLIDING_WINDOW, model.window_blocks))
        if model.states:
            slots.append(GroupSlot(len(slots), len(slots), ComponentKind.STATE))
        cfg = ConnectorConfig(namespace=self.namespace, geometry=geometry,
                              link=LinkOptions(socket=args.socket, connect_timeout_s=5.0), op_timeout_s=10.0,
                              name=name, groups=GroupMap(slots, geometry))
        # What the connector does with load_mode "layerwise" for this geometry: a second scheduler side with it,
        # over the same worker (as vLLM's adapter runs it by default), when it loads layer by layer.
        lw = dataclasses.replace(cfg, load_mode="layerwise", name=f"{name}-layerwise") \
            if "load_mode" in {f.name for f in dataclasses.fields(cfg)} else None
        self.connector_layerwise = bool(getattr(lw, "layerwise", False)) if lw is not None else None
        self.sched = SchedulerLogic(cfg)
        self.sched_layerwise = SchedulerLogic(lw) if self.connector_layerwise and model.full_kv is not None else None
        self.layerwise = self.sched_layerwise is not None
        sync = None
        if model.full_kv is not None:  # GPU tensors: stores wait for the engine's writes
            import torch
            sync = torch.cuda.synchronize
        self.worker = WorkerLogic(cfg, sync=sync)
        self.host_views: List[memoryview] = []
        if model.full_kv is None:  # no GPU (the tests): the worker's host KV, every component of num_blocks blocks
            self.worker.create_host_kv(model.num_blocks)
            self.host_views = [self.worker.host_kv(c) for c in range(geometry.component_count)]
        else:
            # Every component's tensors (rank 0 of TP 1), registered by the worker at each attach, as the vLLM
            # adapter's register_kv_caches registers each KV cache group's.
            self.worker.register_kv([self.worker.describe_kv(nb, tensors, component=c)
                                     for c, (_, tensors, nb) in enumerate(model.components())])
        if self.sched_layerwise is not None:
            import torch
            from flexkvd.integrations._vllm_layerwise import layer_order_names
            self.worker.layer_stream = torch.cuda.current_stream  # as the vLLM adapter sets it
            # vLLM names the layers "model.layers.<i>...": every component's, in the load's layer order.
            names: List[List[str]] = [[] for _ in range(geometry.component_count)]
            for li in sorted(model.component_of):
                c, _ = model.layer_component(li)
                names[c].append(f"model.layers.{li}")
            self.worker.register_layer_names(layer_order_names(geometry, names))
        self.moved = {"blocks": 0, "bytes": 0}

    def _step(self, finished: set) -> Tuple[set, set, set]:
        self.worker.start(self.sched.build_connector_meta())
        if not self.worker.wait_all(timeout=60.0):
            raise RuntimeError("flexkvd did not finish a load or store within 60 s")
        sending, recving = self.worker.get_finished(finished)
        errors = self.worker.take_load_errors()
        self.sched.update_connector_output(sending, recving, errors)
        return sending or set(), recving or set(), errors

    def store(self, rid: str, tokens: List[int], groups: List[List[int]]) -> Dict[str, int]:
        before = dict(self.worker.stats.as_dict())
        hit, _ = self.sched.get_num_new_matched_tokens(rid, tokens, 0)
        if hit:
            raise RuntimeError(f"{rid}: flexkvd already holds {hit} tokens of a prompt A stores first")
        if not self.sched.request_finished(rid, tokens, groups, len(tokens)):
            raise RuntimeError(f"{rid}: the connector planned no store (daemon unreachable, or the window blocks "
                               f"before the end missing: stats {self.sched.stats})")
        sending, _, _ = self._step({rid})
        if rid not in sending:
            raise RuntimeError(f"{rid}: the store was not reported finished")
        after = self.worker.stats.as_dict()
        delta = {k: after[k] - before.get(k, 0) for k in ("stored_blocks", "stored_bytes", "store_failures")}
        if delta["store_failures"]:
            raise RuntimeError(f"{rid}: the store failed ({delta})")
        return delta

    def match(self, rid: str, prompt: List[int], local_tokens: int) -> int:
        for _ in range(2000):
            hit, _ = self.sched.get_num_new_matched_tokens(rid, prompt, local_tokens)
            if hit is not None:
                return hit
            time.sleep(0.0005)
        raise RuntimeError(f"{rid}: the connector's lookup did not answer")

    def load(self, rid: str, prompt: List[int], groups: List[List[int]], local_tokens: int, hit: int) -> bool:
        if hit == 0:
            return False
        before = dict(self.worker.stats.as_dict())
        self.sched.update_state_after_alloc(rid, groups, hit)
        _, recving, errors = self._step(set())
        self.sched.request_finished(rid, prompt, groups, local_tokens + hit)
        after = self.worker.stats.as_dict()
        self.moved = {"blocks": after["loaded_blocks"] - before.get("loaded_blocks", 0),
                      "bytes": after["loaded_bytes"] - before.get("loaded_bytes", 0)}
        return rid in recving and not errors

    def start_layerwise(self, rid: str, prompt: List[int], groups: List[List[int]]) -> Optional[Any]:
        """vLLM's calls for a layer-wise hit: the lookup answers (hit, not async), the blocks are allocated,
        start_load_kv pins and submits the load (its states waited for before the forward); returns wait(li), the
        worker's wait_for_layer_load of model layer li. None without a hit."""
        for _ in range(2000):
            hit, asynchronous = self.sched_layerwise.get_num_new_matched_tokens(rid, prompt, 0)
            if hit is not None:
                break
            time.sleep(0.0005)
        if not hit:
            return None
        if asynchronous:
            raise RuntimeError(f"{rid}: load_mode 'layerwise' answered an asynchronous hit")
        self._lw_before = dict(self.worker.stats.as_dict())
        self.sched_layerwise.update_state_after_alloc(rid, groups, hit)
        self.worker.start(self.sched_layerwise.build_connector_meta())
        return lambda li: self.worker.wait_layer(f"model.layers.{li}")

    def end_layerwise(self, rid: str, prompt: List[int], groups: List[List[int]], hit: int) -> bool:
        """get_finished (the step's layer-wise loads waited for and judged), then the request ends."""
        before = self._lw_before
        sending, recving = self.worker.get_finished(set())
        errors = self.worker.take_load_errors()
        self.sched_layerwise.update_connector_output(sending, recving, errors)
        self.sched_layerwise.request_finished(rid, prompt, groups, hit)
        after = self.worker.stats.as_dict()
        self.moved = {"blocks": after["loaded_blocks"] - before.get("loaded_blocks", 0),
                      "bytes": after["loaded_bytes"] - before.get("loaded_bytes", 0)}
        return not errors

    def probe(self, prompt: List[int], groups: List[List[int]]) -> Dict[str, Any]:
        client = self.worker.link.client()
        if client is None:
            return {"ok": False, "refused": "the worker's session is not attached"}
        out = self.probe_layerwise(client, prompt, groups)
        out["connector_load_mode_layerwise_loads_layerwise"] = self.connector_layerwise
        return out

    def close(self) -> None:
        self.sched.close()
        if self.sched_layerwise is not None:
            self.sched_layerwise.close()
        self.worker.close()


def make_link(args: argparse.Namespace, model: HybridModel, name: str) -> _LinkBase:
    """The link --link asks for; "auto": the connector when it takes KV cache groups, else the client."""
    want = args.link
    if want in ("auto", "connector"):
        try:
            importlib.import_module("flexkvd.integrations._vllm_groups")  # the connector's KV cache groups
            from flexkvd.integrations.vllm import ConnectorConfig
            has_groups = "groups" in {f.name for f in dataclasses.fields(ConnectorConfig)}
            why = "" if has_groups else "ConnectorConfig has no groups field"
        except ImportError as err:
            has_groups, why = False, f"{err}"
        if has_groups:
            link = ConnectorLink(args, model, name)
            log("link: the vLLM connector's logic with KV cache groups (SchedulerLogic/WorkerLogic, GroupMap)")
            return link
        if want == "connector":
            raise SystemExit(f"hf_hybrid_reuse: --link connector, but this flexkvd's vLLM connector has no KV cache "
                             f"groups ({why}); use --link client")
        log(f"link: the plain flexkvd client (the vLLM connector has no KV cache groups here: {why})")
    return ClientLink(args, model, name)


# ---- the engine processes ------------------------------------------------------------------------------------

def _median(xs: List[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def run_store(args: argparse.Namespace, lengths: List[int]) -> Dict[str, Any]:
    """Engine A: prefill each prompt, write its paged blocks and states, store them."""
    model = HybridModel(args, max(lengths))
    model.allocate(max(lengths))
    log(f"geometry {model.geometry()}, namespace {model.namespace()!r}")
    link = make_link(args, model, "hf-engine-A")
    bs = args.block_size
    stored = {}
    for n in lengths:
        tokens = model.tokens(n, salt=n)
        cache, rec = model.recording_cache()
        model.prefill(tokens, cache)
        e = n // bs
        full_ids = list(range(1, e + 1))
        window_ids = list(range(1, min(model.window_blocks, e) + 1)) if model.window_kv else []
        model.write_prefix(rec, cache, e, full_ids, window_ids, 1)
        stored[str(n)] = link.store(f"A-{n}", tokens, model.groups(e, full_ids, window_ids, 1))
        log(f"stored N={n}: {stored[str(n)]}")
        del cache, rec
    link.close()
    return {"role": "store", "fingerprint": model.fingerprint, "versions": model.versions, "stored": stored,
            "link": link.kind}


def run_load(args: argparse.Namespace, lengths: List[int]) -> Dict[str, Any]:
    """Engine B: each prompt (A's tokens + a new turn) with and without the prefix from flexkvd."""
    model = HybridModel(args, max(lengths))
    model.allocate(max(lengths))
    t = model.torch
    link = make_link(args, model, "hf-engine-B")
    bs = args.block_size
    for n in (256, 1024):  # kernels' first use
        model.prefill(model.tokens(n, salt=7), model.new_cache())
    model.sync()
    hooks = model.install_layer_hooks() if getattr(link, "layerwise", False) else []
    rows = []
    for n in lengths:
        prompt = model.tokens(n, salt=n) + model.tokens(args.suffix, salt=n + 1)
        e = n // bs
        row: Dict[str, Any] = {"model": args.model, "prompt": n, "total": len(prompt), "link": link.kind,
                               "suffix_steps": "one" if model.continuation_multi or not model.states else "per token"}
        miss_ms, logits_full = [], None
        for _ in range(args.repeats):
            model.sync()
            t0 = time.perf_counter()
            logits_full = model.prefill(prompt, model.new_cache())
            first = int(logits_full.argmax().item())
            miss_ms.append((time.perf_counter() - t0) * 1e3)
        ref, rec = model.recording_cache()
        model.prefill(prompt[:n], ref)
        nb, nw = model.num_blocks, model.num_window_blocks
        full_ids = list(range(nb - e, nb))
        window_ids = list(range(nw - min(model.window_blocks, e), nw)) if model.window_kv else []
        slot = 2
        groups = model.groups(e, full_ids, window_ids, slot)
        phases: Dict[str, List[float]] = {"ttft": [], "match": [], "load": [], "gather": [], "rest": []}
        cached, logits_hit, first_hit = 0, None, -1
        for rep in range(args.repeats):
            model.zero_paged()
            model.sync()
            t0 = time.perf_counter()
            hit = link.match(f"B-{n}-{rep}", prompt, 0)
            t1 = time.perf_counter()
            ok = link.load(f"B-{n}-{rep}", prompt, groups, 0, hit)
            t2 = time.perf_counter()
            cached = hit if ok else 0
            if cached != n:
                raise RuntimeError(f"N={n}: the hit covers {hit} tokens, load ok={ok}; expected the whole prefix "
                                   f"{n} (stored by engine A)")
            cache = model.rebuild(e, full_ids, window_ids, slot)
            model.sync()
            t3 = time.perf_counter()
            logits_hit = model.prefill(prompt[n:], cache, past=n)
            first_hit = int(logits_hit.argmax().item())
            t4 = time.perf_counter()
            for name, ms in (("ttft", t4 - t0), ("match", t1 - t0), ("load", t2 - t1), ("gather", t3 - t2),
                             ("rest", t4 - t3)):
                phases[name].append(ms * 1e3)
            del cache
        row["cached_tokens"] = cached
        row["load_bytes"] = link.moved["bytes"]
        # Layer-wise: the forward starts once the load is launched; each decoder layer waits for its own copies
        # (its index in the geometry's layer order) and puts its prefix in just before it runs.
        lw_ms, lw_ok, lw_first = [], bool(hooks), -1
        for rep in range(args.repeats if hooks else 0):
            model.zero_paged()
            model.sync()
            rid = f"B-{n}-lw{rep}"
            t0 = time.perf_counter()
            wait = link.start_layerwise(rid, prompt, groups)
            if wait is None:
                raise RuntimeError(f"N={n}: no hit for the layer-wise load")
            cache = model.begin_layerwise(e, full_ids, window_ids, slot, wait)
            logits_lw = model.prefill(prompt[n:], cache, past=n)
            lw_first = int(logits_lw.argmax().item())
            lw_ms.append((time.perf_counter() - t0) * 1e3)
            filled = model.end_layerwise()
            loaded = link.end_layerwise(rid, prompt, groups, n)
            lw_ok &= bool(loaded and filled == sorted(model.component_of) and t.equal(logits_lw, logits_hit))
            del cache
        row["ttft_layerwise_ms"] = _median(lw_ms) if lw_ms else None
        row["layerwise_ok"] = lw_ok if hooks else None
        row["layerwise_argmax"] = lw_first
        row["block_diffs"] = model.blocks_equal(rec, ref, e, full_ids, window_ids, slot)
        rebuilt = model.rebuild(e, full_ids, window_ids, slot)
        row["cache_diffs"] = model.compare_caches(rebuilt, ref)
        del rebuilt
        logits_split = model.prefill(prompt[n:], ref, past=n)
        del ref
        # The engine holds the first half of the prefix already: only blocks k.. move.
        k = e // 2
        model.zero_paged()
        model.write_prefix(rec, None, e, full_ids[:k], [], -1)
        hit2 = link.match(f"B-{n}-fb", prompt, k * bs)
        ok2 = link.load(f"B-{n}-fb", prompt, groups, k * bs, hit2)
        row["fb_local_blocks"], row["fb_hit_tokens"], row["fb_loaded_blocks"] = k, hit2, link.moved["blocks"]
        row["fb_load_bytes"] = link.moved["bytes"]
        cache = model.rebuild(e, full_ids, window_ids, slot)
        logits_fb = model.prefill(prompt[n:], cache, past=n)
        del cache, rec
        row["fb_ok"] = bool(ok2 and hit2 == n - k * bs and t.equal(logits_fb, logits_hit))
        row["layerwise"] = link.probe(prompt, groups)
        row["argmax_equal"] = first_hit == first
        row["hit_logits_equal_local_split"] = bool(t.equal(logits_hit, logits_split))
        row["hit_logit_maxdiff"] = float((logits_hit - logits_full).abs().max().item())
        row["split_logit_maxdiff"] = float((logits_split - logits_full).abs().max().item())
        top2 = logits_full.topk(2).values
        row["full_top2_margin"] = float((top2[0] - top2[1]).item())
        row["logit_absmax"] = float(logits_full.abs().max().item())
        row["ttft_miss_ms"] = _median(miss_ms)
        for name, xs in phases.items():
            row[f"{name}_ms" if name != "ttft" else "ttft_hit_ms"] = _median(xs)
        row["load_gbps"] = row["load_bytes"] / (row["load_ms"] / 1e3) / 1e9 if row["load_ms"] > 0 else 0.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    for h in hooks:
        h.remove()
    link.close()
    return {"role": "load", "fingerprint": model.fingerprint, "versions": model.versions, "rows": rows,
            "gpu": t.cuda.get_device_name(0), "context_effect": getattr(model, "context_effect", None),
            "geometry": str(model.geometry()), "link": link.kind}


class Daemon:
    """A flexkvd of the driver's own (pool on /dev/shm, log in --log-dir), stopped on exit."""

    def __init__(self, args: argparse.Namespace, tmp: str, tag: str) -> None:
        self.socket = os.path.join(tmp, f"flexkvd-{tag}.sock")
        self.pool_dir = f"/dev/shm/hf-hybrid-reuse-{os.getpid()}-{tag}"
        os.makedirs(self.pool_dir, exist_ok=True)
        self.log_path = os.path.join(args.log_dir or tmp, f"flexkvd-{tag}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([args.flexkvd, "--socket", self.socket, "--pool-path", f"{self.pool_dir}/pool",
                                      "--pool-size", args.pool_size], stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(400):
            if os.path.exists(self.socket) or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if self.proc.poll() is not None or not os.path.exists(self.socket):
            self.close()
            print(open(self.log_path).read(), file=sys.stderr)
            raise SystemExit(f"hf_hybrid_reuse: flexkvd did not start on {self.socket}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.log.close()
        subprocess.call(["rm", "-rf", self.pool_dir])


def run_pair(args: argparse.Namespace, socket: str, model: str, lengths: List[int],
             tmp: str) -> Optional[List[Dict[str, Any]]]:
    """Engine process A (store) then B (load) for one model; their results, or None when one failed."""
    base = [sys.executable, os.path.abspath(__file__), "--socket", socket, "--model", model, "--prompts",
            ",".join(str(n) for n in lengths)]
    for flag in ("suffix", "repeats", "layers", "hidden", "vocab", "experts", "sliding_window", "chunk", "suffix_mode",
                 "link", "block_size", "seed", "dtype"):
        base += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    results = []
    for role in ("store", "load"):
        out = os.path.join(tmp, f"{model}-{role}.json")
        print(f"== {model}: engine process {'A' if role == 'store' else 'B'} ({role})", flush=True)
        rc = subprocess.call(base + ["--role", role, "--out", out], env=dict(os.environ, HF_HYBRID_ROLE=role))
        if rc != 0:
            print(f"hf_hybrid_reuse: the {model} {role} process exited with {rc}", file=sys.stderr)
            return None
        with open(out) as f:
            results.append(json.load(f))
    return results


def row_ok(r: Dict[str, Any]) -> bool:
    """What must hold: the whole prefix hit; the loaded blocks and states byte-exact (the engine's own bytes); the
    rebuilt HF cache equal to the one the engine's own prefix prefill leaves; the hit's logits exactly the local split
    prefill's; the first token the full prefill's unless its top two are closer than the split's rounding; the
    first_block load moving only the missing blocks and giving the same logits; the layer-wise forward's logits
    exactly the whole load's, every layer put in (where the link loads layer by layer)."""
    argmax_ok = r["argmax_equal"] or r["full_top2_margin"] <= r["split_logit_maxdiff"]
    return bool(r["cached_tokens"] == r["prompt"] and not r["block_diffs"] and not r["cache_diffs"]
                and r["hit_logits_equal_local_split"] and argmax_ok and r["fb_ok"]
                and r.get("layerwise_ok") is not False
                and r["fb_loaded_blocks"] == r["prompt"] // r["block_size"] - r["fb_local_blocks"])


def _layerwise_cell(r: Dict[str, Any]) -> str:
    """TTFT with a layer-wise load (logits equal to the whole load's: yes/NO), and the bare layer-wise load."""
    lw = r["layerwise"]
    probe = f"{lw['load_ms']:.1f} (last layer at {lw['layer_ms'][-1]:.1f})" if lw.get("ok") else \
        f"failed: {lw.get('refused')}"
    if r.get("ttft_layerwise_ms") is None:
        return f"- / {probe}"
    return f"{r['ttft_layerwise_ms']:.1f} ({'same logits' if r['layerwise_ok'] else 'NO'}) / {probe}"


def run_driver(args: argparse.Namespace, lengths: List[int]) -> int:
    tmp = tempfile.mkdtemp(prefix="hf-hybrid-reuse-")
    ok = True
    summary: Dict[str, Any] = {}
    for name in [m for m in args.models.split(",") if m]:
        if name not in MODELS:
            raise SystemExit(f"hf_hybrid_reuse: --models has {name!r}; expected some of {list(MODELS)}")
        daemon = Daemon(args, tmp, name) if args.socket is None else None
        try:
            results = run_pair(args, args.socket or daemon.socket, name, lengths, tmp)
        finally:
            if daemon is not None:
                daemon.close()
        if results is None:
            ok = False
            summary[name] = {"error": "an engine process failed (its output above says why)"}
            continue
        a, b = results
        if a["fingerprint"] != b["fingerprint"]:
            print(f"weights differ between the processes: {a['fingerprint']} vs {b['fingerprint']}")
            ok = False
        refusal = next((r["layerwise"].get("refused") for r in b["rows"] if not r["layerwise"].get("ok")), None)
        print(f"\n{b['gpu']}, {b['versions']}; {name}, {args.layers} layers, hidden {args.hidden}, {args.experts} "
              f"experts, {args.dtype}, random weights (seed {args.seed}); geometry {b['geometry']}; link "
              f"{b['link']}; prompt = N cached tokens + {args.suffix} new; medians of {args.repeats}; context "
              f"effect on the last logits {b['context_effect']}\n")
        print("| N | cached | TTFT full prefill ms | TTFT hit (whole load) ms | speedup | match / load / gather / rest "
              "ms | load GB/s | TTFT hit (layer-wise load) ms / bare layer-wise load ms | bytes exact | HF cache rebuilt exact | hit = local split "
              "logits | argmax | first_block: local / loaded blocks, same logits | max logit diff vs full: hit / "
              "split (top-2 margin) | suffix steps | ok |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in b["rows"]:
            r["block_size"] = args.block_size
            good = row_ok(r)
            ok &= good
            print(f"| {r['prompt']} | {r['cached_tokens']} | {r['ttft_miss_ms']:.1f} | {r['ttft_hit_ms']:.1f} | "
                  f"{r['ttft_miss_ms'] / r['ttft_hit_ms']:.1f}x | {r['match_ms']:.1f} / {r['load_ms']:.1f} / "
                  f"{r['gather_ms']:.1f} / {r['rest_ms']:.1f} | {r['load_gbps']:.1f} | "
                  f"{_layerwise_cell(r)} | {not r['block_diffs'] or r['block_diffs'][:3]} | "
                  f"{not r['cache_diffs'] or r['cache_diffs'][:3]} | {r['hit_logits_equal_local_split']} | "
                  f"{r['argmax_equal']} | {r['fb_local_blocks']} / {r['fb_loaded_blocks']}, {r['fb_ok']} | "
                  f"{r['hit_logit_maxdiff']:.3g} / {r['split_logit_maxdiff']:.3g} ({r['full_top2_margin']:.3g}) | "
                  f"{r['suffix_steps']} | {'yes' if good else 'NO'} |")
        if refusal:
            print(f"\nlayer-wise load of this hybrid geometry: {refusal}")
        summary[name] = {"stored": a["stored"], "rows": b["rows"], "link": b["link"], "versions": b["versions"],
                         "gpu": b["gpu"]}
    print("summary: " + json.dumps({"ok": bool(ok), **summary}))
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    lengths = [int(x) for x in args.prompts.split(",") if x]
    bad = [n for n in lengths if n <= 0 or n % args.block_size]
    if bad:
        raise SystemExit(f"hf_hybrid_reuse: prompt lengths {bad} are not positive multiples of --block-size "
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
