"""Client errors (python/flexkvd/client.py): each failure is the flexkvd.Error subclass of its code, with the
daemon's message."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest

import flexkvd
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE, tokens

TPB = TEST_GEOMETRY.tokens_per_block


def test_daemon_down_is_unavailable_naming_the_socket(tmp_path):
    path = str(tmp_path / "nobody-listens.sock")
    t0 = time.monotonic()
    with pytest.raises(flexkvd.Unavailable) as e:
        flexkvd.connect(path, timeout=0.3)
    assert time.monotonic() - t0 >= 0.25  # waited for a daemon that might be starting
    assert path in e.value.message
    assert e.value.code == flexkvd.StatusCode.UNAVAILABLE
    assert isinstance(e.value, ConnectionError)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("tokens_per_block", 3), ("head_dim", 70000),
                                         ("dtype_bytes", 3), ("kv_planes", 5), ("tp_size", 0)])
def test_bad_geometry_is_invalid_argument_naming_the_field(daemon, field, value):
    bad = dataclasses.replace(TEST_GEOMETRY, **{field: value})
    with flexkvd.connect(daemon.socket) as c:
        with pytest.raises(flexkvd.InvalidArgument) as e:
            c.attach("bad", TEST_NAMESPACE, bad)
        assert f"geometry.{field} is {value}" in e.value.message
        assert not c.attached
        c.attach("good", TEST_NAMESPACE, TEST_GEOMETRY)  # the client is still usable
        assert c.attached


def test_geometry_out_of_c_range_is_refused_before_the_call(daemon):
    with flexkvd.connect(daemon.socket) as c:
        with pytest.raises(flexkvd.InvalidArgument, match="geometry.num_layers is -1"):
            c.attach("bad", TEST_NAMESPACE, dataclasses.replace(TEST_GEOMETRY, num_layers=-1))


def test_other_geometry_than_the_cache_domain_is_failed_precondition(client, daemon):
    with flexkvd.connect(daemon.socket) as c:
        with pytest.raises(flexkvd.FailedPrecondition, match="geometry.num_layers is 4 but"):
            c.attach("other", TEST_NAMESPACE, dataclasses.replace(TEST_GEOMETRY, num_layers=4))


def test_attach_twice_is_failed_precondition(client):
    with pytest.raises(flexkvd.FailedPrecondition):
        client.attach("again", TEST_NAMESPACE, TEST_GEOMETRY)


def test_drained_daemon_refuses_new_sessions_loads_and_stores_with_unavailable(client, daemon):
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(1, 4), TPB)
    client.store(keys, range(4)).wait(5)
    hit = client.match(keys, pin=True).wait(5)
    assert client.drain() in ("draining", "drained")
    assert client.status().state == "drained"
    assert client.health() is False
    with flexkvd.connect(daemon.socket) as other:
        with pytest.raises(flexkvd.Unavailable, match="draining"):
            other.attach("late", TEST_NAMESPACE, TEST_GEOMETRY)
    with pytest.raises(flexkvd.Unavailable, match="draining") as e:
        client.store(flexkvd.block_keys(TEST_NAMESPACE, tokens(2, 4), TPB), range(4, 8)).wait(5)
    assert e.value.result is not None and e.value.result.done_blocks == 0
    with pytest.raises(flexkvd.Unavailable, match="draining"):
        client.load(hit.match_handle, range(8, 12)).wait(5)
    assert client.match(keys).wait(5).matched_blocks == 4  # lookups still answer while drained
    assert client.resume() == "serving"
    assert client.health() is True
    assert client.load(hit.match_handle, range(8, 12)).wait(5).done_blocks == 4
    client.release(hit.match_handle).wait(5)
    del buf


def test_bad_layout_is_invalid_argument(client):
    with pytest.raises(flexkvd.InvalidArgument, match="layout 7 is not valid"):
        client.create_host_kv(7, 16)
    assert client.create_host_kv(flexkvd.Layout.LAYER_BLOCK, 16).nbytes == 16 * TEST_GEOMETRY.host_block_bytes


def test_create_host_kv_before_attach_and_twice(daemon, client):
    with flexkvd.connect(daemon.socket) as c:
        with pytest.raises(flexkvd.FailedPrecondition):
            c.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 4)
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 4)
    with pytest.raises(flexkvd.Error):
        client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 4)
    del buf


def test_wrong_block_ids(client):
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(5, 4), TPB)
    # A block id past the registered blocks: the daemon ends the request with OUT_OF_RANGE naming it.
    with pytest.raises(flexkvd.OutOfRange) as e:
        client.store(keys, [0, 1, 2, 16]).wait(5)
    assert "16" in e.value.message and e.value.result.done_blocks == 0
    # Not representable as u32, or a count that does not match the keys: refused before submitting.
    with pytest.raises(flexkvd.InvalidArgument, match="block_ids holds -1"):
        client.store(keys, [0, 1, 2, -1])
    with pytest.raises(flexkvd.InvalidArgument, match="4 keys and 3 source block ids"):
        client.store(keys, [0, 1, 2])
    client.store(keys, [0, 1, 2, 3]).wait(5)
    hit = client.match(keys, pin=True).wait(5)
    with pytest.raises(flexkvd.Error) as e:  # more blocks than the handle pins
        client.load(hit.match_handle, range(5)).wait(5)
    assert e.value.code in (flexkvd.StatusCode.INVALID_ARGUMENT, flexkvd.StatusCode.OUT_OF_RANGE)
    with pytest.raises(flexkvd.NotFound):  # a handle this session does not hold
        client.load(hit.match_handle + 12345, range(4)).wait(5)
    client.release(hit.match_handle).wait(5)
    del buf


def test_calls_after_close_are_failed_precondition(daemon):
    c = flexkvd.connect(daemon.socket)
    c.attach("short", TEST_NAMESPACE, TEST_GEOMETRY)
    c.close()
    c.close()  # idempotent
    with pytest.raises(flexkvd.FailedPrecondition, match="closed"):
        c.status()
    with pytest.raises(flexkvd.FailedPrecondition, match="closed"):
        c.match(flexkvd.block_keys(TEST_NAMESPACE, tokens(1, 1), TPB))


def test_data_plane_before_attach_is_an_error(daemon):
    with flexkvd.connect(daemon.socket) as c:
        with pytest.raises(flexkvd.FailedPrecondition):
            c.match(flexkvd.block_keys(TEST_NAMESPACE, tokens(1, 1), TPB))


def test_another_uid_is_permission_denied_naming_the_socket(daemon):
    """Another uid cannot open the daemon's socket (mode 0600 without --socket-group): PermissionDenied at once."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    import subprocess
    import sys
    code = ("import os, time, flexkvd; os.setgid(65534); os.setuid(65534)\n"
            "t0 = time.monotonic()\n"
            "try:\n"
            f"    flexkvd.connect({daemon.socket!r}, timeout=5)\n"
            "except flexkvd.PermissionDenied as e:\n"
            "    print('DENIED', round(time.monotonic() - t0), e.message)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"DENIED 0 connecting to {daemon.socket}: Permission denied"), out.stdout


def test_a_ticket_of_an_ended_session_is_failed_precondition(daemon):
    with flexkvd.connect(daemon.socket) as c:
        c.attach("first", TEST_NAMESPACE, TEST_GEOMETRY)
        keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(1, 1), TPB)
        done = c.match(keys)
        done.wait(5)
        never_waited = c.match(keys)
        c.detach()
        c.attach("second", TEST_NAMESPACE, TEST_GEOMETRY)
        assert done.wait(0).matched_blocks == 0  # an ended ticket keeps its result
        with pytest.raises(flexkvd.FailedPrecondition, match="which has ended"):
            never_waited.wait(1)
        assert c.match(keys).wait(5).matched_blocks == 0  # the new session works


