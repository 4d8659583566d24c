"""MiniVllm: the calls vLLM V1 makes on a KV connector, in vLLM's order, around the connector's logic classes (tests
of flexkvd.integrations.vllm without vLLM). Each step follows vllm/v1/core/sched/scheduler.py and
vllm/v1/worker/kv_connector_model_runner_mixin.py (main branch):

  Scheduler.schedule()           running requests get their next chunk; waiting ones with num_computed_tokens == 0
                                 are looked up (get_num_new_matched_tokens with the local hit), get blocks
                                 (update_state_after_alloc) and either wait for an async load (WAITING_FOR_REMOTE_KVS)
                                 or run; build_connector_meta(scheduler_output) closes the step.
  execute_model (worker)         start_load_kv, the forward (here: writing each completed block's KV), then
                                 get_finished(finished_req_ids) and get_block_ids_with_load_errors.
  Scheduler.update_from_output() load errors truncate a waiting request's num_computed_tokens
                                 (_update_requests_with_invalid_blocks); finished requests call request_finished
                                 (_free_request) and free their blocks unless it answered True;
                                 update_connector_output, then finished_recving promotes a waiting request (or
                                 frees a finished one's blocks) and finished_sending frees blocks
                                 (_update_from_kv_xfer_finished).
  finish_requests (abort)        request_finished; a request waiting for its load keeps its blocks until
                                 finished_recving.
  _preempt_request               a running request's blocks are freed, num_computed_tokens = 0, it waits again and
                                 its id goes to the next scheduler_output.preempted_req_ids.

Hybrid models (vLLM's hybrid memory allocator): a request holds one block list per KV cache group, each indexed by
block position, over one block pool whose block 0 is the null block. A sliding-window group's positions that left
the window become the null block (vLLM's remove_skipped_blocks: the blocks before num_computed - window + 1), and so
do a Mamba group's states before the last completed block (the state after block i sits at position i); a load
allocates no block where the request will not need one (window positions before e - w, states before e - 1).

The engine's KV is the worker's host KV buffers (one per component); a block's KV (and a state snapshot after a
block) is a pure function of its block key and component (as real KV is of its prefix), so any block can be checked
byte for byte. Requests carry what changes their KV besides tokens (flexkvd.BlockExtras: salt, adapter, media,
prompt embeddings) into their keys. Requests "finish" when their prompt is prefilled.
The helpers at the end (NS, BS, prompt, config) are shared by test_vllm_connector.py and test_vllm_adapter.py.
"""
from __future__ import annotations

import dataclasses
import pickle
import random
import time
from typing import Callable, Dict, List, Optional, Set

import numpy as np

import flexkvd
from engine_process import TEST_GEOMETRY
from flexkvd.geometry import ComponentKind
from flexkvd.integrations._vllm_groups import FULL, MAMBA, NULL_BLOCK, SLIDING_WINDOW, GroupMap, KvGroup
from flexkvd.integrations._vllm_link import LinkOptions
from flexkvd.integrations._vllm_logic import ConnectorConfig, SchedulerLogic
from flexkvd.integrations._vllm_worker import WorkerLogic


