"""flexkvd as a vLLM V1 KV connector: FlexKVdConnector, selected with
  --kv-transfer-config '{"kv_connector":"FlexKVdConnector","kv_connector_module_path":"flexkvd.integrations.vllm",
                         "kv_role":"kv_both","kv_connector_extra_config":{"socket":"/run/flexkvd/flexkvd.sock"}}'

This module imports without vLLM: FlexKVdConnector (and FlexKVdConnectorMetadata, FlexKVdConnectorStats) are built
on first access, when vLLM's KVConnectorBase_V1 is importable; without vLLM that access raises ImportError saying so.
The adapter only translates vLLM's objects into the plain arguments of SchedulerLogic and WorkerLogic
(_vllm_logic.py, _vllm_worker.py), where the behaviour and its contracts are; docs/integrations.md has the design.
Written against vLLM's main branch (vllm/distributed/kv_transfer/kv_connector/v1/base.py, vllm/v1/core/sched/
scheduler.py, vllm/v1/worker/kv_connector_model_runner_mixin.py); never run against a real vLLM here.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import flexkvd

from ._vllm_events import KvEventRelay
from ._vllm_groups import FULL, MAMBA, MLA, SLIDING_WINDOW, GroupMap, KvGroup, map_kv_cache_groups
from ._vllm_layerwise import layer_order_names
from ._vllm_layouts import KvPlan, plan_cross_layer_kv_cache, plan_kv_caches
from ._vllm_link import DaemonLink, LinkOptions
from ._vllm_logic import (ConnectorConfig, ConnectorMetadata, ConnectorStats, LoadSpec, SchedulerLogic, StoreSpec,
                          vllm_namespace)
from ._vllm_state_layouts import plan_hybrid_kv_caches
from ._vllm_worker import RankKv, WorkerLogic, describe_rank_kv

# FlexKVdConnector, FlexKVdConnectorMetadata and FlexKVdConnectorStats are attributes too, made on first access
# (__getattr__); not in __all__, so that `import *` works without vLLM.
__all__ = ["ConnectorConfig", "ConnectorMetadata", "ConnectorStats", "DaemonLink", "GroupMap", "KvEventRelay",
           "KvGroup", "LinkOptions", "LoadSpec", "RankKv", "SchedulerLogic", "StoreSpec", "WorkerLogic",
           "describe_plans", "describe_rank_kv", "describe_vllm_groups", "geometry_from_vllm", "map_kv_cache_groups",
           "plan_engine_kv", "vllm_namespace"]

log = logging.getLogger("flexkvd.integrations.vllm")

log = logging.getLogger("flexkvd.integrations.vllm")

# The connector's load_mode when the extra config does not say (the logic classes alone default to "whole").
ADAPTER_LOAD_MODE = "layerwise"

_BUILT: Dict[str, Any] = {}
_LAZY = ("FlexKVdConnector", "FlexKVdConnectorMetadata", "FlexKVdConnectorStats")


def __getattr__(name: str) -> Any:
    """vLLM's factory does getattr(import_module(kv_connector_module_path), kv_connector): the classes that subclass
    vLLM's are made here, on first access."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _BUILT:
        _BUILT.update(_build())
    return _BUILT[name]