def test_integers_a_c_type_cannot_hold_are_refused_not_wrapped(client, daemon):
    """ctypes wraps silently (-1 as a uint32 is 4294967295, 2**32 is 0, 3e9 as a C int is negative): each integer
    that goes into a fixed-width C type is checked first, and the error names it and its range."""
    with flexkvd.connect(daemon.socket) as c:
        for kwargs, message in [({"dp_rank": -1}, "dp_rank is -1; expected an integer in 0..4294967295"),
                                ({"tp_rank": 2**32}, "tp_rank is 4294967296; expected an integer in 0..4294967295")]:
            with pytest.raises(flexkvd.InvalidArgument) as e:
                c.attach("ranks", TEST_NAMESPACE, TEST_GEOMETRY, **kwargs)
            assert e.value.message == message
            assert not c.attached
        with pytest.raises(flexkvd.InvalidArgument, match="geometry.head_dim is 4294967296"):
            c.attach("g", TEST_NAMESPACE, dataclasses.replace(TEST_GEOMETRY, head_dim=2**32))
        with pytest.raises(TypeError, match="geometry.num_layers is a float"):
            c.attach("g", TEST_NAMESPACE, dataclasses.replace(TEST_GEOMETRY, num_layers=2.0))
        with pytest.raises(flexkvd.InvalidArgument, match="NUL"):
            c.attach("g", "pytest\0model", TEST_GEOMETRY)  # C would cut the namespace at the NUL
        assert not c.attached
    with pytest.raises(flexkvd.InvalidArgument, match="layout 4294967297 is not valid"):
        client.create_host_kv(2**32 + 1, 16)  # a C int would wrap it to LAYER_FIRST
    with pytest.raises(flexkvd.InvalidArgument, match="num_blocks is -1"):
        client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, -1)
    with pytest.raises(flexkvd.InvalidArgument, match="num_blocks is 4294967296"):
        client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 2**32)
    for handle in (-1, 2**64):
        with pytest.raises(flexkvd.InvalidArgument, match=f"match_handle is {handle}"):
            client.load(handle, [0])
        with pytest.raises(flexkvd.InvalidArgument, match=f"match_handle is {handle}"):
            client.release(handle)
    with pytest.raises(flexkvd.InvalidArgument, match="block key 1: lo is -1"):
        client.match([(1, 2), (-1, 0)])
    with pytest.raises(flexkvd.InvalidArgument, match="block key 0: hi is 18446744073709551616"):
        client.store([(0, 2**64)], [0])


