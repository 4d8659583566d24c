"""A Python engine that dies or closes (python/flexkvd/client.py): the daemon reclaims its session, pins and
in-flight stores; the host KV mapping outlives the views an engine still holds. A daemon that dies: attaching
again recovers, never under live views or beside other calls on the client."""
from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import flexkvd
from flexkvd import _lib
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
    code = ("import flexkvd, sys, time\n"
            "from engine_process import TEST_GEOMETRY as G, TEST_NAMESPACE as NS, tokens\n"
            f"c = flexkvd.connect({daemon.socket!r}); c.attach('frozen-victim', NS, G)\n"
            "kv = c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 64)\n"
            "print('READY', flush=True); sys.stdin.readline()\n"
            "ts = [c.store(flexkvd.block_keys(NS, tokens(5000 + j, 4), 16), range(4 * j, 4 * j + 4)) for j in range(16)]\n"
            "ts.append(c.match(flexkvd.block_keys(NS, tokens(2, 32), 16), pin=True))\n"
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
    c = flexkvd.connect(daemon.socket)
    c.attach("closer", TEST_NAMESPACE, TEST_GEOMETRY)
    buf = c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(3, 4), TPB)
    c.store(keys, range(4)).wait(5)
    c.match(keys, pin=True).wait(5)
    assert observer.status().pinned_blocks == 4
    del buf
    c.close()
    s = observer.status()
    assert (s.sessions, s.pinned_blocks, s.index_blocks) == (0, 0, 4)


def test_detach_refuses_while_host_kv_views_are_alive(daemon, observer):
    c = flexkvd.connect(daemon.socket)
    c.attach("viewer", TEST_NAMESPACE, TEST_GEOMETRY)
    buf = c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    arr = np.frombuffer(buf, dtype=np.uint8)
    tail = buf[100:200]
    del buf
    with pytest.raises(flexkvd.FailedPrecondition, match="still referenced"):
        c.detach()
    assert c.attached and observer.status().sessions == 1
    arr[:] = 1  # still mapped: writable
    del arr
    with pytest.raises(flexkvd.FailedPrecondition, match="1 views"):
        c.detach()
    del tail
    c.detach()
    assert not c.attached and observer.status().sessions == 0
    c.attach("viewer-again", TEST_NAMESPACE, TEST_GEOMETRY)  # detach then attach again on one client
    assert observer.status().sessions == 1
    c.close()
    assert observer.status().sessions == 0


def test_close_with_live_views_keeps_the_mapping_until_the_last_view_goes(daemon, observer):
    c = flexkvd.connect(daemon.socket)
    c.attach("lingering", TEST_NAMESPACE, TEST_GEOMETRY)
    arr = np.frombuffer(c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16), dtype=np.uint8)
    arr[:] = 7
    c.close()
    with pytest.raises(flexkvd.FailedPrecondition, match="closed"):
        c.status()
    assert observer.status().sessions == 1  # the session (and its mapping) lives on for `arr`
    assert int(arr.sum()) == 7 * arr.size  # reading it is safe
    del arr
    gc.collect()
    assert observer.status().sessions == 0


def test_a_client_dropped_without_close_ends_its_session(daemon, observer):
    c = flexkvd.connect(daemon.socket)
    c.attach("dropped", TEST_NAMESPACE, TEST_GEOMETRY)
    assert observer.status().sessions == 1
    del c
    gc.collect()
    assert observer.status().sessions == 0


# ---- the daemon goes away: attach again (the documented recovery), and calls racing the client's lifetime ----

def reattach(c, name):
    """attach() after a daemon restart, as an engine recovers: the first call succeeds (libflexkv waits for its gRPC
    channel to reconnect when the call met the dead daemon's connection)."""
    return c.attach(name, TEST_NAMESPACE, TEST_GEOMETRY)


def test_reattach_after_the_daemon_went_away_refuses_while_old_host_kv_views_live(daemon):
    c = flexkvd.connect(daemon.socket)
    c.attach("phoenix", TEST_NAMESPACE, TEST_GEOMETRY)
    buf = c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = 5
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(7, 4), TPB)
    c.store(keys, range(4)).wait(5)
    daemon.freeze()
    pending = c.match(keys)  # never read by that daemon
    daemon.restart()
    with pytest.raises(flexkvd.Unavailable, match="Attach again"):
        pending.wait(5)
    # libflexkv's re-attach drops the lost session's host KV mapping: not while a view of it is alive.
    with pytest.raises(flexkvd.FailedPrecondition, match="host KV buffer is still referenced"):
        c.attach("phoenix", TEST_NAMESPACE, TEST_GEOMETRY)
    assert int(arr.sum()) == 5 * arr.size  # the refused attach left the mapping alone
    del arr, buf
    sid = reattach(c, "phoenix")
    assert c.session_id == sid and c.attached
    with pytest.raises(flexkvd.FailedPrecondition, match="which has ended"):
        pending.wait(1)
    with pytest.raises(flexkvd.FailedPrecondition, match="which has ended"):
        pending.done()  # an error, not False forever
    buf = c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)  # the new session registers its own buffer
    assert c.match(keys).wait(5).matched_blocks == 4  # the restarted daemon kept the pool
    fresh = flexkvd.block_keys(TEST_NAMESPACE, tokens(8, 2), TPB)
    assert c.store(fresh, range(2)).wait(5).done_blocks == 2
    with flexkvd.connect(daemon.socket) as observer:
        assert observer.status().sessions == 1
        del buf
        c.close()
        assert observer.status().sessions == 0


