"""The model side of hf_hybrid_reuse.py: a Hugging Face hybrid model (gpt-oss or Qwen3-Next) built from its config
with fixed-seed random weights, what its HF cache holds per layer (read from the cache objects themselves, so that
the transformers version's cache classes are followed, not assumed), the engine's paged memory as vLLM keeps it, and
the HF cache rebuilt from that paged memory. See hf_hybrid_reuse.py's docstring.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import flexkvd

NULL_BLOCK = 0  # vLLM's null block: a position a window or state group does not hold


def log(msg: str) -> None:
    print(f"[{os.environ.get('HF_HYBRID_ROLE', 'driver')}] {msg}", flush=True)


# ---- the model and its HF cache ------------------------------------------------------------------------------

FULL, WINDOW, STATE = "full", "window", "state"
KIND_OF_LAYER_TYPE = {"full_attention": FULL, "sliding_attention": WINDOW, "linear_attention": STATE}
STATE_PARTS = (("conv", ("conv_states", "conv_state")), ("recurrent", ("recurrent_states", "recurrent_state",
                                                                       "ssm_states", "ssm_state")))


def _state_place(cache: Any, i: int, names: Tuple[str, ...]) -> Optional[Tuple[Any, Any, str]]:
    """Where layer i's state tensor of one of `names` lives in an HF cache: (container, key, how): an attribute of
    cache.layers[i] (a tensor, or a list/dict of them: item 0), or a cache-level per-layer list (older model-specific
    caches). None when there is none."""
    import torch
    layers = getattr(cache, "layers", None)
    if layers is not None and i < len(layers):
        obj = layers[i]
        for n in names:
            v = getattr(obj, n, None)
            if torch.is_tensor(v):
                return obj, n, f"layers[{i}].{n}"
            if isinstance(v, (list, tuple, dict)) and len(v) and torch.is_tensor(v[0] if not isinstance(v, dict)
                                                                              else v.get(0)):
                return v, 0, f"layers[{i}].{n}[0]"
    for n in names:
        v = getattr(cache, n, None)
        if isinstance(v, (list, dict)):
            item = v.get(i) if isinstance(v, dict) else (v[i] if i < len(v) else None)
            if torch.is_tensor(item):
                return v, i, f"cache.{n}[{i}]"
    return None


def _get_place(place: Tuple[Any, Any, str]) -> Any:
    obj, key, _ = place
    return getattr(obj, key) if isinstance(key, str) else obj[key]


def _set_place(place: Tuple[Any, Any, str], value: Any) -> str:
    """Puts `value` where `place` says: copied into the tensor there when shapes and dtypes agree (its address
    kept), else the tensor replaced. Returns which."""
    obj, key, _ = place
    cur = _get_place(place)
    if cur.shape == value.shape and cur.dtype == value.dtype:
        cur.copy_(value)
        return "copied"
    if isinstance(key, str):
        setattr(obj, key, value.clone())
    else:
        obj[key] = value.clone()
    return f"replaced ({tuple(cur.shape)} {cur.dtype} -> {tuple(value.shape)} {value.dtype})"


def _layer_kv(cache: Any, i: int) -> Tuple[Any, Any]:
    layers = getattr(cache, "layers", None)
    if layers is not None and i < len(layers) and getattr(layers[i], "keys", None) is not None:
        return layers[i].keys, layers[i].values
    kc = getattr(cache, "key_cache", None)
    if kc is not None and i < len(kc):
        return kc[i], cache.value_cache[i]
    raise RuntimeError(f"cache {type(cache).__name__}: no keys/values for layer {i} (layers: "
                       f"{[type(x).__name__ for x in (layers or [])]}); expected cache.layers[{i}].keys or "
                       "cache.key_cache")


def _set_layer_kv(cache: Any, i: int, k: Any, v: Any) -> None:
    layers = getattr(cache, "layers", None)
    if layers is not None and i < len(layers) and hasattr(layers[i], "keys"):
        layers[i].keys, layers[i].values = k, v
        return
    cache.key_cache[i], cache.value_cache[i] = k, v


def _set_length(obj: Any, n: int) -> Optional[str]:
    """Sets a sliding layer's count of tokens seen (cumulative_length: an int or a tensor, by version)."""
    import torch
    cur = getattr(obj, "cumulative_length", None)
    if cur is None:
        return None
    if torch.is_tensor(cur):
        cur.fill_(n)
    else:
        obj.cumulative_length = n
    return "cumulative_length"


