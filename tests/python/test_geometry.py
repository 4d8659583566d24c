"""flexkv.Geometry and flexkv.Layout (python/flexkv/geometry.py)."""
from __future__ import annotations

import flexkv
from engine_process import TEST_GEOMETRY


def test_defaults_are_the_cpp_defaults():
    g = flexkv.Geometry()
    assert (g.tokens_per_block, g.num_layers, g.kv_planes, g.kv_heads_per_rank, g.head_dim, g.dtype_bytes,
            g.tp_size) == (16, 0, 2, 0, 0, 2, 1)


def test_layouts():
    assert [(l.name, int(l)) for l in flexkv.Layout] == [("LAYER_FIRST", 1), ("BLOCK_FIRST", 2), ("LAYER_BLOCK", 3)]


def test_presets_and_sizes():
    assert flexkv.Geometry.llama3_8b().host_block_bytes == 2 * 1024 * 1024
    assert flexkv.Geometry.qwen3_8b().host_block_bytes == 2304 * 1024
    mla = flexkv.Geometry.deepseek_mla()
    assert mla.is_mla and mla.chunk_bytes_per_rank == 18 * 1024
    tp2 = flexkv.Geometry(num_layers=4, kv_heads_per_rank=4, head_dim=128, tp_size=2)
    assert tp2.host_kv_heads == 8 and tp2.host_block_bytes == 16 * 4 * 2 * 8 * 128 * 2


def test_host_block_bytes_is_what_the_daemon_allocates(client):
    assert client.status().block_bytes == TEST_GEOMETRY.host_block_bytes == 16 * 1024
