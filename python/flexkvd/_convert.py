"""Turns Python integers, sequences, buffers and NumPy arrays of integers into C integers and arrays of int32 /
uint32 for libflexkv, refusing what the C type cannot hold (ctypes would wrap it silently: -1 as a uint32 is
4294967295, 2**32 is 0).

Never imports NumPy: a NumPy array is read through the buffer protocol, and NumPy's own functions are used only
when the caller passed an array (so NumPy is already imported). A C-contiguous buffer of the exact C type is
copied with one memcpy; anything else is converted element by element with a range check.

device_region reads a GPU KV region (a tensor-like object or an int pointer) as (device pointer, bytes).
"""
from __future__ import annotations

import array
import ctypes
import math
import numbers
import operator
import sys
from typing import Any, Optional, Tuple

from . import _native
from .errors import InvalidArgument

_INT_FORMATS = set("bBhHiIlLqQnN")
# ctypes type -> (array.array typecode, struct format chars of the same C type, min, max)
_TARGETS = {
    ctypes.c_int32: ("i", {"i"} if ctypes.sizeof(ctypes.c_int) == 4 else set(), -(2**31), 2**31 - 1),
    ctypes.c_uint32: ("I", {"I"} if ctypes.sizeof(ctypes.c_uint) == 4 else set(), 0, 2**32 - 1),
}
if ctypes.sizeof(ctypes.c_long) == 4:  # pragma: no cover (ILP32)
    _TARGETS[ctypes.c_int32][1].add("l")
    _TARGETS[ctypes.c_uint32][1].add("L")


U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
INT_MAX = 2**31 - 1  # C int

# Waits longer than this are taken as this long (libflexkv clamps the same way; float("inf") is "a year" too).
MAX_WAIT_S = 365 * 24 * 3600.0


def c_uint(value: Any, what: str, hi: int = U32_MAX, lo: int = 0) -> int:
    """`value` as a Python int for a C integer parameter that holds lo..hi; InvalidArgument (naming `what` and the
    range) outside it, TypeError for what is not an integer (bool and NumPy integers are integers)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} is a {type(value).__name__}; expected an integer") from None
    if not lo <= v <= hi:
        raise InvalidArgument(f"{what} is {v}; expected an integer in {lo}..{hi}")
    return v


def wait_seconds(timeout: Optional[float], what: str = "timeout") -> Optional[float]:
    """A wait's timeout in seconds: None stays None (no limit); negative is 0 (just look), longer than a year (inf
    included) is a year; NaN is InvalidArgument, what is not a number TypeError."""
    if timeout is None:
        return None
    if not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} is a {type(timeout).__name__}; expected seconds as a number, or None")
    t = float(timeout)
    if math.isnan(t):
        raise InvalidArgument(f"{what} is NaN; expected seconds >= 0, or None for no limit")
    return min(max(t, 0.0), MAX_WAIT_S)


def _range_error(what: str, lo: int, hi: int, bad: Any) -> InvalidArgument:
    return InvalidArgument(f"{what} holds {bad}; expected integers in {lo}..{hi}")


def c_int_array(values: Any, ctype: Any, what: str) -> Tuple[ctypes.Array, int]:
    """A ctypes array of `ctype` (c_int32 or c_uint32) holding `values`, and its length.

    `values`: a 1-D buffer of integers (NumPy array of any integer dtype, array.array, memoryview), or any
    iterable of ints (list, tuple, range, a torch CPU tensor via tolist()). Raises InvalidArgument for values out
    of the C type's range or a buffer that is not 1-D, TypeError for values that are not integers.
    """
    typecode, same_formats, lo, hi = _TARGETS[ctype]
    if isinstance(values, ctypes.Array) and values._type_ is ctype:
        return values, len(values)
    ext = _native.ext
    if ext is not None:  # a list, tuple or buffer read in C; None for anything the code below must look at
        raw = ext.ints(values, typecode == "i")
        if raw is not None:
            n = len(raw) // 4
            return (ctype * n).from_buffer(raw), n
    try:
        view = memoryview(values)
    except TypeError:
        view = None
    if view is not None:
        if view.ndim != 1:
            raise InvalidArgument(f"{what} is a {view.ndim}-D buffer; expected 1-D")
        fmt = view.format.lstrip("@=")
        if fmt in same_formats and view.c_contiguous:  # native byte order, exactly the C type: one memcpy
            return (ctype * len(view)).from_buffer_copy(view), len(view)
        if fmt.lstrip("<>!") not in _INT_FORMATS:
            raise TypeError(f"{what} has element format {view.format!r}; expected integers")
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(values, numpy.ndarray):
            if values.size and (int(values.min()) < lo or int(values.max()) > hi):
                bad = int(values.min()) if int(values.min()) < lo else int(values.max())
                raise _range_error(what, lo, hi, bad)
            converted = numpy.ascontiguousarray(values, dtype=numpy.int32 if typecode == "i" else numpy.uint32)
            return (ctype * converted.size).from_buffer_copy(memoryview(converted)), int(converted.size)
        values = view.tolist()
    elif hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # torch tensors and the like, without importing them
        if values and isinstance(values[0], list):
            raise InvalidArgument(f"{what} is nested; expected a 1-D sequence of integers")
    if not isinstance(values, (list, tuple, range)):
        values = list(values)
    try:
        arr = array.array(typecode, values)
    except OverflowError:
        for v in values:
            if not lo <= int(v) <= hi:
                raise _range_error(what, lo, hi, v) from None
        raise
    return (ctype * len(arr)).from_buffer(arr), len(arr)


def device_region(obj: Any, i: int) -> tuple:
    """(device pointer, bytes) of one KV region given as a tensor-like object or an int pointer (bytes None)."""
    if isinstance(obj, int):
        if not 0 < obj <= U64_MAX:
            raise InvalidArgument(f"KV region {i} is the pointer {obj}; expected a device address in 1..{U64_MAX}")
        return obj, None
    if hasattr(obj, "data_ptr") and hasattr(obj, "numel") and hasattr(obj, "element_size"):  # torch.Tensor & co
        if getattr(obj, "is_cuda", True) is False:
            raise InvalidArgument(f"tensor {i} is on {getattr(obj, 'device', 'the CPU')}; expected a CUDA tensor "
                                  "(host KV buffers come from create_host_kv)")
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise InvalidArgument(f"tensor {i} is not contiguous; expected one contiguous region per tensor")
        return int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(int(d) for d in cai["shape"])
        itemsize = int(cai["typestr"][2:])
        strides = cai.get("strides")
        if strides is not None:
            expected, step = [], itemsize
            for d in reversed(shape):
                expected.append(step)
                step *= d
            if tuple(strides) != tuple(reversed(expected)) and math.prod(shape) > 1:
                raise InvalidArgument(f"tensor {i} is not contiguous (shape {shape}, strides {tuple(strides)}); "
                                      "expected one contiguous region per tensor")
        return int(cai["data"][0]), math.prod(shape) * itemsize
    raise TypeError(f"KV region {i} is a {type(obj).__name__}; expected a CUDA tensor (data_ptr()+numel()+"
                    "element_size(), or __cuda_array_interface__) or an int device pointer")
