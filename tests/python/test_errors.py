"""flexkv.Error and its subclasses (python/flexkv/errors.py)."""
from __future__ import annotations

import os
import pickle
import re

import pytest

import flexkv
from conftest import REPO
from flexkv.errors import error_for


def test_status_codes_are_grpc_numbers():
    assert flexkv.StatusCode.OK == 0
    assert flexkv.StatusCode.INVALID_ARGUMENT == 3
    assert flexkv.StatusCode.DEADLINE_EXCEEDED == 4
    assert flexkv.StatusCode.FAILED_PRECONDITION == 9
    assert flexkv.StatusCode.UNAVAILABLE == 14
    assert flexkv.StatusCode.UNAUTHENTICATED == 16
    assert len(flexkv.StatusCode) == 17


@pytest.mark.parametrize("code", [c for c in flexkv.StatusCode if c != flexkv.StatusCode.OK])
def test_one_subclass_per_code_carries_code_and_message(code):
    e = error_for(int(code), "geometry.num_layers is 0; expected 1..1024")
    assert isinstance(e, flexkv.Error)
    assert type(e) is not flexkv.Error
    assert e.code == code
    assert e.message == "geometry.num_layers is 0; expected 1..1024"
    assert str(e) == f"{code.name}: geometry.num_layers is 0; expected 1..1024"
    assert e.result is None
    copy = pickle.loads(pickle.dumps(e))
    assert type(copy) is type(e) and copy.code == e.code and copy.message == e.message


def test_subclasses_are_also_the_builtin_a_caller_would_catch():
    assert issubclass(flexkv.DeadlineExceeded, TimeoutError)
    assert issubclass(flexkv.InvalidArgument, ValueError)
    assert issubclass(flexkv.Unavailable, ConnectionError)
    assert issubclass(flexkv.PermissionDenied, PermissionError)
    assert issubclass(flexkv.NotFound, LookupError)
    assert issubclass(flexkv.OutOfRange, IndexError)
    assert issubclass(flexkv.Unimplemented, NotImplementedError)
    e = flexkv.DeadlineExceeded("slow")
    assert e.code == flexkv.StatusCode.DEADLINE_EXCEEDED and str(e) == "DEADLINE_EXCEEDED: slow"
    assert e.errno is None  # an OSError subclass that does not pretend to carry an errno


def test_an_unknown_code_is_still_an_error():
    e = error_for(99, "from the future")
    assert isinstance(e, flexkv.Error) and e.code == flexkv.StatusCode.UNKNOWN and e.message == "from the future"


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
        assert flexkv.StatusCode[name] == value, name
        if value:
            e = error_for(value, "m")
            assert e.code == value and type(e).__name__ == name.title().replace("_", ""), name
    # and every gRPC code, whether or not c.h names it yet (ALREADY_EXISTS, RESOURCE_EXHAUSTED, DATA_LOSS, ...)
    for value, name in enumerate(["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                  "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                  "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                  "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"]):
        assert flexkv.StatusCode(value).name == name
        if value:
            assert type(error_for(value, "m")).__name__ == name.title().replace("_", "")
