"""flexkvd.Geometry and flexkvd.Layout (python/flexkvd/geometry.py)."""
from __future__ import annotations

import dataclasses

import pytest

import flexkvd
from engine_process import TEST_GEOMETRY


def test_defaults_are_the_cpp_defaults():
    g = flexkvd.Geometry()
    assert (g.tokens_per_block, g.num_layers, g.kv_planes, g.kv_heads_per_rank, g.head_dim, g.dtype_bytes,
            g.tp_size) == (16, 0, 2, 0, 0, 2, 1)


def test_layouts():
    assert [(l.name, int(l)) for l in flexkvd.Layout] == [("LAYER_FIRST", 1), ("BLOCK_FIRST", 2), ("LAYER_BLOCK", 3),
                                                          ("LAYER_BLOCK_REGIONS", 4)]


def test_presets_and_sizes():
    assert flexkvd.Geometry.llama3_8b().host_block_bytes == 2 * 1024 * 1024
    assert flexkvd.Geometry.qwen3_8b().host_block_bytes == 2304 * 1024
    mla = flexkvd.Geometry.deepseek_mla()
    assert mla.is_mla and mla.chunk_bytes_per_rank == 18 * 1024
    tp2 = flexkvd.Geometry(num_layers=4, kv_heads_per_rank=4, head_dim=128, tp_size=2)
    assert tp2.host_kv_heads == 8 and tp2.host_block_bytes == 16 * 4 * 2 * 8 * 128 * 2


def test_host_block_bytes_is_what_the_daemon_allocates(client):
    assert client.status().block_bytes == TEST_GEOMETRY.host_block_bytes == 16 * 1024


# ---- hybrid geometries: components (docs/hybrid.md) ----

def test_hybrid_presets_match_the_cpp_numbers():
    # Hand-computed as in tests/unit/common/geometry_test.cc (16 tokens per block, bf16, TP 1).
    oss = flexkvd.Geometry.gpt_oss_20b()
    assert oss.is_hybrid and oss.component_count == 2
    assert (oss.num_layers, oss.kv_heads_per_rank, oss.head_dim) == (12, 8, 64)
    assert oss.components == [flexkvd.ComponentSpec(flexkvd.ComponentKind.SLIDING_WINDOW, 12, 2, 8, 64, 2, 128, 0)]
    assert [oss.component(i).host_block_bytes for i in range(2)] == [393216, 393216]
    assert oss.window_blocks(1) == 8 and oss.window_blocks(0) == 0
    gemma = flexkvd.Geometry.gemma3_27b()
    assert [gemma.component(i).host_block_bytes for i in range(2)] == [1310720, 6815744]
    assert gemma.window_blocks(1) == 64
    qwen = flexkvd.Geometry.qwen3_next_80b()
    assert qwen.component_kind(1) == flexkvd.ComponentKind.STATE
    assert qwen.components[0].state_bytes_per_layer == 2146304
    assert [qwen.component(i).host_block_bytes for i in range(2)] == [393216, 77266944]
    assert qwen.window_blocks(1) == 0
    jamba = flexkvd.Geometry.jamba_like()
    assert jamba.components[0] == flexkvd.ComponentSpec(flexkvd.ComponentKind.STATE, 28, 0, 0, 0, 0, 0, 573440)
    assert [jamba.component(i).host_block_bytes for i in range(2)] == [262144, 16056320]


def test_component_copy_geometry():
    g = flexkvd.Geometry.jamba_like()
    full = g.component(0)
    assert not full.is_hybrid and full == dataclasses.replace(g, components=[])
    state = g.component(1)
    assert (state.tokens_per_block, state.kv_planes, state.kv_heads_per_rank, state.num_layers) == (1, 1, 1, 28)
    assert state.state_bytes_per_layer == state.chunk_bytes_per_rank == 573440
    assert not state.is_mla
    tp2 = dataclasses.replace(g, tp_size=2, kv_heads_per_rank=4)
    assert tp2.component(1).host_block_bytes == 2 * 28 * 573440  # every rank's shard
    with pytest.raises(IndexError, match="component 2 is not in this geometry; expected 0..1"):
        g.component(2)
    wide = flexkvd.Geometry.gpt_oss_20b()
    wide.components[0].window_tokens = 129
    assert wide.window_blocks(1) == 9


def test_component_id_counts_are_the_ring_layouts():
    g = flexkvd.Geometry(num_layers=2, kv_heads_per_rank=2, head_dim=64,
                        components=[flexkvd.ComponentSpec.sliding_window(2, 2, 64, 32),
                                    flexkvd.ComponentSpec.state(2, 256)])
    assert [g.component_id_count(i, True, 5, 2) for i in range(3)] == [5, 2, 2]
    assert [g.component_id_count(i, False, 1) for i in range(3)] == [1, 1, 1]


def test_a_geometry_converts_to_the_c_struct_with_its_components():
    c = flexkvd.Geometry.gpt_oss_20b()._to_c()
    assert c.n_components == 1
    assert (c.components[0].kind, c.components[0].window_tokens, c.components[0].num_layers) == (2, 128, 12)
    assert flexkvd.Geometry.llama3_8b()._to_c().n_components == 0
    with pytest.raises(flexkvd.InvalidArgument, match=r"geometry.components\[0\].window_tokens is -1"):
        bad = flexkvd.Geometry.gpt_oss_20b()
        bad.components[0].window_tokens = -1
        bad._to_c()
    with pytest.raises(flexkvd.InvalidArgument, match="8 components beside the full-attention layers"):
        flexkvd.Geometry(components=[flexkvd.ComponentSpec.state(1, 16)] * 8)._to_c()
    with pytest.raises(flexkvd.InvalidArgument, match="state_bytes_per_layer"):
        flexkvd.Geometry.jamba_like().component(1)._to_c()


@pytest.mark.parametrize("field,value", [
    ("num_layers", 0), ("kv_planes", 3), ("kv_heads_per_rank", 0), ("head_dim", 0), ("dtype_bytes", 3),
    ("window_tokens", 0), ("state_bytes_per_layer", 16)])
def test_the_daemon_names_a_bad_sliding_window_field(daemon, field, value):
    g = flexkvd.Geometry.gpt_oss_20b()
    setattr(g.components[0], field, value)
    with flexkvd.connect(daemon.socket) as c:
        with pytest.raises(flexkvd.InvalidArgument, match=rf"components\[0\]\.{field}"):
            c.attach("bad", "hybrid", g)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("state_bytes_per_layer", 24), ("window_tokens", 16)])
def test_the_daemon_names_a_bad_state_field(daemon, field, value):
    g = flexkvd.Geometry.jamba_like()
    setattr(g.components[0], field, value)
    with flexkvd.connect(daemon.socket) as c:
        with pytest.raises(flexkvd.InvalidArgument, match=rf"components\[0\]\.{field}"):
            c.attach("bad", "hybrid", g)


def test_a_hybrid_geometry_that_differs_from_the_domain_is_refused(daemon):
    with flexkvd.connect(daemon.socket) as a, flexkvd.connect(daemon.socket) as b:
        a.attach("a", "hybrid", flexkvd.Geometry.gpt_oss_20b())
        other = flexkvd.Geometry.gpt_oss_20b()
        other.components[0].window_tokens = 256
        with pytest.raises(flexkvd.FailedPrecondition, match=r"components\[0\]"):
            b.attach("b", "hybrid", other)
