"""examples/vllm_dp_rank.py: two vLLM-like DP ranks, one after the other, share one daemon's cache.

The host variant runs everywhere (--host: KV in memory shared with the daemon). The GPU variants need torch with
CUDA (the device machine) and run the same ranks with torch's caching allocator and with expandable segments
(cuMem/VMM), checking every loaded block byte for byte. Its load step releases the pins also when a load fails,
and it ends its session before it drops its KV cache."""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import weakref

import pytest

import flexkvd
from conftest import REPO
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE, tokens

EXAMPLE = os.path.join(REPO, "examples", "vllm_dp_rank.py")
SMALL = ["--layers", "4", "--num-blocks", "128"]


def load_example():
    spec = importlib.util.spec_from_file_location("vllm_dp_rank", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_saved(extra_args) -> tuple:
    """Tokens rank 0 and rank 1 save, by replaying the example's workload against a set of stored keys."""
    example = load_example()
    args = example.parse_args(extra_args)
    stored, saved0, total_full = set(), 0, 0
    for _, prompt in example.workload(args):
        keys = flexkvd.block_keys(args.namespace, prompt, args.block_size).hex()
        hit = 0
        while hit < len(keys) and keys[hit] in stored:
            hit += 1
        saved0 += hit * args.block_size
        total_full += len(keys) * args.block_size
        stored.update(keys)
    return saved0, total_full


def run_rank(daemon, rank, extra_args, env_extra=None):
    env = {**os.environ, "FLEXKV_SOCKET": daemon.socket, **(env_extra or {})}
    out = subprocess.run([sys.executable, EXAMPLE, "--dp-rank", str(rank)] + extra_args, capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    print(out.stdout)
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: ")
    return json.loads(last[len("summary: "):]), out.stdout


def check_two_ranks(daemon, extra_args, backend, env_extra=None):
    saved0, total_full = expected_saved(extra_args)
    r0, _ = run_rank(daemon, 0, extra_args, env_extra)
    r1, out1 = run_rank(daemon, 1, extra_args + ["--layerwise"], env_extra)
    assert r0["backend"] == r1["backend"] == backend
    assert r0["verified"] and r1["verified"]
    assert r0["requests"] == r1["requests"] == 9
    assert r0["saved_tokens"] == saved0 > 0  # the shared system prompt and earlier turns
    assert r1["saved_tokens"] == total_full  # everything rank 0 stored
    assert r1["stored_mib"] == 0 and r0["stored_mib"] > 0
    assert r0["load_gbps"] > 0 and r0["store_gbps"] > 0 and r1["load_gbps"] > 0
    assert r1["layer0_ms_p50"] is not None
    assert "verified" in out1 and "MISMATCH" not in out1


def test_two_host_ranks_share_the_cache(daemon):
    check_two_ranks(daemon, ["--host"] + SMALL, "host")


def cuda_torch() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() == "True"


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"], ids=["caching-allocator", "expandable-segments"])
def test_two_gpu_ranks_share_the_cache(make_daemon, alloc_conf):
    if not cuda_torch():
        pytest.skip("needs torch with CUDA (the device machine)")
    daemon = make_daemon(pool_size="1GiB")
    check_two_ranks(daemon, SMALL, "gpu", {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf} if alloc_conf else None)


def test_a_failed_load_still_releases_the_pins(client, observer):
    """The example's load step: the pinned match handle is released even when the load raises (here OutOfRange, a
    block id past the registered KV blocks), so the blocks do not stay pinned for the rest of the session."""
    example = load_example()
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(21, 4), TEST_GEOMETRY.tokens_per_block)
    client.store(keys, range(4)).wait(5)
    hit = client.match(keys, pin=True).wait(5)
    assert observer.status().pinned_blocks == 4
    with pytest.raises(flexkvd.OutOfRange):
        example.load_cached(client, hit.match_handle, [4, 5, 6, 99], layerwise=False)
    assert observer.status().pinned_blocks == 0
    with pytest.raises(flexkvd.NotFound):  # released: the handle is gone
        client.load(hit.match_handle, [4]).wait(5)
    assert example.load_cached(client, client.match(keys, pin=True).wait(5).match_handle, [4, 5, 6, 7],
                               layerwise=True)[0] == 4
    assert observer.status().pinned_blocks == 0
    del buf


def test_the_example_ends_its_session_before_it_drops_its_kv_cache(daemon, monkeypatch):
    """The KV buffers must outlive the registration (the daemon may copy into them until the session ends; freed GPU
    tensors go back to the allocator): main() closes the client while its KvCache is still alive, and only then
    lets it go. Run in this process with the host backend, watching Client.close."""
    example = load_example()
    caches = []
    alive_at_close = []
    init, close = example.KvCache.__init__, flexkvd.Client.close

    clients = []

    def tracked_init(self, args, client, geometry):
        init(self, args, client, geometry)
        caches.append(weakref.ref(self))
        clients.append(client)

    def watched_close(self):
        if any(self is c for c in clients):  # not a client of another test that the GC closes meanwhile
            alive_at_close.append([ref() is not None for ref in caches])
        close(self)

    monkeypatch.setattr(example.KvCache, "__init__", tracked_init)
    monkeypatch.setattr(flexkvd.Client, "close", watched_close)
    monkeypatch.setattr(sys, "argv", ["vllm_dp_rank.py", "--socket", daemon.socket, "--host"] + SMALL)
    assert example.main() == 0
    assert len(caches) == 1 and alive_at_close[0] == [True], alive_at_close
    gc.collect()
    assert caches[0]() is None  # and dropped after
    with flexkvd.connect(daemon.socket) as observer:
        assert observer.status().sessions == 0