def _build() -> Dict[str, Any]:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                       KVConnectorRole)
    except ImportError as err:
        raise ImportError(
            "flexkvd.integrations.vllm.FlexKVdConnector needs vLLM (its KVConnectorBase_V1), which is not importable "
            f"here ({err}); install vLLM in this environment, or use the plain logic classes SchedulerLogic and "
            "WorkerLogic, which need no vLLM") from err
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    except ImportError:  # an older vLLM without connector stats
        KVConnectorStats = None
    try:  # vLLM's hybrid memory allocator interface: per-group block ids, request_finished_all_groups
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    except ImportError:  # an older vLLM: it turns its hybrid allocator off with a connector (one group)
        SupportsHMA = None

    class FlexKVdConnectorMetadata(KVConnectorMetadata, ConnectorMetadata):  # type: ignore[misc, valid-type]
        """One step's loads and stores (ConnectorMetadata) as vLLM's KVConnectorMetadata."""

    stats_cls = None
    if KVConnectorStats is not None:
        class FlexKVdConnectorStats(KVConnectorStats):  # type: ignore[misc, valid-type]
            """ConnectorStats counters in vLLM's stats container: summed across workers and steps."""

            def reset(self) -> None:
                self.data = {}

            def aggregate(self, other: Any) -> Any:
                for k, v in (other.data or {}).items():
                    self.data[k] = self.data.get(k, 0) + v
                return self

            def reduce(self) -> Dict[str, Any]:
                return dict(self.data)

            def is_empty(self) -> bool:
                return not any(self.data.values())

        stats_cls = FlexKVdConnectorStats

    bases = (KVConnectorBase_V1,) if SupportsHMA is None else (KVConnectorBase_V1, SupportsHMA)

    class FlexKVdConnector(*bases):  # type: ignore[misc, valid-type]
        """flexkvd as vLLM's KV connector: prefix hits load asynchronously from the node's flexkvd; finished requests'
        full blocks are stored there. Scheduler role: SchedulerLogic; worker role: WorkerLogic (TP rank 0 reports).
        With vLLM's hybrid memory allocator (SupportsHMA) every KV cache group is a flexkvd component."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            parallel = vllm_config.parallel_config
            if getattr(parallel, "pipeline_parallel_size", 1) != 1:
                raise ValueError("FlexKVdConnector supports pipeline_parallel_size 1 only (each PP stage holds other "
                                 f"layers); got {parallel.pipeline_parallel_size}")
            check_load_failure_policy(vllm_config.kv_transfer_config)
            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            groups = None
            described = describe_vllm_groups(kv_cache_config)
            if len(described) > 1:  # vLLM's hybrid allocator: one component per KV cache group
                groups = map_kv_cache_groups(described, block_size=vllm_config.cache_config.block_size,
                                             tp_size=parallel.tensor_parallel_size)
                geometry = groups.geometry
            else:  # one group (or an older vLLM that passes none): the model's own shape, on both sides alike
                geometry = geometry_from_vllm(vllm_config)
            model = vllm_config.model_config
            kv_dtype = str(vllm_config.cache_config.cache_dtype)
            if kv_dtype == "auto":
                kv_dtype = str(model.dtype).replace("torch.", "")
            default_ns = vllm_namespace(str(model.model), kv_dtype, geometry.tp_size,
                                        revision=getattr(model, "revision", None))
            self._config = ConnectorConfig.from_extra_config(
                extra, default_namespace=default_ns, geometry=geometry,
                dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0), default_load_mode=ADAPTER_LOAD_MODE,
                groups=groups)
            # Not for a hybrid model: a vLLM that packs several groups' layers into one cross-layer tensor (by page
            # size) mixes components in a block, which no flexkvd layout describes.
            self._cross_layer = bool(extra.get("cross_layer_blocks", True)) and \
                getattr(vllm_config, "speculative_config", None) is None and not geometry.is_hybrid
            self._plan: Optional[KvPlan] = None
            self._scheduler: Optional[SchedulerLogic] = None
            self._worker: Optional[WorkerLogic] = None
            self._events: Optional[KvEventRelay] = None
            if role == KVConnectorRole.SCHEDULER:
                loads, why = engine_loads_groups(kv_cache_config, len(described))
                if not loads:
                    log.warning("FlexKVdConnector stores to flexkvd but loads nothing on this engine: %s", why)
                self._scheduler = SchedulerLogic(self._config, may_defer=engine_takes_not_yet(KVConnectorBase_V1),
                                                 loads=loads)
                if self._config.kv_events:
                    self._events = KvEventRelay(self._config.link.socket, self._config.namespace,
                                                self._config.groups)
            else:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
                self._worker = WorkerLogic(self._config, tp_rank=get_tensor_model_parallel_rank())

        # ---- scheduler side ----

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
            extras = _block_extras(request, self._config.block_size)
            return self._scheduler.get_num_new_matched_tokens(request.request_id, request.all_token_ids,
                                                              num_computed_tokens, extras is not None,
                                                              getattr(request, "num_preemptions", 0), extras)

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            # Every group's block ids (KVCacheBlocks.get_block_ids: one list per KV cache group).
            ids = blocks.get_block_ids() if num_external_tokens > 0 else []
            self._scheduler.update_state_after_alloc(request.request_id, ids, num_external_tokens,
                                                     getattr(request, "num_preemptions", 0))

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = self._scheduler.build_connector_meta(getattr(scheduler_output, "preempted_req_ids", None) or ())
            return FlexKVdConnectorMetadata(loads=meta.loads, stores=meta.stores, preempted=meta.preempted)

        def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
            return self.request_finished_all_groups(request, (block_ids,))

        def request_finished_all_groups(self, request: Any,
                                        block_ids: Tuple[List[int], ...]) -> Tuple[bool, Optional[Dict[str, Any]]]:
            """SupportsHMA: the request's blocks of every KV cache group, once, before vLLM frees them."""
            # KV computed = num_computed_tokens less what an in-flight step (async scheduling) has not written yet,
            # and no more blocks than vLLM says may be published by hash (num_publishable_block_hashes).
            computed = max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))
            publishable = getattr(request, "num_publishable_block_hashes", None)
            if isinstance(publishable, int):
                computed = min(computed, publishable * self._config.block_size)
            extras = _block_extras(request, self._config.block_size)
            delay = self._scheduler.request_finished(request.request_id, request.all_token_ids,
                                                     [list(g) for g in block_ids], computed, extras is not None,
                                                     extras)
            return delay, None

        def take_events(self) -> Any:
            """The daemon's KV events of this namespace since the last call, as vLLM's BlockStored / BlockRemoved
            (kv_connector_extra_config.kv_events; none without it). vLLM's scheduler publishes them with its own."""
            if self._events is None:
                return ()
            return [_vllm_event(e) for e in self._events.take()]

        def update_connector_output(self, connector_output: Any) -> None:
            self._scheduler.update_connector_output(connector_output.finished_sending,
                                                    connector_output.finished_recving,
                                                    getattr(connector_output, "invalid_block_ids", None))

        def get_finished_count(self) -> Optional[int]:
            return 1  # only TP rank 0 reports (WorkerLogic.get_finished)

        @property
        def requires_kv_delivery(self) -> bool:
            """False: flexkvd is a best-effort cache. A store that does not happen is a later miss, never a wrong
            answer, so a request preempted while its store is pending need not be computed again (vLLM's default,
            True for a kv_both producer, would recompute it)."""
            return False

        # ---- worker side ----

        @property
        def prefer_cross_layer_blocks(self) -> bool:
            """vLLM then allocates a uniform model's layers as one tensor, blocks first
            (register_cross_layers_kv_cache): one region, one copy per block run, whatever the backend (per-layer
            tensors register too: LAYER_FIRST, or LAYER_BLOCK_REGIONS for FLASHINFER's and TRITON_ATTN's). Not with
            a draft model (its layers would be in the block), a hybrid model (several KV cache groups: each group's
            layers register as their component) or cross_layer_blocks false."""
            return self._cross_layer

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
            """NHD chunks (block_size, kv_heads, head_dim): every engine of a namespace must write the same bytes
            for a block; an HND cache (VLLM_KV_CACHE_LAYOUT, or a backend that forces it) is refused at
            registration."""
            return "NHD"

        @classmethod
        def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
            """Layer-wise loads need wait_for_layer_load to run (a full CUDA graph skips it). Asked before the
            model is known: an engine that loads whole anyway (TP > 1) keeps full CUDA
            graphs with load_mode "whole"."""
            return (extra_config or {}).get("load_mode", ADAPTER_LOAD_MODE) == "layerwise"

        def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
            self._register_plans(plan_engine_kv(kv_caches, self._config))

        def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any = None) -> None:
            if self._config.geometry.is_hybrid:  # prefer_cross_layer_blocks is False for these: not expected
                raise ValueError(
                    "FlexKVdConnector got one cross-layer KV tensor for a model with "
                    f"{self._config.geometry.component_count} KV cache groups; it registers a hybrid model's layers "
                    "per group (register_kv_caches), and a cross-layer tensor mixing groups has no flexkvd layout")
            self._register_plans([plan_cross_layer_kv_cache(kv_cache, self._config.geometry)])

        def _register_plans(self, plans: List[KvPlan]) -> None:
            """Registers this rank's KV (rank 0 every rank's, gathered over vLLM's TP CPU group) as `plans` lay it
            out, one per geometry component; a layout flexkvd cannot copy was refused by the plans, before anything
            else."""
            from vllm.distributed.parallel_state import get_tp_group
            for plan in plans:
                for name, why in plan.left_out.items():
                    log.info("FlexKVdConnector leaves KV layer %s out: %s", name, why)
            self._plan = plans[0]
            mine = describe_plans(self._worker.tp_rank, self._config.geometry, plans)
            group = get_tp_group()
            gathered: List[Any] = [None] * group.world_size
            if group.world_size > 1:
                import torch.distributed as dist
                dist.all_gather_object(gathered, mine, group=group.cpu_group)
                gathered[self._worker.tp_rank] = mine  # its own keeps its tensors
            else:
                gathered = [mine]
            if self._worker.is_reporter:
                import torch
                self._worker.store_fence = _cuda_fence  # stores read blocks the engine's stream wrote
                self._worker.layer_stream = torch.cuda.current_stream
                if self._config.geometry.is_hybrid:  # every group's layers, in the layer order of the loads
                    self._worker.register_layer_names(
                        layer_order_names(self._config.geometry, [plan.layer_names for plan in plans]))
                else:
                    self._worker.register_layer_names({n: i for i, n in enumerate(plans[0].layer_names)
                                                       if n is not None})
                self._worker.register_kv([r for rank in gathered for r in rank])

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            if self._plan is not None and None in self._plan.layer_names:  # a cross-layer tensor: names by pointer
                self._name_layers(forward_context)
            self._worker.start(self._get_connector_metadata())

        def _name_layers(self, forward_context: Any) -> None:
            """Learns which flexkvd layer each attention layer is from its kv_cache view's pointer."""
            names = {}
            for name, layer in (getattr(forward_context, "no_compile_layers", None) or {}).items():
                cache = getattr(layer, "kv_cache", None)
                view = cache[0] if isinstance(cache, (list, tuple)) and cache else cache
                index = self._plan.layer_index_of_pointer(view.data_ptr()) if hasattr(view, "data_ptr") else None
                if index is not None:
                    names[name] = index
            if len(names) == len(self._plan.layer_names):
                self._plan.layer_names = [n for n, _ in sorted(names.items(), key=lambda item: item[1])]
                self._worker.register_layer_names(names)

        def wait_for_layer_load(self, layer_name: str) -> None:
            # Layer-wise loads: the engine's current stream waits on this layer's CUDA events (no CPU wait).
            self._worker.wait_layer(layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            # Nothing to copy during the forward: stores run from a finished request's blocks, which vLLM keeps
            # until the store is reported, behind a CUDA event recorded on the engine's stream.
            return

        def wait_for_save(self) -> None:
            return  # stores never hold the forward up (see save_kv_layer)

        def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
            return self._worker.get_finished(finished_req_ids)

        def get_block_ids_with_load_errors(self) -> set:
            return self._worker.take_load_errors() if self._worker is not None else set()

        def get_kv_connector_stats(self) -> Any:
            logic = self._worker or self._scheduler
            if stats_cls is None or logic is None:
                return None
            taken = logic.stats.take()
            return None if taken.is_empty() else stats_cls(data=taken.as_dict())

        @classmethod
        def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> Any:
            return None if stats_cls is None else stats_cls(data=dict(data or {}))

        def shutdown(self) -> None:
            if self._events is not None:
                self._events.close()
            for logic in (self._worker, self._scheduler):
                if logic is not None:
                    logic.close()

    built = {"FlexKVdConnector": FlexKVdConnector, "FlexKVdConnectorMetadata": FlexKVdConnectorMetadata,
             "FlexKVdConnectorStats": stats_cls}
    for name, cls in built.items():
        if cls is not None:  # pickled by name (vLLM sends metadata and stats between processes): found via __getattr__
            cls.__module__, cls.__qualname__ = __name__, name
    return built


_DTYPE_BYTES = {"float16": 2, "half": 2, "bfloat16": 2, "float": 4, "float32": 4}


def describe_vllm_groups(kv_cache_config: Any) -> List[KvGroup]:
    """vLLM's KV cache groups (kv_cache_config.kv_cache_groups: layer_names and a KVCacheSpec each) as KvGroup,
    for map_kv_cache_groups; [] without a kv_cache_config. Specs are told apart by their class names
    (vllm/v1/kv_cache_interface.py): FullAttentionSpec (with HMA off a sliding-window layer is one too: all its
    blocks are kept), MLAAttentionSpec, SlidingWindowSpec, MambaSpec; any other class, a padded attention page,
    another value head size, per-token-head or NVFP4 quantization and a Mamba group without a state per block are
    described with the reason flexkvd refuses them."""
    out: List[KvGroup] = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        name = type(spec).__name__
        names = tuple(getattr(group, "layer_names", ()) or ())
        layers = len(names)
        block_size = int(getattr(spec, "block_size", 0))
        if name == "MambaSpec":
            mode = str(getattr(spec, "mamba_cache_mode", "none"))
            refusal = "" if mode in ("align", "all") else (
                f"mamba_cache_mode {mode!r} keeps no state per block; flexkvd needs \"align\" or \"all\" (the state "
                "after each block), set through vLLM's mamba cache mode")
            if getattr(spec, "num_speculative_blocks", 0):
                refusal = "Mamba state with speculative blocks; flexkvd stores one state per block"
            out.append(KvGroup(MAMBA, layers, block_size, state_bytes=int(spec.page_size_bytes), spec=name,
                               refusal=refusal, layer_names=names))
            continue
        kinds = {"FullAttentionSpec": FULL, "MLAAttentionSpec": MLA, "SlidingWindowSpec": SLIDING_WINDOW}
        kind = kinds.get(name, name)
        refusal = ""
        if kind in (FULL, MLA, SLIDING_WINDOW):
            quant = getattr(spec, "kv_quant_mode", None)
            if getattr(spec, "page_size_padded", None) is not None:
                refusal = f"a padded page ({spec.page_size_padded} bytes); flexkvd copies unpadded blocks"
            elif getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
                refusal = f"value head size {spec.head_size_v} differs from the key head size {spec.head_size}"
            elif getattr(quant, "is_per_token_head", False) or getattr(quant, "is_nvfp4", False):
                refusal = f"KV quantization {quant!r} keeps scales outside the blocks"
            elif getattr(spec, "cache_dtype_str", None) == "fp8_ds_mla":
                refusal = "fp8_ds_mla pages (656 bytes a token) are not a K/V or latent block"
        out.append(KvGroup(kind, layers, block_size, int(getattr(spec, "num_kv_heads", 0)),
                           int(getattr(spec, "head_size", 0)),
                           int(getattr(getattr(spec, "dtype", None), "itemsize", 2) or 2),
                           int(getattr(spec, "sliding_window", 0) or 0) if kind == SLIDING_WINDOW else 0,
                           spec=name, refusal=refusal, layer_names=names))
    return out


def plan_engine_kv(kv_caches: Dict[str, Any], config: ConnectorConfig) -> List[KvPlan]:
    """The registrations of vLLM's per-layer KV (register_kv_caches' {layer name: tensor, or a Mamba layer's list of
    state tensors}): one KvPlan of the model's layers (plan_kv_caches) for a model of one KV cache group; one per
    geometry component for a hybrid model (plan_hybrid_kv_caches: each group's layers in its component's copy
    geometry, Mamba layers as state pages). InvalidArgument, naming the layer, for what flexkvd cannot copy."""
    if config.geometry.is_hybrid:
        return plan_hybrid_kv_caches(kv_caches, config.groups)
    return [plan_kv_caches(kv_caches, config.geometry)]


def describe_plans(tp_rank: int, geometry: flexkvd.Geometry, plans: List[KvPlan]) -> List[RankKv]:
    """This TP rank's RankKv of each plan (one per component), for rank 0's WorkerLogic.register_kv (after the TP
    gather: every rank's lists, flattened)."""
    return [describe_rank_kv(tp_rank, geometry, p.num_blocks, p.regions, p.layout, p.region_bytes,
                             component=p.component) for p in plans]


def engine_loads_groups(kv_cache_config: Any, num_groups: int) -> Tuple[bool, str]:
    """Whether this vLLM's scheduler can finish an asynchronous load for an engine of num_groups KV cache groups,
    and why not. vLLM's main branch as read (vllm/v1/core/sched/scheduler.py) unpacks exactly one group's block ids
    where a load ends (_update_waiting_for_remote_kv) and where a load error is handled
    (_update_requests_with_invalid_blocks), and asserts that no external tokens reach a Mamba group in "align"
    mode (_mamba_block_aligned_split): a load there would stop the engine. Read from the installed vLLM's source;
    a source that cannot be read counts as not able. One group always can."""
    if num_groups <= 1:
        return True, ""
    import inspect
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        sources = {name: "".join(inspect.getsource(getattr(Scheduler, name)).split())
                   for name in ("_update_waiting_for_remote_kv", "_update_requests_with_invalid_blocks")}
        split = getattr(Scheduler, "_mamba_block_aligned_split", None)
        split_src = "".join(inspect.getsource(split).split()) if split is not None else ""
    except (ImportError, AttributeError, OSError, TypeError) as err:
        return False, f"vLLM's scheduler source could not be read to check its handling of {num_groups} KV cache " \
                      f"groups ({err})"
    for name, src in sources.items():
        if "(block_ids,)=" in src or "(req_block_ids,)=" in src:
            return False, (f"vLLM's Scheduler.{name} unpacks one KV cache group's block ids, and this model has "
                           f"{num_groups}: an asynchronous load would stop the engine")
    modes = {str(getattr(g.kv_cache_spec, "mamba_cache_mode", "")) for g in kv_cache_config.kv_cache_groups
             if type(g.kv_cache_spec).__name__ == "MambaSpec"}
    if "align" in modes and "ExternalKVconnectorisnotverified" in split_src:
        return False, ("vLLM asserts that no external tokens reach a Mamba group under mamba_cache_mode \"align\" "
                       "(Scheduler._mamba_block_aligned_split)")
    return True, ""


def _vllm_event(event: Any) -> Any:
    """A KvEventRelay event as vLLM's KV cache event (vllm.distributed.kv_events)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    if event.kind == "stored":
        return BlockStored(block_hashes=list(event.hashes), parent_block_hash=event.parent, token_ids=[],
                           block_size=event.block_size, lora_id=None, medium=event.medium, lora_name=None,
                           group_idx=event.group, kv_cache_spec_kind=event.spec_kind,
                           kv_cache_spec_sliding_window=event.sliding_window)
    return BlockRemoved(block_hashes=list(event.hashes), medium=event.medium, group_idx=event.group)


def geometry_from_vllm(vllm_config: Any) -> flexkvd.Geometry:
    """The flexkv Geometry of a vLLM engine's KV cache (one rank's shard; tokens_per_block = vLLM's block_size)."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    kv_dtype = str(cache.cache_dtype)
    if kv_dtype == "auto":
        dtype_bytes = model.dtype.itemsize
    elif kv_dtype.startswith("fp8"):
        dtype_bytes = 1
    else:
        dtype_bytes = _DTYPE_BYTES[kv_dtype]
    mla = bool(getattr(model, "use_mla", False))
    return flexkvd.Geometry(tokens_per_block=cache.block_size, num_layers=model.get_num_layers(parallel),
                           kv_planes=1 if mla else 2,
                           kv_heads_per_rank=1 if mla else model.get_num_kv_heads(parallel),
                           head_dim=model.get_head_size(), dtype_bytes=dtype_bytes,
                           tp_size=parallel.tensor_parallel_size)


def _cuda_fence() -> Any:
    """A CUDA event recorded now on the current stream (the engine's): query() is True once every kernel enqueued
    before it ran, so a store submitted after it reads the KV those kernels wrote, and the CPU never waits."""
    import torch
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


def engine_takes_not_yet(base: Any) -> bool:
    """Whether this vLLM's get_num_new_matched_tokens may answer None ("the connector needs more time; the scheduler
    asks again later"), as its interface documents since it allows it: then a lookup never blocks its scheduler."""
    doc = getattr(getattr(base, "get_num_new_matched_tokens", None), "__doc__", None) or ""
    return "If None" in doc and "again" in doc


def check_load_failure_policy(kv_transfer_config: Any) -> None:
    """Refuses to start under vLLM's kv_load_failure_policy "fail" (its default): a flexkvd block can go between the
    lookup and the load (evicted, its pins lapsed, the daemon restarted), and under "fail" every such load ends its
    request with an error, where "recompute" prefills those tokens again. An engine that did not say (an older vLLM
    without the option) recomputes anyway."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", None)
    if policy is not None and str(policy) != "recompute":
        raise ValueError(
            f"FlexKVdConnector needs kv_load_failure_policy \"recompute\" (it is {str(policy)!r}): a block flexkvd "
            "reported can be gone when it is loaded (evicted, the daemon restarted), and under \"fail\" vLLM ends "
            "that request with an error instead of computing those tokens again; add "
            "\"kv_load_failure_policy\": \"recompute\" to --kv-transfer-config")


def _block_extras(request: Any, block_size: int) -> Optional["flexkvd.BlockExtras"]:
    """What changes a vLLM request's KV besides its token ids, for its keys (flexkvd.BlockExtras; vLLM keys its own
    prefix cache by the same things): its cache_salt, its LoRA adapter's name, each multimodal item's hash over the
    placeholder range it fills, its prompt embeddings (whose token ids vLLM fills with zeros). Kept on the request
    (one hash of its embeddings per block, as vLLM keeps its own). None - not cached - for a request whose media
    cannot be read (an engine version whose fields this does not know): refusing is safe, guessing is not."""
    cached = getattr(request, "_flexkvd_extras", None)
    if cached is not None:
        return cached if cached is not _NOT_CACHEABLE else None
    lora = getattr(request, "lora_request", None)
    adapter = None
    if lora is not None:
        # A name or an int id is unique only within one engine, and flexkvd serves every engine of the node: the
        # adapter is keyed by where its weights come from (its path) with its name. One that does not say is not
        # cached (two engines could load other weights under one name).
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
        if not path:
            _keep(request, _NOT_CACHEABLE)
            return None
        adapter = f"{getattr(lora, 'lora_name', None) or ''}\x00{path}"
    media = []
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        pos = getattr(feature, "mm_position", None)
        if ident is None or pos is None:
            media = None
            break
        media.append((ident, int(pos.offset), int(pos.length)))
    if media is None or (not media and getattr(request, "mm_inputs", None)):
        _keep(request, _NOT_CACHEABLE)
        return None
    embeds = getattr(request, "prompt_embeds", None)
    extras = flexkvd.BlockExtras(block_size, cache_salt=getattr(request, "cache_salt", None), adapter=adapter,
                                media=media, embeds=None if embeds is None else _tensor_rows(embeds),
                                embeds_tokens=0 if embeds is None else int(embeds.shape[0]))
    _keep(request, extras)
    return extras


_NOT_CACHEABLE = object()


def _keep(request: Any, value: Any) -> None:
    try:
        request._flexkvd_extras = value
    except AttributeError:  # a request object that takes no attributes: computed again next time
        pass


def _tensor_rows(tensor: Any) -> Any:
    """rows(start, end): the bytes of tensor[start:end] - a torch tensor of any dtype on any device, or a NumPy
    array."""
    def rows(start: int, end: int) -> bytes:
        part = tensor[start:end]
        if not hasattr(part, "contiguous"):  # NumPy: its bytes in C order
            return part.tobytes()
        import torch
        return part.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return rows
