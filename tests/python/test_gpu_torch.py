"""GPU: two PyTorch engine processes share KV blocks through flexkvd (the CUDA backend), with KV caches from
torch's default caching allocator (cudaMalloc, CUDA IPC handles) and from expandable segments (cuMem/VMM,
shareable fds), and across the two. Skipped where torch or a GPU is missing (this CI machine has neither)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
ALLOC = {"caching": "", "expandable": "expandable_segments:True"}


def engine(socket: str, alloc: str, *args: str) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if ALLOC[alloc]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC[alloc]
    p = subprocess.run([sys.executable, os.path.join(HERE, "torch_engine.py"), "--socket", socket, *args], env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert lines, f"engine printed nothing (exit {p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("writer,reader", [("caching", "caching"), ("expandable", "expandable"),
                                           ("caching", "expandable"), ("expandable", "caching")])
def test_torch_kv_round_trip_between_two_engine_processes(make_daemon, writer, reader):
    d = make_daemon(pool_size="1GiB")
    stored = engine(d.socket, writer, "--role", "store", "--seed", "7", "--blocks", "256")
    assert "error" not in stored, f"{stored}\n{d.stderr()}"
    assert stored["vmm"] == (writer == "expandable")  # the allocator really gave the memory kind under test
    assert (stored["hits"], stored["done"]) == (0, 256)
    loaded = engine(d.socket, reader, "--role", "load", "--seed", "7", "--blocks", "256", "--first", "100")
    assert "error" not in loaded, f"{loaded}\n{d.stderr()}"
    assert loaded["vmm"] == (reader == "expandable")
    assert loaded["uuid"] == stored["uuid"]
    assert (loaded["hits"], loaded["done"]) == (256, 256)
    assert loaded["equal"], "loaded KV bytes differ from the stored ones"
    assert loaded["untouched"], "blocks outside the load's destination were written"
    print(f"\n{writer}->{reader}: store {stored['gbps']:.1f} GB/s, load {loaded['gbps']:.1f} GB/s "
          "(256 blocks of 512 KiB, from Python, including the waits)")