@pytest.mark.parametrize("kwargs,message", [
    ({"num_blocks": -1}, "num_blocks is -1"),
    ({"num_blocks": 2**32}, "num_blocks is 4294967296"),
    ({"tp_rank": -1}, "tp_rank is -1"),
    ({"region_bytes": -1}, "region_bytes is -1"),
    ({"region_bytes": 2**64}, "region_bytes is 18446744073709551616"),
    ({"regions": [-1]}, "KV region 0 is the pointer -1"),
    ({"regions": [2**64]}, "KV region 0 is the pointer 18446744073709551616"),
    ({"layout": 2**32 + 2}, "layout 4294967298 is not valid"),
])
def test_register_gpu_kv_refuses_integers_out_of_their_c_range(client, kwargs, message):
    args = {"regions": [0x10000], "layout": flexkvd.Layout.BLOCK_FIRST, "num_blocks": 16, "tp_rank": 0,
            "region_bytes": 65536, **kwargs}
    with pytest.raises(flexkvd.InvalidArgument, match=message):
        client.register_gpu_kv(args.pop("regions"), args.pop("layout"), args.pop("num_blocks"), args.pop("tp_rank"),
                               **args)


@pytest.mark.parametrize("timeout", [-1, 3e6, float("nan"), float("inf")])
def test_connect_timeout_out_of_range(daemon, timeout):
    with pytest.raises(flexkvd.InvalidArgument, match="timeout is"):
        flexkvd.connect(daemon.socket, timeout=timeout)  # 3e6 s in ms would wrap a C int to a negative number
    with pytest.raises(flexkvd.InvalidArgument, match="NUL"):
        flexkvd.connect(daemon.socket + "\0x")
    flexkvd.connect(daemon.socket, timeout=0).close()