class HostKvEngine:
    """The paged KV cache on a worker's host KV buffers, per component and layer [planes][num_blocks][chunk]
    (LAYER_FIRST); a state component's "block" is a state slot."""

    def __init__(self, worker: WorkerLogic, num_blocks: int) -> None:
        self.worker = worker
        self.geometry = worker.config.geometry
        self.num_blocks = num_blocks
        self._generation = -1
        self._kv: Dict[int, np.ndarray] = {}

    def kv_of(self, component: int = 0) -> np.ndarray:
        """[layer][plane][block][chunk] bytes of a component; re-fetched when the worker replaced its buffers (daemon
        restart)."""
        if self._generation != self.worker.kv_generation:
            self._kv = {}
            self._generation = self.worker.kv_generation
        if component not in self._kv:
            g = self.geometry.component(component)
            self._kv[component] = np.frombuffer(self.worker.host_kv(component), dtype=np.uint8).reshape(
                g.num_layers, g.kv_planes, self.num_blocks, g.chunk_bytes_per_rank)
        return self._kv[component]

    @property
    def kv(self) -> np.ndarray:
        return self.kv_of(0)

    def release(self) -> None:
        self._kv = {}
        self._generation = -1

    def content(self, key: flexkvd.BlockKey, component: int = 0) -> np.ndarray:
        g = self.geometry.component(component)
        rng = np.random.default_rng([key.lo, key.hi, component])
        return rng.integers(0, 256, size=(g.num_layers, g.kv_planes, g.chunk_bytes_per_rank), dtype=np.uint8)

    def compute(self, keys: flexkvd.BlockKeys, ids: List[int], component: int = 0) -> None:
        """The forward pass: writes the KV of these blocks (a state component: the snapshot after each block)."""
        kv = self.kv_of(component)
        for key, b in zip(keys, ids):
            kv[:, :, b, :] = self.content(key, component)

    def poison(self, ids: List[int]) -> None:
        for c in range(self.geometry.component_count):
            self.kv_of(c)[:, :, [b for b in ids if b != NULL_BLOCK], :] = 0xEE

    def holds(self, keys: flexkvd.BlockKeys, ids: List[int], component: int = 0) -> bool:
        kv = self.kv_of(component)
        return all(np.array_equal(kv[:, :, b, :], self.content(k, component)) for k, b in zip(keys, ids))


@dataclasses.dataclass
class Request:
    request_id: str
    tokens: List[int]
    extras: Optional[flexkvd.BlockExtras] = None  # salt, adapter, media, prompt embeddings: part of the keys
    status: str = "waiting"  # waiting | remote (WAITING_FOR_REMOTE_KVS) | running | preempted | finished
    num_computed_tokens: int = 0
    groups: List[List[int]] = dataclasses.field(default_factory=list)  # block ids per KV cache group, by position
    full_group: int = 0
    external_tokens: int = 0  # promised by the connector at the last lookup
    lookups: List[int] = dataclasses.field(default_factory=list)  # every answer of get_num_new_matched_tokens
    load_failed: bool = False  # the load in flight reported errors
    load_failures: int = 0
    loaded_ok: Optional[bool] = None  # bytes of the loaded prefix checked when the load was reported
    blocks_held: bool = False  # finished but blocks kept for the connector (delay free)
    num_preemptions: int = 0

    @property
    def block_ids(self) -> List[int]:
        """The full-attention group's blocks."""
        return self.groups[self.full_group] if self.groups else []


