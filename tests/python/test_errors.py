"""flexkvd.Error and its subclasses (python/flexkvd/errors.py)."""
from __future__ import annotations

import os
import pickle
import re

import pytest

import flexkvd
from conftest import REPO
from flexkvd.errors import error_for


def test_status_codes_are_grpc_numbers():
    assert flexkvd.StatusCode.OK == 0
    assert flexkvd.StatusCode.INVALID_ARGUMENT == 3
    assert flexkvd.StatusCode.DEADLINE_EXCEEDED == 4
    assert flexkvd.StatusCode.FAILED_PRECONDITION == 9
    assert flexkvd.StatusCode.UNAVAILABLE == 14
    assert flexkvd.StatusCode.UNAUTHENTICATED == 16
    assert len(flexkvd.StatusCode) == 17


@pytest.mark.parametrize("code", [c for c in flexkvd.StatusCode if c != flexkvd.StatusCode.OK])
def test_one_subclass_per_code_carries_code_and_message(code):
    e = error_for(int(code), "geometry.num_layers is 0; expected 1..1024")
    assert isinstance(e, flexkvd.Error)
    assert type(e) is not flexkvd.Error
    assert e.code == code
    assert e.message == "geometry.num_layers is 0; expected 1..1024"
    assert str(e) == f"{code.name}: geometry.num_layers is 0; expected 1..1024"
    assert e.result is None
    copy = pickle.loads(pickle.dumps(e))
    assert type(copy) is type(e) and copy.code == e.code and copy.message == e.message


def test_subclasses_are_also_the_builtin_a_caller_would_catch():
    assert issubclass(flexkvd.DeadlineExceeded, TimeoutError)
    assert issubclass(flexkvd.InvalidArgument, ValueError)
    assert issubclass(flexkvd.Unavailable, ConnectionError)
    assert issubclass(flexkvd.PermissionDenied, PermissionError)
    assert issubclass(flexkvd.NotFound, LookupError)
    assert issubclass(flexkvd.OutOfRange, IndexError)
    assert issubclass(flexkvd.Unimplemented, NotImplementedError)
    e = flexkvd.DeadlineExceeded("slow")
    assert e.code == flexkvd.StatusCode.DEADLINE_EXCEEDED and str(e) == "DEADLINE_EXCEEDED: slow"
    assert e.errno is None  # an OSError subclass that does not pretend to carry an errno


def test_an_unknown_code_is_still_an_error():
    e = error_for(99, "from the future")
    assert isinstance(e, flexkvd.Error) and e.code == flexkvd.StatusCode.UNKNOWN and e.message == "from the future"


def test_every_code_the_c_abi_names_has_its_exception():
    """client/include/flexkv/c.h names the codes libflexkv returns (FLEXKV_<NAME> = <n>); each is a StatusCode of
    the same name and number with its own Error subclass, so a code the C ABI starts returning is never Unknown."""
    with open(os.path.join(REPO, "client", "include", "flexkv", "c.h")) as f:
        header = f.read()
    enum = header[header.index("FLEXKV_OK"):]
    enum = enum[:enum.index("}")]
    named = {name: int(value) for name, value in re.findall(r"FLEXKV_([A-Z_]+)\s*=\s*(\d+)", enum)}
    assert {"OK", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "UNAVAILABLE"} <= named.keys()
    for name, value in named.items():
        assert flexkvd.StatusCode[name] == value, name
        if value:
            e = error_for(value, "m")
            assert e.code == value and type(e).__name__ == name.title().replace("_", ""), name
    # and every gRPC code, whether or not c.h names it yet (ALREADY_EXISTS, RESOURCE_EXHAUSTED, DATA_LOSS, ...)
    for value, name in enumerate(["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                  "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                  "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                  "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"]):
        assert flexkvd.StatusCode(value).name == name
        if value:
            assert type(error_for(value, "m")).__name__ == name.title().replace("_", "")