def _as_int(t: Any) -> Any:
    import torch
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class HybridModel:
    """One of MODELS with fixed-seed random weights on the GPU, its HF cache handling, and its paged memory."""

    def __init__(self, args: argparse.Namespace, max_tokens: int) -> None:
        import torch
        import transformers
        self.torch, self.args, self.name = torch, args, args.model
        if not torch.cuda.is_available():
            raise SystemExit("hf_hybrid_reuse: no CUDA device visible (torch.cuda.is_available() is False)")
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, args.dtype)
        self.versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
        config, cls = self._config(max_tokens + args.suffix + 1024)
        torch.manual_seed(args.seed)
        with torch.device(self.device):
            model = cls(config)
        self.model = model.to(self.dtype).eval()
        self.config = self.model.config
        with torch.no_grad():
            self.fingerprint = float(sum(p.float().sum().item() for p in list(self.model.parameters())[:12]))
        types = list(getattr(self.config, "layer_types", None) or [])
        if len(types) != self.config.num_hidden_layers:
            raise SystemExit(f"hf_hybrid_reuse: {cls.__name__}'s config.layer_types is {types!r}; expected one of "
                             f"{sorted(KIND_OF_LAYER_TYPE)} per layer ({self.config.num_hidden_layers})")
        unknown = sorted(set(types) - set(KIND_OF_LAYER_TYPE))
        if unknown:
            raise SystemExit(f"hf_hybrid_reuse: layer types {unknown} are not known here; expected "
                             f"{sorted(KIND_OF_LAYER_TYPE)}")
        self.kinds = [KIND_OF_LAYER_TYPE[t] for t in types]
        self.layers_of = {k: [i for i, x in enumerate(self.kinds) if x == k] for k in (FULL, WINDOW, STATE)}
        # model layer -> (its kind, its index among that kind's layers: the layer in its flexkvd component)
        self.component_of = {li: (k, j) for k in (FULL, WINDOW, STATE) for j, li in enumerate(self.layers_of[k])}
        self._fill: Optional[Dict[str, Any]] = None  # a layer-wise forward in progress (begin_layerwise)
        self.takes_cache_position = "cache_position" in inspect.signature(self.model.forward).parameters
        self.kv_heads = self.config.num_key_value_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // \
            self.config.num_attention_heads
        self.window = int(self.config.sliding_window) if self.layers_of[WINDOW] else 0
        log(f"{cls.__name__}: {self.versions}; layers {types}; attention {self.config._attn_implementation}; "
            f"kv heads {self.kv_heads} x {self.head_dim}; window {self.window}; forward takes cache_position: "
            f"{self.takes_cache_position}; weights fingerprint {self.fingerprint!r}")
        self._cache_factory = self._find_cache_factory()
        self.chunked = self.name == "gpt-oss"
        self.continuation_multi = True  # until _continuation_check says
        self._learn_cache()
        self.continuation_multi = self._continuation_check()

    # -- configs
    def _config(self, max_pos: int) -> Tuple[Any, Any]:
        a = self.args
        if self.name == "gpt-oss":
            from transformers import GptOssConfig, GptOssForCausalLM
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(a.layers)]
            cfg = GptOssConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden,
                               num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                               num_local_experts=a.experts, num_experts_per_tok=2, sliding_window=a.sliding_window,
                               layer_types=layer_types, max_position_embeddings=max_pos)
            # The sinks need an attention that takes them: eager does (SDPA drops them in some versions).
            cfg._attn_implementation = "eager"
            return cfg, GptOssForCausalLM
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        cfg = Qwen3NextConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden,
                              num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                              linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=a.experts,
                              num_experts_per_tok=2, moe_intermediate_size=a.hidden // 2,
                              shared_expert_intermediate_size=a.hidden // 2, decoder_sparse_step=1,
                              max_position_embeddings=max_pos)
        if not getattr(cfg, "layer_types", None):  # older configs: every full_attention_interval-th layer is full
            step = getattr(cfg, "full_attention_interval", 4)
            cfg.layer_types = ["full_attention" if (i + 1) % step == 0 else "linear_attention"
                               for i in range(a.layers)]
        cfg._attn_implementation = "sdpa"
        return cfg, Qwen3NextForCausalLM

    def _find_cache_factory(self) -> Any:
        """The cache the model makes for itself: a model-specific class of its modeling module, else
        DynamicCache(config=...), else DynamicCache()."""
        import transformers
        module = sys.modules.get(type(self.model).__module__)
        for name in dir(module):
            if name.endswith("DynamicCache") and name != "DynamicCache":
                cls = getattr(module, name)
                try:
                    cls(self.config)
                    log(f"HF cache: {module.__name__}.{name}(config)")
                    return lambda: cls(self.config)
                except Exception as err:  # noqa: BLE001 - reported, the next form is tried
                    log(f"HF cache: {name}(config) failed ({err!r}); trying DynamicCache(config=...)")
        try:
            transformers.DynamicCache(config=self.config)
            log("HF cache: DynamicCache(config=config)")
            return lambda: transformers.DynamicCache(config=self.config)
        except TypeError as err:
            log(f"HF cache: DynamicCache(config=...) failed ({err!r}); using DynamicCache()")
            return transformers.DynamicCache

    def new_cache(self) -> Any:
        return self._cache_factory()

    def recording_cache(self) -> Tuple[Any, Dict[int, List[Tuple[Any, Any]]]]:
        """A new cache that also records every attention layer's new keys/values as the model hands them over
        (a sliding layer's cache keeps only its window; the engine's paged blocks hold every block of it)."""
        cache = self.new_cache()
        rec: Dict[int, List[Tuple[Any, Any]]] = {}
        original = cache.update

        def update(key_states: Any, value_states: Any, layer_idx: int, *rest: Any, **kw: Any) -> Any:
            rec.setdefault(int(layer_idx), []).append((key_states, value_states))
            return original(key_states, value_states, layer_idx, *rest, **kw)

        cache.update = update
        return cache, rec

    @staticmethod
    def recorded_kv(rec: Dict[int, List[Tuple[Any, Any]]], layer: int) -> Tuple[Any, Any]:
        import torch
        parts = rec.get(layer)
        if not parts:
            raise RuntimeError(f"no keys/values recorded for attention layer {layer}: the model did not call "
                               "past_key_values.update(key, value, layer_idx, ...) for it")
        return torch.cat([p[0] for p in parts], dim=-2), torch.cat([p[1] for p in parts], dim=-2)

    # -- forwards
    def tokens(self, n: int, salt: int) -> List[int]:
        g = self.torch.Generator().manual_seed(self.args.seed * 1000003 + salt)
        return self.torch.randint(3, self.args.vocab, (n,), generator=g).tolist()

    def _forward(self, ids: List[int], cache: Any, past: int) -> Any:
        t = self.torch
        with t.no_grad():
            x = t.tensor([ids], dtype=t.long, device=self.device)
            pos = t.arange(past, past + len(ids), device=self.device)
            kw = dict(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1,
                      position_ids=pos.unsqueeze(0))
            if self.takes_cache_position:
                kw["cache_position"] = pos
            out = self.model(**kw)
        return out.logits[0, -1].float()

    def prefill(self, ids: List[int], cache: Any, past: int = 0) -> Any:
        """Runs ids on top of `cache` (holding `past` tokens); the last position's logits, float32. In chunks where
        the model continues a prefill exactly; a suffix on a linear-attention state token by token where a
        multi-token step would restart the state."""
        if past > 0 and self.layers_of[STATE] and not self.continuation_multi:
            logits = None
            for j, tok in enumerate(ids):
                logits = self._forward([tok], cache, past + j)
            return logits
        step = self.args.chunk if self.chunked and (past == 0 or self.continuation_multi) else len(ids)
        logits = None
        for s in range(0, len(ids), max(1, step)):
            logits = self._forward(ids[s:s + step], cache, past + s)
        return logits

    # -- what the cache holds
    def _learn_cache(self) -> None:
        """Prefills a short prompt and reads what each layer's cache holds: a sliding layer's kept tokens, a linear
        layer's state tensors (their shapes and dtypes fix the state slot's layout). Keeps that cache as the template
        a loaded prefix is rebuilt into."""
        n = max(2 * self.window, 64) + 2 * self.args.block_size
        cache = self.new_cache()
        self.prefill(self.tokens(n, salt=99), cache)
        self.sliding_keep = 0
        self.state_layout: List[Tuple[str, Tuple[int, ...], Any, int]] = []  # (part, shape, dtype, offset)
        try:
            seen = cache.get_seq_length()
        except Exception as err:  # noqa: BLE001 - a diagnostic
            seen = repr(err)
        lines = [f"HF cache after a {n}-token prefill: {type(cache).__name__}, get_seq_length() = {seen}"]
        for i, kind in enumerate(self.kinds):
            layers = getattr(cache, "layers", None) or []
            layer = layers[i] if i < len(layers) else None
            lname = type(layer).__name__ if layer is not None else "-"
            if kind in (FULL, WINDOW):
                k, v = _layer_kv(cache, i)
                lines.append(f"  layer {i} {kind} ({lname}): keys {tuple(k.shape)} {k.dtype}, cumulative_length "
                             f"{getattr(layer, 'cumulative_length', '-')}")
                if kind == WINDOW:
                    keep = int(k.shape[-2])
                    if keep >= n:
                        raise SystemExit(f"hf_hybrid_reuse: sliding layer {i}'s cache ({lname}) kept all {n} tokens; "
                                         "expected only its window (the cache class does not know the sliding "
                                         "layers: the loaded window could not be rebuilt into it)")
                    if keep > self.window:
                        raise SystemExit(f"hf_hybrid_reuse: sliding layer {i}'s cache keeps {keep} tokens, more than "
                                         f"the {self.window}-token window flexkvd stores")
                    self.sliding_keep = keep
            else:
                parts = []
                for part, names in STATE_PARTS:
                    place = _state_place(cache, i, names)
                    if place is None:
                        raise SystemExit(f"hf_hybrid_reuse: linear layer {i} ({lname}): no {part} state found under "
                                         f"{names} (layer attributes: {sorted(vars(layer)) if layer is not None else '-'}"
                                         f"; cache attributes: {sorted(vars(cache))})")
                    t = _get_place(place)
                    parts.append((part, tuple(t.shape), t.dtype, place[2]))
                if not self.state_layout:
                    off = 0
                    for part, shape, dtype, _ in parts:
                        self.state_layout.append((part, shape, dtype, off))
                        nbytes = self.torch.Size(shape).numel() * self.torch.empty((), dtype=dtype).element_size()
                        off += (nbytes + 15) // 16 * 16
                    self.state_bytes = off
                elif [(p, s, d) for p, s, d, _ in parts] != [(p, s, d) for p, s, d, _ in self.state_layout]:
                    raise SystemExit(f"hf_hybrid_reuse: linear layer {i}'s states {parts} differ from the first "
                                     f"linear layer's {self.state_layout}; expected one shape for all")
                lines.append(f"  layer {i} state ({lname}): " + ", ".join(f"{p} {s} {d} at {h}" for p, s, d, h in parts)
                             + f" has_previous_state={getattr(layer, 'has_previous_state', '-')!r}")
        if self.layers_of[STATE]:
            lines.append(f"  state slot: {self.state_bytes} bytes per linear layer ({self.state_layout})")
        log("\n".join(lines))
        self.template = cache
        self.template_tokens = n

    def _continuation_check(self) -> bool:
        """Whether a multi-token prefill on a cache continues from it exactly (attention-only models do; some
        transformers versions restart a linear-attention state for any multi-token step)."""
        if not self.layers_of[STATE] or self.args.suffix_mode != "auto":
            return self.args.suffix_mode != "token"
        p, s = self.tokens(96, salt=5), self.tokens(16, salt=6)
        full = self.prefill(p + s, self.new_cache())
        c = self.new_cache()
        self.prefill(p, c)
        self.continuation_multi = True
        multi = self.prefill(s, c, past=len(p))
        c = self.new_cache()
        self.prefill(p, c)
        self.continuation_multi = False
        tok = self.prefill(s, c, past=len(p))
        alone = self.prefill(s, self.new_cache())
        d_multi = float((multi - full).abs().max())
        d_tok = float((tok - full).abs().max())
        d_alone = float((alone - full).abs().max())
        ok = d_multi <= 2 * d_tok + 1e-6
        log(f"continuation self-test (96 tokens, then 16): max |logit diff| vs one prefill: multi-token step {d_multi:.4g}"
            f", token by token {d_tok:.4g}, without the prefix {d_alone:.4g} -> the suffix runs "
            f"{'in one step' if ok else 'token by token (a multi-token step does not continue the state)'}")
        self.context_effect = d_alone
        return ok

    # -- paged memory (vLLM's)
    def allocate(self, max_tokens: int) -> None:
        t, bs = self.torch, self.args.block_size
        self.num_blocks = (max_tokens + self.args.suffix) // bs + 8
        self.window_blocks = -(-self.window // bs) if self.window else 0
        self.num_window_blocks = 2 * self.window_blocks + 4
        self.num_slots = 4
        shape = (2, self.num_blocks, bs, self.kv_heads, self.head_dim)
        wshape = (2, self.num_window_blocks, bs, self.kv_heads, self.head_dim)
        self.full_kv = [t.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers_of[FULL]]
        self.window_kv = [t.zeros(wshape, dtype=self.dtype, device=self.device) for _ in self.layers_of[WINDOW]]
        self.states = [t.zeros((self.num_slots, self.state_bytes), dtype=t.uint8, device=self.device)
                       for _ in self.layers_of[STATE]]

    def components(self) -> List[Tuple[str, List[Any], int]]:
        """(kind, tensors, num_blocks) in flexkvd component order."""
        out = [(FULL, self.full_kv, self.num_blocks)]
        if self.window_kv:
            out.append((WINDOW, self.window_kv, self.num_window_blocks))
        if self.states:
            out.append((STATE, self.states, self.num_slots))
        return out

    def geometry(self) -> flexkvd.Geometry:
        eb = self.torch.finfo(self.dtype).bits // 8
        comps = []
        if self.layers_of[WINDOW]:
            comps.append(flexkvd.ComponentSpec.sliding_window(len(self.layers_of[WINDOW]), self.kv_heads,
                                                              self.head_dim, self.window, dtype_bytes=eb))
        if self.layers_of[STATE]:
            comps.append(flexkvd.ComponentSpec.state(len(self.layers_of[STATE]), self.state_bytes))
        return flexkvd.Geometry(tokens_per_block=self.args.block_size, num_layers=len(self.layers_of[FULL]),
                                kv_heads_per_rank=self.kv_heads, head_dim=self.head_dim, dtype_bytes=eb,
                                components=comps)

    def namespace(self) -> str:
        c = self.config
        desc = json.dumps({k: getattr(c, k, None) for k in ("hidden_size", "num_hidden_layers", "layer_types",
                                                            "sliding_window", "vocab_size")}, sort_keys=True)
        return (f"hf-{self.name}-random-seed{self.args.seed}-{hashlib.sha256(desc.encode()).hexdigest()[:12]}"
                f"|{self.args.dtype}|tp1")

    def _index(self, ids: List[int]) -> Any:
        """The block ids as a GPU index tensor, made once per list: making one copies from pageable host memory,
        which blocks the CPU until the stream has run everything queued before it - inside a layer-wise forward
        that would wait out each layer's copies and compute, so begin_layerwise makes them before any wait."""
        key = tuple(ids)
        cache = self.__dict__.setdefault("_indices", {})
        if key not in cache:
            if len(cache) >= 64:
                cache.clear()
            cache[key] = self.torch.tensor(ids, dtype=self.torch.long, device=self.device)
        return cache[key]

    def _blocks_write(self, paged: Any, ids: List[int], k: Any, v: Any, start: int) -> None:
        bs = self.args.block_size
        idx = self._index(ids)
        n = len(ids) * bs
        for plane, src in enumerate((k, v)):
            part = src[0, :, start:start + n, :].transpose(0, 1)
            paged[plane, idx] = part.reshape(len(ids), bs, self.kv_heads, self.head_dim)

    def _blocks_read(self, paged: Any, ids: List[int]) -> Tuple[Any, Any]:
        idx = self._index(ids)
        n = len(ids) * self.args.block_size
        return tuple(paged[p, idx].reshape(n, self.kv_heads, self.head_dim).transpose(0, 1).unsqueeze(0).contiguous()
                     for p in range(2))

    def state_tensors(self, cache: Any, layer: int) -> List[Any]:
        return [_get_place(_state_place(cache, layer, names)) for _, names in STATE_PARTS]

    def write_prefix(self, rec: Dict[int, List[Tuple[Any, Any]]], cache: Any, e: int, full_ids: List[int],
                     window_ids: List[int], slot: int, first: int = 0) -> None:
        """The prefix's blocks [first, e) of the full layers, the window's blocks of the sliding layers and the
        states at e into the paged memory (what the engine's kernels would have written)."""
        bs = self.args.block_size
        for j, li in enumerate(self.layers_of[FULL]):
            k, v = self.recorded_kv(rec, li)
            self._blocks_write(self.full_kv[j], full_ids, k, v, first * bs)
        for j, li in enumerate(self.layers_of[WINDOW] if window_ids else []):
            k, v = self.recorded_kv(rec, li)
            self._blocks_write(self.window_kv[j], window_ids, k, v, (e - len(window_ids)) * bs)
        if slot >= 0:
            for j, li in enumerate(self.layers_of[STATE]):
                row = self.states[j][slot]
                for (part, shape, dtype, off), src in zip(self.state_layout, self.state_tensors(cache, li)):
                    flat = src.contiguous().view(self.torch.uint8).reshape(-1)
                    row[off:off + flat.numel()] = flat
        self.sync()

    def rebuild(self, e: int, full_ids: List[int], window_ids: List[int], slot: int) -> Any:
        """The HF cache of the prefix [0, e) blocks from the paged memory: the template's structure (deep-copied),
        full layers from every block, sliding layers from the window's blocks (as many trailing tokens as the layer
        keeps), linear layers' states copied into the template's state tensors."""
        cache = copy.deepcopy(self.template)
        for li in sorted(self.component_of):
            self.rebuild_layer(cache, li, e, full_ids, window_ids, slot)
        return cache

    def rebuild_layer(self, cache: Any, li: int, e: int, full_ids: List[int], window_ids: List[int],
                      slot: int) -> None:
        """Model layer li's part of rebuild(): its KV (full or sliding) or its state, from the paged memory."""
        n = e * self.args.block_size
        kind, j = self.component_of[li]
        if kind == FULL:
            k, v = self._blocks_read(self.full_kv[j], full_ids)
            _set_layer_kv(cache, li, k, v)
            layers = getattr(cache, "layers", None)
            if layers is not None and hasattr(layers[li], "cumulative_length"):
                _set_length(layers[li], n)
        elif kind == WINDOW:
            k, v = self._blocks_read(self.window_kv[j], window_ids)
            keep = min(self.sliding_keep, n)
            _set_layer_kv(cache, li, k[:, :, -keep:, :].contiguous(), v[:, :, -keep:, :].contiguous())
            if _set_length(cache.layers[li], n) is None:
                raise RuntimeError(f"sliding layer {li} ({type(cache.layers[li]).__name__}) has no cumulative_length; "
                                   "expected it (the tokens the layer has seen, which places the window)")
        else:
            row = self.states[j][slot]
            for (part, shape, dtype, off), (_, names) in zip(self.state_layout, STATE_PARTS):
                nbytes = self.torch.Size(shape).numel() * self.torch.empty((), dtype=dtype).element_size()
                value = row[off:off + nbytes].view(dtype).reshape(shape)
                _set_place(_state_place(cache, li, names), value)

    # -- layer-wise loads: each decoder layer's prefix put in just before it runs
    def decoder_layers(self) -> List[Any]:
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if layers is None or len(layers) != len(self.component_of):
            raise SystemExit(f"hf_hybrid_reuse: expected model.model.layers to hold {len(self.component_of)} decoder "
                             f"layers ({self.versions}); found {'none' if layers is None else len(layers)}")
        return list(layers)

    def install_layer_hooks(self) -> List[Any]:
        """A forward pre-hook on each decoder layer that puts in its prefix while a layer-wise forward runs
        (begin_layerwise .. end_layerwise) and does nothing otherwise. Returns the handles (remove() them)."""
        self._fill = None
        handles = []
        for li, layer in enumerate(self.decoder_layers()):
            def hook(module: Any, args: Any, li: int = li) -> None:
                if self._fill is not None:
                    self._fill_layer(li)
            handles.append(layer.register_forward_pre_hook(hook))
        return handles

    def layer_component(self, li: int) -> Tuple[int, int]:
        """(flexkvd component, its layer) of model layer li: components are FULL, then the window, then the state."""
        kind, j = self.component_of[li]
        c = 0 if kind == FULL else 1 if kind == WINDOW else (2 if self.layers_of[WINDOW] else 1)
        return c, j

    def begin_layerwise(self, e: int, full_ids: List[int], window_ids: List[int], slot: int, wait: Any) -> Any:
        """A new HF cache for a forward on top of the prefix, loaded layer by layer: wait(li) makes the current stream
        wait for model layer li's copies. Put in now: every state (vLLM runs linear-attention layers without a
        per-layer wait, and they come first in flexkvd's layer order) and the first layer of each attention kind (HF
        sizes the causal and the sliding masks from them before any layer runs); the hooks put in the others."""
        for ids in (full_ids, window_ids):  # no index made inside the forward (see _index)
            if ids:
                self._index(ids)
        self._fill = {"cache": copy.deepcopy(self.template), "args": (e, full_ids, window_ids, slot), "wait": wait,
                      "filled": []}
        first = [self.layers_of[kind][0] for kind in (FULL, WINDOW) if self.layers_of[kind]]
        for li in list(self.layers_of[STATE]) + first:
            self._fill_layer(li)
        return self._fill["cache"]

    def _fill_layer(self, li: int) -> None:
        f = self._fill
        if li in f["filled"]:
            return
        f["wait"](li)  # the stream waits for this layer's copies; the gathers below run after them
        self.rebuild_layer(f["cache"], li, *f["args"])
        f["filled"].append(li)

    def end_layerwise(self) -> List[int]:
        """Ends the layer-wise forward; the model layers put in (every layer once it ran)."""
        f, self._fill = self._fill, None
        return [] if f is None else sorted(f["filled"])

    def compare_caches(self, got: Any, want: Any) -> List[str]:
        """Differences between two HF caches of one prefix: every layer's tensors (bytes), sequence lengths."""
        diffs = []
        for i, kind in enumerate(self.kinds):
            if kind == STATE:
                for (part, _), a, b in zip(STATE_PARTS, self.state_tensors(got, i), self.state_tensors(want, i)):
                    if a.shape != b.shape or a.dtype != b.dtype or not self.torch.equal(_as_int(a), _as_int(b)):
                        diffs.append(f"layer {i} {part} state: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
                                     f", max |diff| {float((a.float() - b.float()).abs().max()) if a.shape == b.shape else '-'}")
                continue
            for name, a, b in zip(("keys", "values"), _layer_kv(got, i), _layer_kv(want, i)):
                if a.shape != b.shape or not self.torch.equal(_as_int(a), _as_int(b)):
                    diffs.append(f"layer {i} {kind} {name}: {tuple(a.shape)} vs {tuple(b.shape)}")
            layers = getattr(got, "layers", None)
            if layers is not None and i < len(layers):
                la, lb = getattr(layers[i], "cumulative_length", None), getattr(want.layers[i], "cumulative_length", None)
                if la is not None and int(la) != int(lb):
                    diffs.append(f"layer {i} cumulative_length {int(la)} vs {int(lb)}")
        try:
            a, b = int(got.get_seq_length()), int(want.get_seq_length())
            if a != b:
                diffs.append(f"get_seq_length() {a} vs {b}")
        except Exception as err:  # noqa: BLE001 - a diagnostic
            diffs.append(f"get_seq_length(): {err!r}")
        return diffs

    def blocks_equal(self, rec: Dict[int, List[Tuple[Any, Any]]], cache: Any, e: int, full_ids: List[int],
                     window_ids: List[int], slot: int) -> List[str]:
        """Whether the paged memory holds exactly the prefix's KV and states this process computed."""
        bs = self.args.block_size
        diffs = []
        for j, li in enumerate(self.layers_of[FULL]):
            k, v = self.recorded_kv(rec, li)
            got = self._blocks_read(self.full_kv[j], full_ids)
            for name, a, b in zip(("K", "V"), got, (k[:, :, :e * bs], v[:, :, :e * bs])):
                if not self.torch.equal(_as_int(a), _as_int(b)):
                    diffs.append(f"full layer {li} {name}")
        for j, li in enumerate(self.layers_of[WINDOW]):
            k, v = self.recorded_kv(rec, li)
            lo = (e - len(window_ids)) * bs
            got = self._blocks_read(self.window_kv[j], window_ids)
            for name, a, b in zip(("K", "V"), got, (k[:, :, lo:e * bs], v[:, :, lo:e * bs])):
                if not self.torch.equal(_as_int(a), _as_int(b)):
                    diffs.append(f"sliding layer {li} {name}")
        for j, li in enumerate(self.layers_of[STATE]):
            row = self.states[j][slot]
            for (part, shape, dtype, off), src in zip(self.state_layout, self.state_tensors(cache, li)):
                flat = src.contiguous().view(self.torch.uint8).reshape(-1)
                if not self.torch.equal(row[off:off + flat.numel()], flat):
                    diffs.append(f"linear layer {li} {part} state")
        return diffs

    def zero_paged(self) -> None:
        for xs in (self.full_kv, self.window_kv, self.states):
            for x in xs:
                x.zero_()

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    # -- vLLM's per-group block ids
    def groups(self, e: int, full_ids: List[int], window_ids: List[int], slot: int) -> List[List[int]]:
        """The request's block ids per KV cache group (component order), by position [0, e): every full block; the
        window group's blocks only inside the window (the null block before it, freed as vLLM frees them); the state
        group's slot at the prefix end's position (e - 1)."""
        out = [list(full_ids)]
        if self.window_kv:
            out.append([NULL_BLOCK] * (e - len(window_ids)) + list(window_ids))
        if self.states:
            out.append([NULL_BLOCK] * (e - 1) + [slot])
        return out

    def component_ids(self, groups: List[List[int]], first: int, end: int) -> List[List[int]]:
        """A hybrid load's per-component ids for prefix end `end` past the engine's first `first` blocks (FULL
        [first, end), a window's [max(first, end - w), end), a state's position end - 1)."""
        out = [groups[0][first:end]]
        c = 1
        if self.window_kv:
            out.append(groups[c][max(first, end - self.window_blocks):end])
            c += 1
        if self.states:
            out.append(groups[c][end - 1:end])
        return out
