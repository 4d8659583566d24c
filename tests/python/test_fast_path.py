"""The compiled fast path (python/flexkvd/_fast.c, found by _native.py) against the ctypes path: where it is found,
how it is turned off, and the same results and the same errors from both for every input the package takes.

Both paths run in this process: `ctypes_path()` sets flexkvd._native.ext aside for the duration, as
FLEXKV_NO_EXTENSION=1 does for a whole process (also tested). Tests of the extension path skip where it is not
built, unless FLEXKV_REQUIRE_EXTENSION=1 (set by tests/python/CMakeLists.txt when the build has the target): then
a missing extension fails.
"""
from __future__ import annotations

import array
import contextlib
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading

import pytest

import flexkvd
from flexkvd import _convert, _lib, _native
from engine_process import TEST_GEOMETRY, TEST_NAMESPACE, tokens

numpy = pytest.importorskip("numpy")

TPB = TEST_GEOMETRY.tokens_per_block
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def extension():
    """The loaded extension module (the test skips, or fails where it is required, without one)."""
    if _native.ext is None:
        if os.environ.get("FLEXKV_REQUIRE_EXTENSION") == "1":
            pytest.fail(f"the build has the extension but the package did not load it: {_native.reason}")
        pytest.skip(f"no compiled fast path here ({_native.reason})")
    return _native.ext


@contextlib.contextmanager
def ctypes_path():
    saved = _native.ext
    _native.ext = None
    try:
        yield
    finally:
        _native.ext = saved


def both(fn):
    """fn() on the extension path, then on the ctypes path: (outcome, outcome), each a value or ("raised", type,
    str) for an exception."""
    def outcome():
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (the exception is the result compared)
            return ("raised", type(e), str(e))
    fast = outcome()
    with ctypes_path():
        slow = outcome()
    return fast, slow


def run_python(code: str, env: dict, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=60)


# ---- where it is found ----

def test_the_build_tree_extension_is_the_one_beside_libflexkv(extension):
    assert flexkvd.fast_path == os.path.join(os.path.dirname(os.environ["FLEXKV_LIBRARY"]), "_fast" + SUFFIX)
    assert extension.ABI_VERSION == _lib.ABI_VERSION
    assert _native.reason == ""


def test_flexkv_no_extension_gives_the_ctypes_path_with_the_same_keys(extension):
    code = ("import flexkvd, flexkvd._native as n; print(repr(flexkvd.fast_path)); print(n.reason); "
            "print(flexkvd.block_keys('ns', list(range(64)), 16).hex())")
    done = run_python(code, dict(os.environ, FLEXKV_NO_EXTENSION="1"))
    assert done.returncode == 0, done.stderr
    path, reason, keys = done.stdout.splitlines()
    assert path == "''" and "FLEXKV_NO_EXTENSION" in reason
    assert keys == str(flexkvd.block_keys("ns", list(range(64)), 16).hex())


