"""Ticket waits (python/flexkvd/client.py): deadlines, try_wait, and the GIL released while blocked.

A request that cannot end in time is made by stopping the daemon (Daemon.freeze: SIGSTOP, and every thread seen
stopped): the submission lands in the ring, nobody reads it until SIGCONT.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import flexkvd
from flexkvd import _lib, _native
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE, tokens

TPB = TEST_GEOMETRY.tokens_per_block
# The ctypes-path run of this module (FLEXKV_NO_EXTENSION set: tests/python/CMakeLists.txt) has no extension by
# design, so only the ctypes half runs there; the other run of the module covers the extension.
CALL_PATHS = ["ctypes"] if os.environ.get("FLEXKV_NO_EXTENSION", "") not in ("", "0") else ["ctypes", "extension"]


class _ExtensionShim:
    """The compiled fast path (flexkvd._fast) with some of its functions replaced: the fault-injection seam of the
    extension path, as monkeypatching _lib.lib is the ctypes path's."""

    def __init__(self, real, **replaced):
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture(params=CALL_PATHS)
def call_path(request, monkeypatch):
    """Runs a test on the ctypes path (the extension, if loaded, set aside) and on the compiled fast path (skipped
    where it is not built, a failure where the build has it but it did not load). Yields a function that replaces one libflexkv call on that path: replace(c_name, fn),
    where fn gets the ctypes arguments on the ctypes path and the extension's (client, id, generation, ...) on the
    other, and returns the int code or (extension) the OpResult."""
    real_ext = _native.ext
    if request.param == "ctypes":
        monkeypatch.setattr(_native, "ext", None)

        def replace(c_name, fn):
            monkeypatch.setattr(_lib.lib, c_name, fn)
        yield replace, lambda c_name: getattr(_lib.lib, c_name)
        return
    if real_ext is None:
        if os.environ.get("FLEXKV_REQUIRE_EXTENSION") == "1":
            pytest.fail(f"the build has the extension but the package did not load it: {_native.reason}")
        pytest.skip(f"the compiled fast path is not in use here ({_native.reason})")
    names = {"flexkv_wait": "wait", "flexkv_try_wait": "try_wait"}

    def replace_ext(c_name, fn):
        if c_name not in names:  # a call the extension does not make (flexkv_wait_layers)
            monkeypatch.setattr(_lib.lib, c_name, fn)
            return
        shim = _native.ext if isinstance(_native.ext, _ExtensionShim) else _ExtensionShim(real_ext)
        setattr(shim, names[c_name], fn)
        monkeypatch.setattr(_native, "ext", shim)
    yield replace_ext, lambda c_name: getattr(real_ext, names[c_name]) if c_name in names else getattr(_lib.lib,
                                                                                                       c_name)


@pytest.fixture
def stored(client):
    """The client with 4 blocks of seed 1 stored from its host KV."""
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(1, 4), TPB)
    client.store(keys, range(4)).wait(5)
    yield client, keys
    del buf


def test_wait_timeout_raises_deadline_exceeded_and_the_ticket_still_works(stored, daemon):
    client, keys = stored
    daemon.freeze()
    try:
        ticket = client.match(keys)
        t0 = time.monotonic()
        with pytest.raises(flexkvd.DeadlineExceeded) as e:
            ticket.wait(0.3)
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 2.0
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, flexkvd.Error)
        assert "still in flight" in e.value.message
        with pytest.raises(TimeoutError):
            ticket.wait(0)
        assert ticket.try_wait() is None and not ticket.done()
    finally:
        daemon.thaw()
    assert ticket.wait(5).matched_blocks == 4
    assert ticket.try_wait().matched_blocks == 4


def test_wait_without_timeout_waits_until_the_end(stored, daemon):
    client, keys = stored
    daemon.freeze()
    ticket = client.match(keys)
    threading.Timer(0.4, daemon.thaw).start()
    t0 = time.monotonic()
    assert ticket.wait().matched_blocks == 4
    assert time.monotonic() - t0 >= 0.35