def test_a_failed_reattach_leaves_the_client_detached_and_its_tickets_ended(daemon):
    c = flexkvd.connect(daemon.socket)
    c.attach("orphan", TEST_NAMESPACE, TEST_GEOMETRY)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(9, 1), TPB)
    daemon.freeze()
    pending = c.match(keys)
    daemon.kill()
    with pytest.raises(flexkvd.Unavailable):
        c.attach("orphan", TEST_NAMESPACE, TEST_GEOMETRY)  # nobody answers; libflexkv dropped the lost session
    assert not c.attached
    with pytest.raises(flexkvd.FailedPrecondition, match="which has ended"):
        pending.try_wait()
    with pytest.raises(flexkvd.FailedPrecondition):
        pending.done()
    daemon.restart()
    reattach(c, "orphan")
    assert c.match(keys).wait(5).matched_blocks == 0
    c.close()


def test_attach_and_detach_run_beside_a_waiting_thread(daemon):
    """libflexkv lets attach and detach race other calls (each call holds its own reference to the session it
    started on): an attach refused because the session is alive leaves a waiting thread alone, and a detach ends
    that thread's wait at once with FailedPrecondition, never with another request's result. (Before libflexkv
    shared its session state this way, attach and detach had to wait for every other call on the client.)"""
    c = flexkvd.connect(daemon.socket)
    c.attach("beside", TEST_NAMESPACE, TEST_GEOMETRY)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(10, 1), TPB)
    daemon.freeze()
    try:
        ticket = c.match(keys)
        outcomes = []

        def waiter() -> None:
            try:
                outcomes.append(ticket.wait(60).matched_blocks)
            except flexkvd.Error as e:
                outcomes.append(e)

        th = threading.Thread(target=waiter)
        th.start()
        deadline = time.monotonic() + 5
        while c._handle._users == 0 and time.monotonic() < deadline:  # until the waiter is inside libflexkv
            time.sleep(0.001)
        with pytest.raises(flexkvd.FailedPrecondition, match="already attached"):  # the session is alive
            c.attach("beside", TEST_NAMESPACE, TEST_GEOMETRY)
        assert th.is_alive() and not outcomes  # still waiting on its live session
        detacher = threading.Thread(target=c.detach)  # the frozen daemon answers Detach once thawed
        detacher.start()
        th.join(30)
        assert not th.is_alive()
        assert len(outcomes) == 1 and isinstance(outcomes[0], flexkvd.FailedPrecondition), outcomes
        # "detached while this call ran" inside libflexkv's wait, or "not attached ... has ended" between slices
        assert "detached" in outcomes[0].message or "has ended" in outcomes[0].message
    finally:
        daemon.thaw()
    detacher.join(30)
    assert not c.attached
    with pytest.raises(flexkvd.FailedPrecondition):
        ticket.wait(0)
    c.close()


def test_close_racing_create_host_kv_keeps_the_new_buffer_mapped(daemon, observer, monkeypatch):
    """close() on another thread while create_host_kv's call into libflexkv runs: close() waits for create_host_kv
    to hand out its view, sees it, and keeps the mapping until the view goes, instead of unmapping it between the
    call and the view. Forced: close() starts during the call."""
    c = flexkvd.connect(daemon.socket)
    c.attach("racer", TEST_NAMESPACE, TEST_GEOMETRY)
    closer = threading.Thread(target=c.close)
    real = _lib.lib.flexkv_create_host_kv

    def then_close(*args):
        rc = real(*args)
        closer.start()  # blocks in close() until create_host_kv has made its view
        time.sleep(0.05)  # lets it get there; the order is right without this too, only less likely exercised
        return rc

    monkeypatch.setattr(_lib.lib, "flexkv_create_host_kv", then_close)
    buf = c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    closer.join(10)
    assert closer.ident is not None and not closer.is_alive()
    with pytest.raises(flexkvd.FailedPrecondition, match="closed"):
        c.status()
    assert observer.status().sessions == 1  # kept for `buf`
    buf[:] = b"\x03" * len(buf)  # still mapped
    assert sum(buf[:64]) == 3 * 64
    del buf
    gc.collect()
    assert observer.status().sessions == 0
