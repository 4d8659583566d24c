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

The engine's KV is the worker's host KV buffer; a block's KV is a pure function of its block key (as real KV is of
its prefix), so any block can be checked byte for byte. Requests "finish" when their prompt is prefilled.
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
from flexkvd.integrations._vllm_link import LinkOptions
from flexkvd.integrations._vllm_logic import ConnectorConfig, SchedulerLogic
from flexkvd.integrations._vllm_worker import WorkerLogic


class HostKvEngine:
    """The paged KV cache on a worker's host KV buffer, per layer [planes][num_blocks][chunk] (LAYER_FIRST)."""

    def __init__(self, worker: WorkerLogic, num_blocks: int) -> None:
        self.worker = worker
        self.geometry = worker.config.geometry
        self.num_blocks = num_blocks
        self._generation = -1
        self._kv: Optional[np.ndarray] = None

    @property
    def kv(self) -> np.ndarray:
        """[layer][plane][block][chunk] bytes; re-fetched when the worker replaced its buffer (daemon restart)."""
        if self._generation != self.worker.kv_generation:
            g = self.geometry
            self._kv = np.frombuffer(self.worker.host_kv(), dtype=np.uint8).reshape(
                g.num_layers, g.kv_planes, self.num_blocks, g.chunk_bytes_per_rank)
            self._generation = self.worker.kv_generation
        return self._kv

    def release(self) -> None:
        self._kv = None
        self._generation = -1

    def content(self, key: flexkvd.BlockKey) -> np.ndarray:
        g = self.geometry
        rng = np.random.default_rng([key.lo, key.hi])
        return rng.integers(0, 256, size=(g.num_layers, g.kv_planes, g.chunk_bytes_per_rank), dtype=np.uint8)

    def compute(self, keys: flexkvd.BlockKeys, ids: List[int]) -> None:
        """The forward pass: writes the KV of these blocks."""
        kv = self.kv
        for key, b in zip(keys, ids):
            kv[:, :, b, :] = self.content(key)

    def poison(self, ids: List[int]) -> None:
        self.kv[:, :, ids, :] = 0xEE

    def holds(self, keys: flexkvd.BlockKeys, ids: List[int]) -> bool:
        kv = self.kv
        return all(np.array_equal(kv[:, :, b, :], self.content(k)) for k, b in zip(keys, ids))


@dataclasses.dataclass
class Request:
    request_id: str
    tokens: List[int]
    status: str = "waiting"  # waiting | remote (WAITING_FOR_REMOTE_KVS) | running | preempted | finished
    num_computed_tokens: int = 0
    block_ids: List[int] = dataclasses.field(default_factory=list)
    external_tokens: int = 0  # promised by the connector at the last lookup
    lookups: List[int] = dataclasses.field(default_factory=list)  # every answer of get_num_new_matched_tokens
    load_failed: bool = False  # the load in flight reported errors
    load_failures: int = 0
    loaded_ok: Optional[bool] = None  # bytes of the loaded prefix checked when the load was reported
    blocks_held: bool = False  # finished but blocks kept for the connector (delay free)
    num_preemptions: int = 0