def test_waits_release_the_gil(stored, daemon):
    """A second Python thread keeps running while the main thread is blocked in Ticket.wait."""
    client, keys = stored
    progress = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            progress[0] += 1

    t = threading.Thread(target=spin)
    daemon.freeze()
    try:
        ticket = client.match(keys)
        t.start()
        time.sleep(0.05)
        before = progress[0]
        with pytest.raises(flexkvd.DeadlineExceeded):
            ticket.wait(1.0)
        during = progress[0] - before
    finally:
        stop.set()
        daemon.thaw()
        t.join()
    # Pure-Python increments run at millions per second; with the GIL held by the waiting thread the spinner
    # would be stuck for the whole second.
    assert during > 100_000, during
    assert ticket.wait(5).matched_blocks == 4


def test_a_ticket_waited_from_two_threads_gives_both_the_result(stored, daemon):
    client, keys = stored
    daemon.freeze()
    ticket = client.match(keys)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ticket.wait(10).matched_blocks)) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(0.2)
    daemon.thaw()
    for th in threads:
        th.join(15)
    assert results == [4, 4]


def test_wait_layers_timeout(stored, daemon):
    client, keys = stored
    hit = client.match(keys, pin=True).wait(5)
    daemon.freeze()
    try:
        t = client.load(hit.match_handle, range(8, 12), layerwise=True)
        with pytest.raises(flexkvd.DeadlineExceeded, match="layers"):
            t.wait_layers(1, 0.2)
    finally:
        daemon.thaw()
    assert t.wait_layers(TEST_GEOMETRY.num_layers, 5) == TEST_GEOMETRY.num_layers
    assert t.wait(5).done_blocks == 4
    client.release(hit.match_handle).wait(5)


def test_close_waits_for_a_thread_blocked_in_wait(stored, daemon):
    """close() from one thread while another waits: no crash; the waiter gets FailedPrecondition."""
    client, keys = stored
    daemon.freeze()
    errors = []
    ticket = client.match(keys)

    def waiter() -> None:
        try:
            ticket.wait()
        except flexkvd.Error as e:
            errors.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.2)
    try:
        client.close()
        th.join(5)
    finally:
        daemon.thaw()
    assert not th.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], flexkvd.FailedPrecondition)


def test_daemon_gone_is_unavailable(stored, daemon):
    client, keys = stored
    daemon.freeze()
    ticket = client.match(keys)
    daemon.signal(signal.SIGKILL)
    daemon.process.wait(10)
    with pytest.raises(flexkvd.Unavailable, match="Attach again"):
        ticket.wait(5)


@pytest.mark.parametrize("method", ["wait", "wait_layers", "try_wait"])
def test_a_waiter_whose_result_another_thread_took_returns_it_not_a_timeout(client, call_path, method):
    """Two threads wait on one ticket; libflexkv hands the end to one of them. The other, whose call into libflexkv
    then times out at its deadline, must find the outcome the first one kept, not raise DeadlineExceeded (or, from
    try_wait, answer None) for a request that has ended. The interleaving is forced: thread B's call runs thread A's
    whole wait() inside it and then reports DEADLINE_EXCEEDED, as a call that lost the result does. On both call
    paths (ctypes, the compiled extension)."""
    replace, original = call_path
    ticket = client.match(flexkvd.block_keys(TEST_NAMESPACE, tokens(11, 2), TPB))
    c_name = {"wait": "flexkv_wait", "wait_layers": "flexkv_wait_layers", "try_wait": "flexkv_try_wait"}[method]
    real = original(c_name)
    taken = []

    def lose_the_result(*args):
        if threading.current_thread().name == "A":
            return real(*args)
        a = threading.Thread(target=lambda: taken.append(ticket.wait(5)), name="A")
        a.start()
        a.join(10)
        return flexkvd.StatusCode.DEADLINE_EXCEEDED

    replace(c_name, lose_the_result)
    if method == "wait":
        got = ticket.wait(0).matched_blocks
    elif method == "wait_layers":
        got = ticket.wait_layers(1, 0)
    else:
        got = ticket.try_wait().matched_blocks
    assert taken and taken[0].matched_blocks == 0  # thread A had the result
    assert got == (1 if method == "wait_layers" else 0)