class MiniVllm:
    """vLLM's scheduler loop around SchedulerLogic + WorkerLogic (TP rank 0) + HostKvEngine. chunk_tokens: the
    token budget per request per step (chunked prefill); local_hits: request id -> tokens vLLM's own prefix cache
    holds (passed to get_num_new_matched_tokens, as vLLM passes its block-aligned local hit; those blocks hold their
    KV, as vLLM's cached blocks do)."""

    def __init__(self, scheduler: SchedulerLogic, worker: WorkerLogic, engine: HostKvEngine,
                 chunk_tokens: int = 1 << 20) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.engine = engine
        self.bs = scheduler.block_size
        self.chunk_tokens = chunk_tokens
        self.group_map: GroupMap = scheduler.groups
        geometry = scheduler.config.geometry
        self.windows: Dict[int, int] = {}  # group -> window tokens
        self.states: Set[int] = set()  # groups holding states
        for slot in self.group_map.slots:
            if slot.kind == ComponentKind.SLIDING_WINDOW:
                self.windows[slot.group] = geometry.components[slot.component - 1].window_tokens
            elif slot.kind == ComponentKind.STATE:
                self.states.add(slot.group)
        # False: an engine that keeps every window block and state it computed (vLLM's mamba_cache_mode "all" for
        # states) instead of dropping those a request no longer needs.
        self.trim = True
        self.free: List[int] = list(range(1, engine.num_blocks))[::-1]  # block 0 is the null block
        self.requests: Dict[str, Request] = {}
        self.local_hits: Dict[str, int] = {}
        self.finished_req_ids: Set[str] = set()
        self.preempted_req_ids: Set[str] = set()
        self.finished_recving: Set[str] = set()
        self.load_errors_seen: Set[int] = set()
        # Called with each step's metadata between the scheduler and the worker (a test's fault goes there).
        self.before_worker: Optional[Callable[[object], None]] = None

    # ---- the engine's entry points ----

    def add(self, request_id: str, tokens: List[int], extras: Optional[flexkvd.BlockExtras] = None) -> Request:
        r = Request(request_id, list(tokens), extras, full_group=self.group_map.full_group)
        self.requests[request_id] = r
        return r

    def keys(self, r: Request, n_tokens: Optional[int] = None) -> flexkvd.BlockKeys:
        """The request's block keys over its first n_tokens (all) tokens, as the scheduler keys them."""
        tokens = r.tokens if n_tokens is None else r.tokens[:n_tokens]
        n = len(tokens) // self.bs
        extras = r.extras.for_blocks(n) if r.extras is not None else None
        return flexkvd.block_keys(self.scheduler.config.namespace, tokens, self.bs, extras)

    def step(self) -> None:
        scheduled = self._schedule()
        # The executor sends the scheduler output (and the connector metadata in it) to the worker processes.
        meta = pickle.loads(pickle.dumps(self.scheduler.build_connector_meta(self.preempted_req_ids)))
        self.preempted_req_ids = set()
        finished_ids, self.finished_req_ids = self.finished_req_ids, set()
        # execute_model: start_load_kv, the forward, then get_finished + get_block_ids_with_load_errors.
        if self.before_worker is not None:
            self.before_worker(meta)
        self.worker.start(meta)
        for r, n in scheduled:
            self._forward(r, n)
        sending, recving = self.worker.get_finished(finished_ids)
        errors = self.worker.take_load_errors()
        self._update_from_output(scheduled, sending or set(), recving or set(), errors)

    def run(self, timeout: float = 30.0) -> int:
        """Steps until no request is unfinished and no block is held for the connector, as vLLM's engine loop keeps
        stepping while the connector has transfers in flight (Scheduler.has_requests); returns the steps taken.
        `timeout` only bounds a broken run (it fails then): nothing here measures time."""
        deadline = time.monotonic() + timeout
        steps = 0
        while not all(r.status == "finished" and not r.blocks_held for r in self.requests.values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"requests not done after {steps} steps: "
                                     f"{[(r.request_id, r.status, r.blocks_held) for r in self.requests.values()]}")
            self.step()
            steps += 1
            time.sleep(0.0002)  # an engine step takes time; the daemon's copies run meanwhile
        return steps

    def abort(self, request_id: str) -> bool:
        """Scheduler.finish_requests(FINISHED_ABORTED); returns whether the blocks were kept for the connector."""
        r = self.requests[request_id]
        delay = r.status == "remote" and request_id not in self.finished_recving
        self.finished_recving.discard(request_id)
        r.status = "finished"
        return self._free_request(r, delay)

    def preempt(self, request_id: str) -> None:
        """Scheduler._preempt_request on a running request."""
        r = self.requests[request_id]
        assert r.status == "running", r.status
        self._free_blocks(r)
        r.status = "preempted"
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.preempted_req_ids.add(request_id)

    # ---- Scheduler.schedule ----

    def _schedule(self) -> List[tuple]:
        scheduled = []
        for r in self.requests.values():
            if r.status == "running" and r.num_computed_tokens < len(r.tokens):
                n = min(self.chunk_tokens, len(r.tokens) - r.num_computed_tokens)
                self._allocate(r, r.num_computed_tokens + n, r.num_computed_tokens)
                scheduled.append((r, n))
        for r in self.requests.values():
            if r.status == "remote":
                if r.request_id not in self.finished_recving:
                    continue
                self._promote(r)
            if r.status not in ("waiting", "preempted"):
                continue
            external, load_async = 0, False
            if r.num_computed_tokens == 0:
                local = self.local_hits.get(r.request_id, 0) // self.bs * self.bs
                external, load_async = self.scheduler.get_num_new_matched_tokens(
                    r.request_id, r.tokens, local, True, r.num_preemptions, r.extras)
                assert external + local <= len(r.tokens)
                r.lookups.append(external)
                r.external_tokens = external
                if local:
                    self._hit_locally(r, local)
                r.num_computed_tokens = local
            if load_async:
                self._allocate(r, r.num_computed_tokens + external, r.num_computed_tokens + external)
                self.scheduler.update_state_after_alloc(r.request_id, [list(g) for g in r.groups], external,
                                                        r.num_preemptions)
                r.num_computed_tokens += external
                r.status = "remote"
                continue
            if external:  # a synchronous hit (load_mode "layerwise"): loaded in this step, counted as computed
                n = min(self.chunk_tokens, len(r.tokens) - r.num_computed_tokens - external)
                self._allocate(r, r.num_computed_tokens + external + n, r.num_computed_tokens + external)
                self.scheduler.update_state_after_alloc(r.request_id, [list(g) for g in r.groups], external,
                                                        r.num_preemptions)
                r.num_computed_tokens += external
                r.status = "running"
                scheduled.append((r, n))
                continue
            n = min(self.chunk_tokens, len(r.tokens) - r.num_computed_tokens)
            self._allocate(r, r.num_computed_tokens + n, r.num_computed_tokens)
            self.scheduler.update_state_after_alloc(r.request_id, [list(g) for g in r.groups], 0)
            r.status = "running"
            scheduled.append((r, n))
        return scheduled

    def _hit_locally(self, r: Request, local: int) -> None:
        """vLLM's own prefix cache holds the first `local` tokens: the blocks it hands the request hold their KV
        (full attention [0, k), a window's [k - w, k), the state at k), the positions it does not need are null."""
        k = local // self.bs
        self._allocate(r, local, local)
        keys = self.keys(r, local)
        for slot in self.group_map.slots:
            ids = r.groups[slot.group]
            if slot.kind == ComponentKind.FULL:
                need = range(0, k)
            elif slot.kind == ComponentKind.SLIDING_WINDOW:
                need = range(max(0, k - slot.window_blocks), k)
            else:
                need = range(k - 1, k)
            self.engine.compute(keys[need.start:need.stop], ids[need.start:need.stop], slot.component)

    def _promote(self, r: Request) -> None:
        """Scheduler._update_waiting_for_remote_kv: the load was reported; check the bytes the request now holds
        (its local prefix and what was loaded: full attention [0, e), each window before e, the state at e)."""
        self.finished_recving.discard(r.request_id)
        e = r.num_computed_tokens // self.bs
        keys = self.keys(r)
        ok = True
        for slot in self.group_map.slots:
            ids = r.groups[slot.group]
            if slot.kind == ComponentKind.FULL:
                lo = 0
            elif slot.kind == ComponentKind.SLIDING_WINDOW:
                lo = max(0, e - slot.window_blocks)
            else:
                lo = max(0, e - 1)
            ok = ok and self.engine.holds(keys[lo:e], ids[lo:e], slot.component)
        r.loaded_ok = ok
        if r.load_failed:
            r.load_failures += 1
            r.load_failed = False
            if r.num_computed_tokens == 0:
                self._free_blocks(r)  # nothing valid: vLLM frees the blocks and looks the request up again
        elif r.num_computed_tokens == len(r.tokens):
            r.num_computed_tokens -= 1  # a full prompt hit recomputes its last token
        r.status = "preempted" if r.num_preemptions else "waiting"

    # ---- execute_model and update_from_output ----

    def _forward(self, r: Request, n: int) -> None:
        """Writes the KV of the blocks this chunk completes (and of the partial tail, which is never keyed): every
        group's block at those positions (a state group: the state after each completed block)."""
        start, end = r.num_computed_tokens, r.num_computed_tokens + n
        keys = self.keys(r, end)
        first = start // self.bs
        for slot in self.group_map.slots:
            ids = r.groups[slot.group]
            self.engine.compute(keys[first:], ids[first:len(keys)], slot.component)

    def _update_from_output(self, scheduled: List[tuple], sending: Set[str], recving: Set[str],
                            errors: Set[int]) -> None:
        self.load_errors_seen |= errors
        if errors:  # _handle_invalid_blocks for async loads: truncate at the first failed position of any group
            for r in self.requests.values():
                if r.status != "remote":
                    continue
                n = -(-r.num_computed_tokens // self.bs)
                failed = [i for g in r.groups for i, b in enumerate(g[:n]) if b in errors]
                if failed:
                    r.num_computed_tokens = min(failed) * self.bs
                    r.load_failed = True
        for r, n in scheduled:
            if r.status != "running":
                continue
            r.num_computed_tokens += n
            self._skip_blocks(r, r.num_computed_tokens)
            if r.num_computed_tokens >= len(r.tokens):
                r.status = "finished"
                self._free_request(r, False)
        self.scheduler.update_connector_output(sending, recving, errors)
        for rid in recving:
            r = self.requests[rid]
            if r.status == "remote":
                self.finished_recving.add(rid)
            else:
                assert r.status == "finished" and r.blocks_held, (rid, r.status)
                self._release(r)
        for rid in sending:
            self._release(self.requests[rid])

    def _free_request(self, r: Request, delay: bool) -> bool:
        """Scheduler._free_request: request_finished(_all_groups) with the blocks of the computed tokens."""
        n_blocks = -(-r.num_computed_tokens // self.bs)
        connector_delay = self.scheduler.request_finished(r.request_id, r.tokens, [g[:n_blocks] for g in r.groups],
                                                          r.num_computed_tokens, True, r.extras)
        self.finished_req_ids.add(r.request_id)
        if delay or connector_delay:
            r.blocks_held = True
        else:
            self._free_blocks(r)
        return delay or connector_delay

    def _release(self, r: Request) -> None:
        assert r.blocks_held, r.request_id
        r.blocks_held = False
        self._free_blocks(r)

    def _allocate(self, r: Request, tokens: int, computed: int) -> None:
        """Blocks for every position up to `tokens`; positions a group will not need with `computed` tokens done
        (a window's skipped blocks, states before the last completed block) get the null block."""
        if not r.groups:
            r.groups = [[] for _ in range(self.group_map.num_groups)]
        positions = -(-tokens // self.bs)
        for g, ids in enumerate(r.groups):
            while len(ids) < positions:
                i = len(ids)
                if self._skipped(g, i, computed):
                    ids.append(NULL_BLOCK)
                    continue
                assert self.free, "MiniVllm ran out of KV blocks"
                ids.append(self.free.pop())

    def _skipped(self, group: int, position: int, computed: int) -> bool:
        if not self.trim:
            return False
        if group in self.windows:  # SlidingWindowManager: the first computed - window + 1 tokens are skipped
            return (position + 1) * self.bs <= max(0, computed - self.windows[group] + 1)
        if group in self.states:  # only the state after the last completed block is kept
            return position < computed // self.bs - 1
        return False

    def _skip_blocks(self, r: Request, computed: int) -> None:
        """vLLM's remove_skipped_blocks after a step: the blocks a window or state group no longer needs go back."""
        for g, ids in enumerate(r.groups):
            for i, b in enumerate(ids):
                if b != NULL_BLOCK and self._skipped(g, i, computed):
                    self.engine.poison([b])
                    self.free.append(b)
                    ids[i] = NULL_BLOCK

    def _free_blocks(self, r: Request) -> None:
        held = [b for g in r.groups for b in g if b != NULL_BLOCK]
        if held:
            self.engine.poison(held)  # a freed block's old KV must never pass for a load's
        self.free.extend(reversed(held))
        r.groups = []


# ---- shared by the vLLM connector tests ----

NS = "vllm|pytest-llama|main|bfloat16|tp1"
BS = TEST_GEOMETRY.tokens_per_block


def prompt(seed: int, n_tokens: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(128000) for _ in range(n_tokens)]


def config(socket: str, geometry: flexkvd.Geometry = TEST_GEOMETRY, namespace: str = NS,
           groups: Optional[GroupMap] = None) -> ConnectorConfig:
    return ConnectorConfig(namespace=namespace, geometry=geometry,
                           link=LinkOptions(socket=socket, connect_timeout_s=1.0), op_timeout_s=2.0, groups=groups)


# Hybrid models' KV cache groups as vLLM lists them (KvGroup), small: 16 KiB full-attention blocks.
GPT_OSS_GROUPS = [  # vLLM's group order need not put the full-attention group first
    KvGroup(SLIDING_WINDOW, 2, BS, 2, 64, 2, sliding_window=3 * BS, spec="SlidingWindowSpec"),
    KvGroup(FULL, 2, BS, 2, 64, 2, spec="FullAttentionSpec"),
]
QWEN3_NEXT_GROUPS = [
    KvGroup(FULL, 2, BS, 2, 64, 2, spec="FullAttentionSpec"),
    KvGroup(MAMBA, 2, BS, state_bytes=2048, spec="MambaSpec"),
    KvGroup(MAMBA, 2, BS, state_bytes=1024, spec="MambaSpec"),
]