def test_an_install_beside_the_package_is_found_without_any_variable(extension, tmp_path):
    """The installed layout: site/flexkv/ (the .py files and _fast*.so) and libflexkv.so.0 beside flexkv/."""
    shutil.copytree(os.path.join(REPO, "python", "flexkvd"), tmp_path / "flexkvd")
    shutil.copy(flexkvd.fast_path, tmp_path / "flexkvd")
    os.symlink(os.path.realpath(os.environ["FLEXKV_LIBRARY"]), tmp_path / "libflexkv.so.0")
    env = {k: v for k, v in os.environ.items() if k not in ("FLEXKV_LIBRARY", "FLEXKV_EXTENSION")}
    env["PYTHONPATH"] = str(tmp_path)
    done = run_python("import flexkvd; print(flexkvd.fast_path); print(flexkvd.block_keys('ns', range(32), 16).hex())",
                      env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    path, keys = done.stdout.splitlines()
    assert path == str(tmp_path / "flexkvd" / ("_fast" + SUFFIX))
    assert keys == str(flexkvd.block_keys("ns", range(32), 16).hex())


def test_without_any_extension_file_the_package_imports_on_ctypes(tmp_path):
    """No compiler, no extension: the package as copied, libflexkv beside it, and nothing else."""
    shutil.copytree(os.path.join(REPO, "python", "flexkvd"), tmp_path / "flexkvd",
                    ignore=shutil.ignore_patterns("_fast*.so"))
    os.symlink(os.path.realpath(os.environ["FLEXKV_LIBRARY"]), tmp_path / "libflexkv.so.0")
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLEXKV_LIBRARY", "FLEXKV_EXTENSION", "FLEXKV_NO_EXTENSION")}
    env["PYTHONPATH"] = str(tmp_path)
    code = ("import flexkvd, flexkvd._native as n; print(repr(flexkvd.fast_path)); print(n.reason); "
            "print(flexkvd.block_keys('ns', list(range(32)), 16).hex())")
    done = run_python(code, env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    path, reason, keys = done.stdout.splitlines()
    assert path == "''" and reason.startswith("no usable extension") and "no such file" in reason
    with ctypes_path():
        assert keys == str(flexkvd.block_keys("ns", list(range(32)), 16).hex())


def test_a_named_extension_that_cannot_be_used_fails_the_import_saying_why(tmp_path):
    base = {k: v for k, v in os.environ.items() if k != "FLEXKV_NO_EXTENSION"}
    done = run_python("import flexkvd", dict(base, FLEXKV_EXTENSION=str(tmp_path / "missing.so")))
    assert done.returncode != 0 and "FLEXKV_EXTENSION" in done.stderr and "no such file" in done.stderr
    (tmp_path / "bad.so").write_bytes(b"not an ELF file")
    done = run_python("import flexkvd", dict(base, FLEXKV_EXTENSION=str(tmp_path / "bad.so")))
    assert done.returncode != 0 and "cannot use FLEXKV_EXTENSION" in done.stderr


def test_an_extension_of_another_abi_version_is_not_used(extension, monkeypatch):
    monkeypatch.setattr(_lib, "ABI_VERSION", _lib.ABI_VERSION + 1)
    module, path, reason = _native._find()
    assert module is None and path == "" and "C ABI version" in reason


# ---- block keys and integer arrays: same results, same errors ----

def token_inputs():
    base = tokens(3, 5) + [7, 8, 9]  # 5 whole blocks and a partial one
    arr = numpy.array(base, dtype=numpy.int32)
    return {
        "list": base, "tuple": tuple(base), "range": range(0, 1000, 7), "generator": (t for t in base),
        "empty list": [], "shorter than a block": base[:TPB - 1], "bools and ints": [True, False] * TPB,
        "list of numpy ints": [numpy.int64(t) for t in base], "int32 array": arr,
        "int64 array": arr.astype(numpy.int64),
        "uint16 array": (arr % 60000).astype(numpy.uint16), "int8 array": (arr % 100).astype(numpy.int8),
        "big-endian int32": arr.astype(">i4"), "strided view": numpy.repeat(arr, 2)[::2],
        "array.array i": array.array("i", base), "array.array q": array.array("q", base),
        "array.array H": array.array("H", [t % 60000 for t in base]), "memoryview": memoryview(array.array("i", base)),
        "ctypes int32 array": (ctypes.c_int32 * len(base))(*base), "int32 extremes": [-2**31, 2**31 - 1] * TPB,
    }


@pytest.mark.parametrize("kind", list(token_inputs()))
def test_block_keys_are_the_same_from_both_paths(extension, kind):
    fast, slow = both(lambda: flexkvd.block_keys(TEST_NAMESPACE, token_inputs()[kind], TPB))
    assert isinstance(fast, flexkvd.BlockKeys) and isinstance(slow, flexkvd.BlockKeys)
    assert bytes(fast._array) == bytes(slow._array) and len(fast) == len(slow)
    assert fast == slow and fast.parent is None and slow.parent is None
    if len(fast) > 2:  # a slice of the fast path's keys knows its parent as the ctypes path's does
        assert fast[1:].parent == slow[0] and fast[1:] == slow[1:]


@pytest.mark.parametrize("kind", ["list", "tuple", "int32 array", "int64 array", "uint16 array", "array.array q",
                                  "memoryview", "ctypes int32 array", "empty list"])
def test_the_extension_reads_lists_tuples_and_native_buffers_itself(extension, kind):
    """Not a silent fallback: these inputs are read in C (None would send them to the ctypes path)."""
    raw = extension.block_keys(TEST_NAMESPACE.encode(), token_inputs()[kind], TPB)
    assert isinstance(raw, bytearray) and len(raw) == len(token_inputs()[kind]) // TPB * 16
    assert isinstance(extension.ints(token_inputs()[kind], True), bytearray)


@pytest.mark.parametrize("kind", ["range", "generator", "list of numpy ints", "big-endian int32", "strided view"])
def test_what_the_extension_does_not_read_goes_to_the_ctypes_path_untouched(extension, kind):
    values = token_inputs()[kind]
    assert extension.block_keys(TEST_NAMESPACE.encode(), values, TPB) is None
    if kind == "generator":
        assert len(list(values)) == len(tokens(3, 5)) + 3  # not consumed


BAD_TOKENS = {
    "int32 max + 1 in a list": [1, 2, 2**31], "int32 min - 1 in a list": [-2**31 - 1],
    "huge int in a list": [2**80], "float in a list": [1, 2.0], "str in a list": ["1"], "None in a list": [None],
    "nested list": [[1, 2], [3, 4]], "int64 array out of range": numpy.array([0, 2**40]),
    "uint32 array out of range": numpy.array([2**31], dtype=numpy.uint32), "float array": numpy.zeros(4),
    "2-D array": numpy.zeros((2, 16), dtype=numpy.int32), "bool array": numpy.ones(4, dtype=bool),
    "str": "abc", "bytes": b"\x01\x02", "an int": 5,
}


@pytest.mark.parametrize("kind", list(BAD_TOKENS))
def test_block_keys_refuse_the_same_tokens_with_the_same_error(extension, kind):
    fast, slow = both(lambda: flexkvd.block_keys(TEST_NAMESPACE, BAD_TOKENS[kind], TPB))
    assert fast == slow
    if kind != "bytes":  # bytes are a buffer of uint8: valid tokens
        assert fast[0] == "raised", fast


@pytest.mark.parametrize("per_block", [0, -1, 2**32, 1.5])
def test_a_bad_tokens_per_block_is_refused_alike(extension, per_block):
    fast, slow = both(lambda: flexkvd.block_keys(TEST_NAMESPACE, [1] * 32, per_block))
    assert fast == slow and fast[0] == "raised"


@pytest.mark.parametrize("ctype", [ctypes.c_int32, ctypes.c_uint32])
@pytest.mark.parametrize("values", [[0, 1, 2**31 - 1], [-1, 5], [2**32 - 1], [2**32], (3, 4), range(5), [],
                                    numpy.arange(5, dtype=numpy.int64), numpy.array([-3], dtype=numpy.int16),
                                    [1.0], numpy.zeros((2, 2), dtype=numpy.int32)], ids=repr)
def test_int_arrays_are_the_same_from_both_paths(extension, ctype, values):
    def convert():
        arr, n = _convert.c_int_array(values, ctype, "block_ids")
        return type(arr)._type_, n, bytes(arr)
    fast, slow = both(convert)
    assert fast == slow


# ---- the data plane: same results, same errors ----

@pytest.fixture
def stored(client):
    buf = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 16)
    keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(4, 4), TPB)
    client.store(keys, list(range(4))).wait(5)
    yield client, keys
    del buf


