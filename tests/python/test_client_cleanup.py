"""A Python engine that dies or closes (python/flexkv/client.py): the daemon reclaims its session, pins and
in-flight stores; the host KV mapping outlives the views an engine still holds."""
from __future__ import annotations

import gc
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import flexkv
from conftest import settled_status
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE, tokens

ENGINE = [sys.executable, __import__("engine_process").__file__]
TPB = TEST_GEOMETRY.tokens_per_block
# Reclamation is measured in ms by the C++ tests (tests/integration/data_plane_test.cc, <= 100 ms); a Python test
# polling over gRPC on a 2-core VM allows more.
BOUND_S = 1.0


def start_engine(daemon, name, steps):
    argv = ENGINE + ["--socket", daemon.socket, "--name", name, "--kv-blocks", "128"]
    for s in steps:
        argv += ["--do", s]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc, prefix, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.split()
    proc.kill()
    raise AssertionError(f"no {prefix} line; stderr:\n{proc.stderr.read()}")


def wait_clean(observer):
    """Seconds until the daemon holds nothing for dead sessions: no session, no pin, and no slot stuck pending
    (every used slot is an indexed, committed block; a store of a dead session returns its slots when its copy
    ends); or None after 5 s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        s = observer.status()
        if s.sessions == 0 and s.pinned_blocks == 0 and s.used_blocks == s.index_blocks:
            return time.monotonic() - t0, s
        time.sleep(0.002)
    return None, observer.status()


def test_kill_9_of_a_python_engine_holding_pins_and_in_flight_stores_leaks_nothing(daemon, observer):
    seed = start_engine(daemon, "seed", ["store:1:64:0"])
    assert read_until(seed, "STORED")[1:3] == ["0", "64"]
    assert seed.wait(30) == 0
    assert settled_status(observer).sessions == 0
    worst = 0.0
    for round_ in range(3):
        victim = start_engine(daemon, f"victim{round_}", ["pin:1:64", f"inflight-store:{1000 * (round_ + 1)}:16", "hold"])
        assert read_until(victim, "PINNED")[1] == "64"
        assert read_until(victim, "INFLIGHT")[1] == "16"
        before = observer.status()
        assert before.sessions == 1 and before.pinned_blocks >= 64
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        victim.stdout.close()
        victim.stderr.close()
        took, s = wait_clean(observer)
        assert took is not None and took <= BOUND_S, s
        worst = max(worst, took)
    print(f"worst reclamation after kill -9 of a Python engine: {worst * 1000:.1f} ms")


def test_a_daemon_frozen_while_a_client_dies_reclaims_its_submissions(daemon, observer):
    """The engine submits stores and pins while the daemon is stopped, then dies: when the daemon runs again it
    meets ring entries of a dead session and must still end with nothing held."""
    seed = start_engine(daemon, "seed", ["store:2:32:0"])
    assert read_until(seed, "STORED")[1:3] == ["0", "32"]
    seed.wait(30)
    victim = start_engine(daemon, "victim", ["pin:2:32", "hold"])
    assert read_until(victim, "PINNED")[1] == "32"
    code = ("import flexkv, sys, time\n"
            "from engine_process import TEST_GEOMETRY as G, TEST_NAMESPACE as NS, tokens\n"
            f"c = flexkv.connect({daemon.socket!r}); c.attach('frozen-victim', NS, G)\n"
            "kv = c.create_host_kv(flexkv.Layout.BLOCK_FIRST, 64)\n"
            "print('READY', flush=True); sys.stdin.readline()\n"
            "ts = [c.store(flexkv.block_keys(NS, tokens(5000 + j, 4), 16), range(4 * j, 4 * j + 4)) for j in range(16)]\n"
            "ts.append(c.match(flexkv.block_keys(NS, tokens(2, 32), 16), pin=True))\n"
            "print('SUBMITTED', flush=True); time.sleep(3600)\n")
    frozen = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=__import__("os").path.dirname(ENGINE[1]))
    assert read_until(frozen, "READY")
    daemon.freeze()
    try:
        frozen.stdin.write("go\n")
        frozen.stdin.flush()
        assert read_until(frozen, "SUBMITTED")
        frozen.kill()
        victim.kill()
        frozen.wait(10)
        victim.wait(10)
    finally:
        daemon.thaw()
    took, s = wait_clean(observer)
    assert took is not None and took <= BOUND_S, s
    for p in (victim, frozen):
        p.stdout.close()
        p.stderr.close()
    frozen.stdin.close()


def test_close_ends_the_session_and_its_pins(daemon, observer):
    c = flexkv.connect(daemon.socket)
    c.attach("closer", TEST_NAMESPACE, TEST_GEOMETRY)
    buf = c.create_host_kv(flexkv.Layout.BLOCK_FIRST, 16)
    keys = flexkv.block_keys(TEST_NAMESPACE, tokens(3, 4), TPB)
    c.store(keys, range(4)).wait(5)
    c.match(keys, pin=True).wait(5)
    assert observer.status().pinned_blocks == 4
    del buf
    c.close()
    s = observer.status()
    assert (s.sessions, s.pinned_blocks, s.index_blocks) == (0, 0, 4)


def test_detach_refuses_while_host_kv_views_are_alive(daemon, observer):
    c = flexkv.connect(daemon.socket)
    c.attach("viewer", TEST_NAMESPACE, TEST_GEOMETRY)
    buf = c.create_host_kv(flexkv.Layout.BLOCK_FIRST, 16)
    arr = np.frombuffer(buf, dtype=np.uint8)
    tail = buf[100:200]
    del buf
    with pytest.raises(flexkv.FailedPrecondition, match="still referenced"):
        c.detach()
    assert c.attached and observer.status().sessions == 1
    arr[:] = 1  # still mapped: writable
    del arr
    with pytest.raises(flexkv.FailedPrecondition, match="1 views"):
        c.detach()
    del tail
    c.detach()
    assert not c.attached and observer.status().sessions == 0
    c.attach("viewer-again", TEST_NAMESPACE, TEST_GEOMETRY)  # detach then attach again on one client
    assert observer.status().sessions == 1
    c.close()
    assert observer.status().sessions == 0


def test_close_with_live_views_keeps_the_mapping_until_the_last_view_goes(daemon, observer):
    c = flexkv.connect(daemon.socket)
    c.attach("lingering", TEST_NAMESPACE, TEST_GEOMETRY)
    arr = np.frombuffer(c.create_host_kv(flexkv.Layout.BLOCK_FIRST, 16), dtype=np.uint8)
    arr[:] = 7
    c.close()
    with pytest.raises(flexkv.FailedPrecondition, match="closed"):
        c.status()
    assert observer.status().sessions == 1  # the session (and its mapping) lives on for `arr`
    assert int(arr.sum()) == 7 * arr.size  # reading it is safe
    del arr
    gc.collect()
    assert observer.status().sessions == 0


def test_a_client_dropped_without_close_ends_its_session(daemon, observer):
    c = flexkv.connect(daemon.socket)
    c.attach("dropped", TEST_NAMESPACE, TEST_GEOMETRY)
    assert observer.status().sessions == 1
    del c
    gc.collect()
    assert observer.status().sessions == 0