class MiniVllm:
    """vLLM's scheduler loop around SchedulerLogic + WorkerLogic (TP rank 0) + HostKvEngine. chunk_tokens: the
    token budget per request per step (chunked prefill); local_hits: request id -> tokens vLLM's own prefix cache
    holds (passed to get_num_new_matched_tokens, as vLLM passes its block-aligned local hit)."""

    def __init__(self, scheduler: SchedulerLogic, worker: WorkerLogic, engine: HostKvEngine,
                 chunk_tokens: int = 1 << 20) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.engine = engine
        self.bs = scheduler.block_size
        self.chunk_tokens = chunk_tokens
        self.free: List[int] = list(range(engine.num_blocks))[::-1]
        self.requests: Dict[str, Request] = {}
        self.local_hits: Dict[str, int] = {}
        self.finished_req_ids: Set[str] = set()
        self.preempted_req_ids: Set[str] = set()
        self.finished_recving: Set[str] = set()
        self.load_errors_seen: Set[int] = set()
        # Called with each step's metadata between the scheduler and the worker (a test's fault goes there).
        self.before_worker: Optional[Callable[[object], None]] = None

    # ---- the engine's entry points ----

    def add(self, request_id: str, tokens: List[int]) -> Request:
        r = Request(request_id, list(tokens))
        self.requests[request_id] = r
        return r

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
                self._allocate(r, r.num_computed_tokens + n)
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
                external, load_async = self.scheduler.get_num_new_matched_tokens(r.request_id, r.tokens, local,
                                                                                 True, r.num_preemptions)
                assert external + local <= len(r.tokens)
                r.lookups.append(external)
                r.external_tokens = external
                r.num_computed_tokens = local
            if load_async:
                self._allocate(r, r.num_computed_tokens + external)
                self.scheduler.update_state_after_alloc(r.request_id, list(r.block_ids), external, r.num_preemptions)
                r.num_computed_tokens += external
                r.status = "remote"
                continue
            n = min(self.chunk_tokens, len(r.tokens) - r.num_computed_tokens)
            self._allocate(r, r.num_computed_tokens + n)
            self.scheduler.update_state_after_alloc(r.request_id, list(r.block_ids), 0)
            r.status = "running"
            scheduled.append((r, n))
        return scheduled

    def _promote(self, r: Request) -> None:
        """Scheduler._update_waiting_for_remote_kv: the load was reported; check the bytes it brought."""
        self.finished_recving.discard(r.request_id)
        n = r.num_computed_tokens // self.bs
        keys = flexkvd.block_keys(self.scheduler.config.namespace, r.tokens, self.bs)
        r.loaded_ok = self.engine.holds(keys[:n], r.block_ids[:n])
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
        """Writes the KV of the blocks this chunk completes (and of the partial tail, which is never keyed)."""
        start, end = r.num_computed_tokens, r.num_computed_tokens + n
        keys = flexkvd.block_keys(self.scheduler.config.namespace, r.tokens[:end], self.bs)
        first = start // self.bs
        self.engine.compute(keys[first:], r.block_ids[first:len(keys)])

    def _update_from_output(self, scheduled: List[tuple], sending: Set[str], recving: Set[str],
                            errors: Set[int]) -> None:
        self.load_errors_seen |= errors
        if errors:  # _handle_invalid_blocks for async loads: truncate at the first failed block
            for r in self.requests.values():
                if r.status != "remote":
                    continue
                for idx, b in enumerate(r.block_ids[:-(-r.num_computed_tokens // self.bs)]):
                    if b in errors:
                        r.num_computed_tokens = idx * self.bs
                        r.load_failed = True
                        break
        for r, n in scheduled:
            if r.status != "running":
                continue
            r.num_computed_tokens += n
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
        """Scheduler._free_request: request_finished with the blocks of the computed tokens."""
        n_blocks = -(-r.num_computed_tokens // self.bs)
        connector_delay = self.scheduler.request_finished(r.request_id, r.tokens, r.block_ids[:n_blocks],
                                                          r.num_computed_tokens)
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

    def _allocate(self, r: Request, tokens: int) -> None:
        need = -(-tokens // self.bs) - len(r.block_ids)
        assert need <= len(self.free), "MiniVllm ran out of KV blocks"
        for _ in range(max(0, need)):
            r.block_ids.append(self.free.pop())

    def _free_blocks(self, r: Request) -> None:
        if r.block_ids:
            self.engine.poison(r.block_ids)  # a freed block's old KV must never pass for a load's
        self.free.extend(reversed(r.block_ids))
        r.block_ids = []


# ---- shared by the vLLM connector tests ----

NS = "vllm|pytest-llama|main|bfloat16|tp1"
BS = TEST_GEOMETRY.tokens_per_block


def prompt(seed: int, n_tokens: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(128000) for _ in range(n_tokens)]


def config(socket: str, geometry: flexkvd.Geometry = TEST_GEOMETRY, namespace: str = NS) -> ConnectorConfig:
    return ConnectorConfig(namespace=namespace, geometry=geometry,
                           link=LinkOptions(socket=socket, connect_timeout_s=1.0), op_timeout_s=2.0)