def test_match_results_are_the_same_from_both_paths(extension, stored):
    client, keys = stored
    fast, slow = both(lambda: client.match(keys).wait(5))
    assert fast == slow and fast.matched_blocks == 4 and fast.ok
    assert type(fast) is flexkvd.OpResult and type(fast.status_code) is flexkvd.StatusCode
    assert dataclasses.asdict(fast) == dataclasses.asdict(slow) and repr(fast) == repr(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.matched_blocks = 1  # type: ignore[misc]
    assert hash(fast) == hash(slow)
    miss = flexkvd.block_keys(TEST_NAMESPACE, tokens(5, 2), TPB)
    assert both(lambda: client.match(miss).wait(5)) == (flexkvd.OpResult(flexkvd.StatusCode.OK, 0, 0, 0),) * 2
    assert both(lambda: client.prefetch(keys).wait(5))[0] == both(lambda: client.prefetch(keys).wait(5))[1]


def test_pinned_match_load_and_release_work_across_the_paths(extension, stored):
    """A handle from one path is used on the other: tickets and handles are the library's, not the path's."""
    client, keys = stored
    hit = client.match(keys, pin=True).wait(5)
    assert hit.matched_blocks == 4 and hit.match_handle != 0
    assert client.status().pinned_blocks == 4
    with ctypes_path():
        assert client.load(hit.match_handle, [8, 9, 10, 11]).wait(5).done_blocks == 4
        ticket = client.match(keys, pin=True)
    assert client.release(hit.match_handle).wait(5).ok
    second = ticket.wait(5)  # a ctypes-path ticket waited on through the extension
    with ctypes_path():
        assert client.release(second.match_handle).wait(5).ok
    assert client.status().pinned_blocks == 0


def test_request_errors_are_the_same_from_both_paths(extension, stored):
    client, keys = stored
    zero = flexkvd.BlockKeys([(0, 0)])
    fast, slow = both(lambda: client.prefetch(zero).wait(5))
    assert fast == slow and fast[0] == "raised"
    fast, slow = both(lambda: client.load(123456789, [0]).wait(5))  # a handle never issued
    assert fast[0] == "raised" and fast[1] is slow[1] and fast[2].split("ticket")[0] == slow[2].split("ticket")[0]
    fast, slow = both(lambda: client.release(2**64).wait(5))
    assert fast == slow and fast[1] is flexkvd.InvalidArgument


def test_errors_after_detach_and_close_are_the_same_from_both_paths(extension, daemon):
    with flexkvd.connect(daemon.socket) as client:
        client.attach("pytest", TEST_NAMESPACE, TEST_GEOMETRY)
        keys = flexkvd.block_keys(TEST_NAMESPACE, tokens(6, 2), TPB)
        tickets = [client.match(keys)]
        with ctypes_path():
            tickets.append(client.match(keys))
        client.detach()
        waited = []
        for t in tickets:
            waited.append(both(lambda: t.wait(5)))
        # each ticket's first wait (extension) and second (ctypes) raise the same: its session has ended
        for fast, slow in waited:
            assert fast[:2] == slow[:2] == ("raised", flexkvd.FailedPrecondition)
        assert both(lambda: client.match(keys)) == both(lambda: client.match(keys))
        fast, slow = both(lambda: client.match(keys))
        assert fast == slow and fast[1] is flexkvd.FailedPrecondition
        client.close()
        fast, slow = both(lambda: client.match(keys))
        closed = ("raised", flexkvd.FailedPrecondition, "FAILED_PRECONDITION: this flexkvd.Client is closed")
        assert fast == slow == closed


def test_a_wait_on_a_frozen_daemon_times_out_alike_and_ctrl_c_reaches_it(extension, stored, daemon):
    """The extension's wait releases the GIL and returns to Python every slice: a timeout is honoured and a signal
    handler (Ctrl-C's KeyboardInterrupt) runs during a wait without a timeout."""
    client, keys = stored
    daemon.freeze()
    thaw = threading.Timer(30, daemon.thaw)  # a wait that never returned to Python would end here, failing below
    thaw.start()
    try:
        ticket = client.match(keys)
        fast, slow = both(lambda: ticket.wait(0.2))
        assert fast == slow and fast[1] is flexkvd.DeadlineExceeded

        def interrupt(signum, frame):
            raise KeyboardInterrupt
        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(KeyboardInterrupt):
                ticket.wait()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    finally:
        thaw.cancel()
        daemon.thaw()
    assert ticket.wait(5).matched_blocks == 4  # still valid after the timeout and the interrupt
