"""Client.register_gpu_kv (python/flexkvd/client.py): what it accepts and refuses before libflexkv is called, and
that it never imports torch. The GPU round trips themselves run the example engine (test_examples.py)."""
from __future__ import annotations

import ctypes
import sys

import pytest

import flexkvd

LAYERS = 2
REGION = 2 * 16 * 4096  # [2 planes][16 blocks][4 KiB chunks] of the test geometry


class FakeTensor:
    """What register_gpu_kv reads from a torch.Tensor, nothing more."""

    def __init__(self, ptr: int, nbytes: int, is_cuda: bool = True, contiguous: bool = True) -> None:
        self.ptr, self.nbytes, self.is_cuda, self.contiguous = ptr, nbytes, is_cuda, contiguous
        self.device = "cuda:0" if is_cuda else "cpu"

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.nbytes // 2

    def element_size(self) -> int:
        return 2

    def is_contiguous(self) -> bool:
        return self.contiguous


class FakeCudaArray:
    """An object with only __cuda_array_interface__ (CuPy, Numba)."""

    def __init__(self, ptr: int, shape: tuple, strides=None) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "<u2", "strides": strides,
                                         "version": 3}


def test_refusals_name_what_is_wrong(client):
    t = FakeTensor(0x10000, REGION)
    with pytest.raises(flexkvd.InvalidArgument, match="tensor 1 is on cpu"):
        client.register_gpu_kv([t, FakeTensor(0x20000, REGION, is_cuda=False)], flexkvd.Layout.LAYER_FIRST, 16)
    with pytest.raises(flexkvd.InvalidArgument, match="tensor 0 is not contiguous"):
        client.register_gpu_kv([FakeTensor(0x10000, REGION, contiguous=False), t], flexkvd.Layout.LAYER_FIRST, 16)
    with pytest.raises(flexkvd.InvalidArgument, match="tensor 1 is not contiguous"):
        client.register_gpu_kv([FakeCudaArray(0x10000, (2, 16, 2048)), FakeCudaArray(0x20000, (2, 16, 2048), (2, 8192, 4))],
                               flexkvd.Layout.LAYER_FIRST, 16)
    with pytest.raises(flexkvd.InvalidArgument, match="different sizes"):
        client.register_gpu_kv([t, FakeTensor(0x20000, REGION // 2)], flexkvd.Layout.LAYER_FIRST, 16)
    with pytest.raises(flexkvd.InvalidArgument, match="expected one"):
        client.register_gpu_kv([t, t], flexkvd.Layout.BLOCK_FIRST, 16)
    with pytest.raises(flexkvd.InvalidArgument, match="region_bytes is needed"):
        client.register_gpu_kv([0x10000, 0x20000], flexkvd.Layout.LAYER_FIRST, 16)
    with pytest.raises(flexkvd.InvalidArgument, match="no KV regions"):
        client.register_gpu_kv([], flexkvd.Layout.LAYER_FIRST, 16)
    with pytest.raises(TypeError, match="KV region 0 is a str"):
        client.register_gpu_kv(["cuda:0"], flexkvd.Layout.BLOCK_FIRST, 16)


@pytest.mark.parametrize("regions", [
    [FakeTensor(0, REGION), FakeTensor(0, REGION)],
    [FakeCudaArray(0, (2, 16, 2048)), FakeCudaArray(0, (2, 16, 2048), (65536, 4096, 2))],  # explicit C strides
    "pointers",
])
def test_well_formed_regions_reach_libflexkv_without_importing_torch(client, regions):
    """Host memory posing as device memory: libflexkv refuses it (which code depends on the machine: no CUDA build,
    no driver, or not device memory), after the package accepted the regions."""
    host = ctypes.create_string_buffer(REGION * LAYERS)
    base = ctypes.addressof(host)
    if regions == "pointers":
        regions, kwargs = [base, base + REGION], {"region_bytes": REGION}
    else:
        for i, r in enumerate(regions):
            if isinstance(r, FakeTensor):
                r.ptr = base + i * REGION
            else:
                r.__cuda_array_interface__["data"] = (base + i * REGION, False)
        kwargs = {}
    torch_before = "torch" in sys.modules  # another test module of the same session may have imported it
    with pytest.raises(flexkvd.Error) as e:
        client.register_gpu_kv(regions, flexkvd.Layout.LAYER_FIRST, 16, **kwargs)
    assert e.value.code in (flexkvd.StatusCode.INVALID_ARGUMENT, flexkvd.StatusCode.UNAVAILABLE,
                            flexkvd.StatusCode.UNIMPLEMENTED), e.value
    assert ("torch" in sys.modules) == torch_before, "registering regions imported torch"


def test_layer_events_need_a_gpu_or_round_trip_and_streams_are_checked(client):
    # Where no GPU is visible (or the daemon has no cuda backend) layer_events() raises the reason and leaves nothing
    # behind; on a GPU machine the set registers, closes, and closes again harmlessly.
    from flexkvd.client import _stream_handle
    try:
        events = client.layer_events(LAYERS)
    except (flexkvd.FailedPrecondition, flexkvd.Unimplemented, flexkvd.ResourceExhausted) as e:
        assert str(e)
    else:
        with events:
            assert events.id > 0 and events.num_layers == LAYERS
            with pytest.raises(flexkvd.InvalidArgument, match="past the set's"):
                events.wait(LAYERS)
            events.wait(0)  # the legacy default stream: nothing recorded yet, does not block
        events.close()
        with pytest.raises(flexkvd.FailedPrecondition, match="closed"):
            events.wait(0)

    class TorchLikeStream:
        cuda_stream = 0x7F00

    assert _stream_handle(None) is None
    assert _stream_handle(0) is None
    assert _stream_handle(0x1234) == 0x1234
    assert _stream_handle(TorchLikeStream()) == 0x7F00
    for bad in ("stream", -1, 1.5, True):
        with pytest.raises(flexkvd.InvalidArgument, match="expected None, a cudaStream_t"):
            _stream_handle(bad)
