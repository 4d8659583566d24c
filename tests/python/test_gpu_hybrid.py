"""GPU, hybrid geometry: every component's KV buffers are torch CUDA tensors registered with
register_gpu_kv(component=i) (the CUDA backend); one session stores FULL blocks, a sliding window and state
snapshots, another loads what its prefix end needs and compares bytes on the device. Skipped where torch or a GPU is
missing (this CI machine has neither; scripts/device_python.sh runs it on the device)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

import flexkvd  # noqa: E402

NAMESPACE = "pytest-gpu-hybrid"
# FULL and a 32-token (2-block) window: 2 layers, K/V, 2 heads of 64, bf16, 16 tokens (4 KiB chunks); a state of
# 2 layers x 256 bytes.
GEOMETRY = flexkvd.Geometry(tokens_per_block=16, num_layers=2, kv_planes=2, kv_heads_per_rank=2, head_dim=64,
                           components=[flexkvd.ComponentSpec.sliding_window(2, 2, 64, 32),
                                       flexkvd.ComponentSpec.state(2, 256)])
BLOCKS = 16


def register(client: flexkvd.Client, fill: bool, geometry: flexkvd.Geometry = GEOMETRY, blocks=None):
    """Per component, LAYER_FIRST: one [planes][blocks][chunk] uint8 tensor per layer of its copy geometry;
    blocks[i]: component i's block count (default BLOCKS each)."""
    kv = []
    for i in range(geometry.component_count):
        g = geometry.component(i)
        n = BLOCKS if blocks is None else blocks[i]
        layers = [torch.zeros((g.kv_planes, n, g.chunk_bytes_per_rank), dtype=torch.uint8, device="cuda")
                  for _ in range(g.num_layers)]
        if fill:
            for t in layers:
                t.random_(0, 256)
        client.register_gpu_kv(layers, flexkvd.Layout.LAYER_FIRST, n, component=i)
        kv.append(layers)
    torch.cuda.synchronize()
    return kv


def blocks(kv, component: int, ids):
    """The given blocks of one component, every layer and plane, as one tensor [layer][plane][block][chunk]."""
    return torch.stack([t[:, ids] for t in kv[component]])


def test_a_hybrid_prefix_round_trips_through_gpu_buffers(make_daemon):
    d = make_daemon(pool_size="256MiB")
    tokens = [(5 * 100003 + i) % 128000 for i in range(6 * 16)]
    keys = flexkvd.block_keys(NAMESPACE, tokens, 16)
    with flexkvd.connect(d.socket) as a, flexkvd.connect(d.socket) as b:
        a.attach("gpu-a", NAMESPACE, GEOMETRY)
        b.attach("gpu-b", NAMESPACE, GEOMETRY)
        kv_a = register(a, fill=True)
        kv_b = register(b, fill=False)
        stored = a.store(keys, [list(range(6)), [10, 11], [3, 4]], state_boundaries=[3, 6]).wait()
        assert stored.done_blocks == 6
        hit = b.match(keys, pin=True).wait()
        assert hit.matched_blocks == 6
        loaded = b.load(hit.match_handle, [[8, 9, 10, 11, 12, 13], [0, 1], [15]]).wait()
        assert loaded.done_blocks == 6
        b.release(hit.match_handle).wait()
        torch.cuda.synchronize()
        assert torch.equal(blocks(kv_b, 0, list(range(8, 14))), blocks(kv_a, 0, list(range(6))))
        assert torch.equal(blocks(kv_b, 1, [0, 1]), blocks(kv_a, 1, [10, 11]))
        assert torch.equal(blocks(kv_b, 2, [15]), blocks(kv_a, 2, [4]))  # the snapshot at e = 6
        assert int(blocks(kv_b, 0, list(range(8)) + [14, 15]).sum()) == 0
        assert int(blocks(kv_b, 1, list(range(2, 16))).sum()) == 0
        assert int(blocks(kv_b, 2, list(range(15))).sum()) == 0


# Large enough that a layer's copies take a while (8 layers of 32 KiB chunks per component, 1 MiB states), so a
# snapshot taken right after one layer's event would see a layer that had not landed.
BIG = flexkvd.Geometry(tokens_per_block=16, num_layers=8, kv_planes=2, kv_heads_per_rank=8, head_dim=128,
                      components=[flexkvd.ComponentSpec.sliding_window(8, 8, 128, 64),
                                  flexkvd.ComponentSpec.state(4, 1 << 20)])
BIG_BLOCKS = [160, 160, 4]  # full, window, state slots


def test_hybrid_layer_wise_loads_land_each_layer_by_its_event_and_its_progress(make_daemon):
    """Layer by layer in BIG.layer_order(): with an event set, each layer is snapshotted on a stream of its own that
    waited only for that layer's event (its index in the order), right after the launch - equal to the stored bytes,
    so every event was recorded after its own layer's copies; with layer progress, wait_layers(i + 1) alone makes
    entry i's layer readable. A second load into other blocks reuses the set."""
    d = make_daemon(pool_size="1GiB")
    n = 128
    tokens = [(7 * 100003 + i) % 128000 for i in range(n * 16)]
    keys = flexkvd.block_keys(NAMESPACE, tokens, 16)
    order = BIG.layer_order()
    assert len(order) == BIG.total_layers == 20 and order[:4] == [(2, 0), (2, 1), (2, 2), (2, 3)]
    with flexkvd.connect(d.socket) as a, flexkvd.connect(d.socket) as b:
        a.attach("gpu-a", NAMESPACE, BIG)
        b.attach("gpu-b", NAMESPACE, BIG)
        kv_a = register(a, True, BIG, BIG_BLOCKS)
        kv_b = register(b, False, BIG, BIG_BLOCKS)
        assert a.store(keys, [list(range(n)), [0, 1, 2, 3], [1]], state_boundaries=[n]).wait().done_blocks == n
        want = {0: list(range(n)), 1: [0, 1, 2, 3], 2: [1]}
        hit = b.match(keys, pin=True).wait()
        assert hit.matched_blocks == n
        with b.layer_events(BIG.total_layers) as events:
            for targets in ([list(range(20, 20 + n)), [10, 11, 12, 13], [3]],
                            [list(range(30, 30 + n)), [20, 21, 22, 23], [2]]):
                streams = [torch.cuda.Stream() for _ in order]
                t = b.load(hit.match_handle, targets, event_set=events)
                t.wait_launched(timeout=10)
                snapshots = []
                for i, (c, layer) in enumerate(order):
                    events.wait(i, streams[i])
                    with torch.cuda.stream(streams[i]):
                        snapshots.append(kv_b[c][layer][:, targets[c]].clone())
                torch.cuda.synchronize()
                assert t.wait().done_blocks == n
                for (c, layer), snap in zip(order, snapshots):
                    assert torch.equal(snap, kv_a[c][layer][:, want[c]]), (c, layer)
        for t in kv_b:
            for layer in t:
                layer.zero_()
        torch.cuda.synchronize()
        targets = [list(range(2, 2 + n)), [30, 31, 32, 33], [0]]
        t = b.load(hit.match_handle, targets, layerwise=True)
        for i, (c, layer) in enumerate(order):
            assert t.wait_layers(i + 1, timeout=10) >= i + 1
            assert torch.equal(kv_b[c][layer][:, targets[c]], kv_a[c][layer][:, want[c]]), (c, layer)
        assert t.wait().done_blocks == n
        b.release(hit.match_handle).wait()