def test_try_wait_on_a_client_that_is_not_attached_raises(client, monkeypatch, call_path):
    """libflexkv answers flexkv_try_wait with FAILED_PRECONDITION when its client is not attached (any more): that is
    an error naming the request, never "not ended yet", and done() raises it too instead of answering False
    forever. On both call paths."""
    replace, _ = call_path
    ticket = client.match(flexkvd.block_keys(TEST_NAMESPACE, tokens(12, 1), TPB))
    replace("flexkv_try_wait", lambda *args: flexkvd.StatusCode.FAILED_PRECONDITION)
    monkeypatch.setattr(_lib.lib, "flexkv_last_error",
                        lambda: b"FAILED_PRECONDITION: not attached: call flexkv_attach first")
    with pytest.raises(flexkvd.FailedPrecondition) as e:
        ticket.try_wait()
    assert e.value.message == f"match request (ticket {ticket.id}): not attached: call flexkv_attach first"
    with pytest.raises(flexkvd.FailedPrecondition, match="not attached"):
        ticket.done()
    monkeypatch.undo()
    assert ticket.wait(5).matched_blocks == 0 and ticket.done()


def test_done_of_a_ticket_whose_session_ended_raises(client):
    ticket = client.match(flexkvd.block_keys(TEST_NAMESPACE, tokens(13, 1), TPB))
    client.detach()
    with pytest.raises(flexkvd.FailedPrecondition, match="which has ended"):
        ticket.done()
    with pytest.raises(flexkvd.FailedPrecondition, match="which has ended"):
        ticket.try_wait()


def test_wait_timeouts_out_of_range(stored, daemon):
    client, keys = stored
    daemon.freeze()
    try:
        ticket = client.match(keys)
        with pytest.raises(flexkvd.InvalidArgument, match="NaN"):
            ticket.wait(float("nan"))  # would never time out
        with pytest.raises(flexkvd.InvalidArgument, match="NaN"):
            ticket.wait_layers(1, float("nan"))
        with pytest.raises(TypeError):
            ticket.wait("1")
        t0 = time.monotonic()
        with pytest.raises(flexkvd.DeadlineExceeded):
            ticket.wait(-5)  # negative: just look
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(flexkvd.InvalidArgument, match="layers is -1"):
            ticket.wait_layers(-1, 0)
    finally:
        daemon.thaw()
    assert ticket.wait(float("inf")).matched_blocks == 4  # huge is a year: returns when the request ends
    assert ticket.wait(1e300).matched_blocks == 4


# ---- tickets name their session: after a re-attach an old ticket is FailedPrecondition, never a new result ----

def test_an_old_ticket_after_a_daemon_restart_and_reattach_is_failed_precondition(daemon):
    """The old session's first ticket and the new session's first ticket have the same id (1): the old one must
    answer FailedPrecondition (its session ended), never the new request's result."""
    c = flexkvd.connect(daemon.socket)
    c.attach("phoenix", TEST_NAMESPACE, TEST_GEOMETRY)
    daemon.freeze()
    old = c.match(flexkvd.block_keys(TEST_NAMESPACE, tokens(21, 2), TPB))  # never read by that daemon
    daemon.restart()
    with pytest.raises(flexkvd.Unavailable):
        old.try_wait()  # the daemon is gone: an error, not "not yet" forever
    c.attach("phoenix", TEST_NAMESPACE, TEST_GEOMETRY)
    buf = c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(22, 3), TPB)
    new = c.store(keys, range(3))
    assert new.id == old.id == 1 and new.generation > old.generation
    with pytest.raises(flexkvd.FailedPrecondition, match="which has ended"):
        old.wait(1)
    with pytest.raises(flexkvd.FailedPrecondition):
        old.try_wait()
    assert new.wait(5).done_blocks == 3
    del buf
    c.close()


def test_try_wait_tells_not_yet_from_ended_from_session_gone(stored, daemon):
    client, keys = stored
    daemon.freeze()
    try:
        ticket = client.match(keys)
        assert ticket.try_wait() is None  # not yet
    finally:
        daemon.thaw()
    assert ticket.wait(5).matched_blocks == 4
    assert ticket.try_wait().matched_blocks == 4  # kept: the same result again
    daemon.freeze()
    pending = client.match(keys)
    daemon.kill()
    with pytest.raises(flexkvd.Unavailable, match="Attach again"):
        pending.try_wait()  # daemon gone
    with pytest.raises(flexkvd.Unavailable):
        pending.done()
