"""examples/hf_hybrid_reuse.py's links to flexkvd, without a GPU: the block ids its engines pass per KV cache group
move the right bytes of each component.

The example itself needs torch with CUDA and transformers (the device machine, scripts/device_hf_hybrid.sh). Its
links (the vLLM connector's logic with KV cache groups, and the plain client) run here against a real flexkvd with a
stand-in of the model's id bookkeeping (HybridModel.groups / component_ids, the example's own functions) and host KV:
engine A fills its blocks with a pattern per component and position and stores; engine B loads into other ids, whole
and past a local prefix (first_block), and layer by layer (the example's bare layer-wise probe: every layer of the
geometry's layer order reported), and every chunk B holds is checked."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import pytest

import flexkvd
from conftest import REPO

EXAMPLE = os.path.join(REPO, "examples", "hf_hybrid_reuse.py")


def load_example():
    spec = importlib.util.spec_from_file_location("hf_hybrid_reuse", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, sys.modules["hf_hybrid_model"]


R, M = load_example()
BS, N, E, W = 16, 1024, 64, 8  # tokens per block, prefix tokens, its blocks, window blocks (128 tokens)


class StandIn:
    """What the links use of HybridModel, with components that have no GPU tensors (host KV): a gpt-oss-like
    model ("window": full + sliding-window layers) or a Qwen3-Next-like one ("state": full + linear layers)."""

    groups = M.HybridModel.groups
    component_ids = M.HybridModel.component_ids

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.args = argparse.Namespace(block_size=BS)
        self.num_blocks, self.num_window_blocks, self.num_slots = 96, 20, 4
        self.window_blocks = W if kind == "window" else 0
        self.window_kv = [None] if kind == "window" else []
        self.states = [None] if kind == "state" else []
        self.layers_of = {M.FULL: [1, 3]}
        self.full_kv = None

    def namespace(self) -> str:
        return f"hf-hybrid-links-{self.kind}"

    def geometry(self) -> flexkvd.Geometry:
        comp = flexkvd.ComponentSpec.sliding_window(2, 2, 64, W * BS) if self.kind == "window" else \
            flexkvd.ComponentSpec.state(2, 4096)
        return flexkvd.Geometry(tokens_per_block=BS, num_layers=2, kv_heads_per_rank=2, head_dim=64,
                                components=[comp])

    def components(self):
        other = (M.WINDOW, None, self.num_window_blocks) if self.kind == "window" else (M.STATE, None, self.num_slots)
        return [(M.FULL, None, self.num_blocks), other]


def chunks(view: memoryview, g: flexkvd.Geometry, block: int):
    """The (layer, plane) chunks of one block (or state slot) of a LAYER_FIRST host buffer of copy geometry g."""
    chunk = g.chunk_bytes_per_rank
    nb = len(view) // (g.num_layers * g.kv_planes * chunk)
    for layer in range(g.num_layers):
        for plane in range(g.kv_planes):
            off = ((layer * g.kv_planes + plane) * nb + block) * chunk
            yield layer, plane, slice(off, off + chunk)


def pattern(seed: int, layer: int, plane: int, size: int) -> bytes:
    return bytes([(seed * 7 + layer * 3 + plane) % 251 + 1]) * size


def fill(view: memoryview, g: flexkvd.Geometry, block: int, seed: int) -> None:
    for layer, plane, where in chunks(view, g, block):
        view[where] = pattern(seed, layer, plane, where.stop - where.start)


def holds(view: memoryview, g: flexkvd.Geometry, block: int, seed: int) -> bool:
    """Whether the block holds seed's pattern (seed None: zeros)."""
    for layer, plane, where in chunks(view, g, block):
        want = bytes(where.stop - where.start) if seed is None else pattern(seed, layer, plane, where.stop - where.start)
        if bytes(view[where]) != want:
            return False
    return True


@pytest.mark.parametrize("link", ["client", "connector"])
@pytest.mark.parametrize("kind", ["window", "state"])
def test_a_hybrid_prefix_moves_between_engines_into_other_ids(daemon, kind, link):
    model = StandIn(kind)
    g = model.geometry()
    g0, g1 = g.component(0), g.component(1)
    args = argparse.Namespace(socket=daemon.socket, link=link)
    tokens = list(range(5, 5 + N))
    prompt = tokens + list(range(9, 9 + 64))
    window_seed = lambda p: 1000 + p  # noqa: E731 - the window's block at prompt position p

    a = R.make_link(args, model, "engine-A")
    assert a.kind == link
    full_a = list(range(1, E + 1))
    window_a = list(range(1, W + 1)) if kind == "window" else []
    for p, b in enumerate(full_a):
        fill(a.host_views[0], g0, b, p + 1)
    if kind == "window":
        for i, b in enumerate(window_a):
            fill(a.host_views[1], g1, b, window_seed(E - W + i))
    else:
        fill(a.host_views[1], g1, 1, 5000)
    stored = a.store("A", tokens, model.groups(E, full_a, window_a, 1))
    assert stored["stored_blocks"] == E
    a.close()

    b = R.make_link(args, model, "engine-B")
    full_b = list(range(model.num_blocks - E, model.num_blocks))
    window_b = list(range(model.num_window_blocks - W, model.num_window_blocks)) if kind == "window" else []
    groups = model.groups(E, full_b, window_b, 2)

    def check_loaded(local: int) -> None:
        for p, blk in enumerate(full_b):
            assert holds(b.host_views[0], g0, blk, None if p < local else p + 1), f"full block at position {p}"
        if kind == "window":
            for i, blk in enumerate(window_b):
                assert holds(b.host_views[1], g1, blk, window_seed(E - W + i)), f"window block {i}"
        else:
            assert holds(b.host_views[1], g1, 2, 5000), "state slot"

    # Whole: every component's part of the prefix end E, into B's own ids.
    assert b.match("B-whole", prompt, 0) == N
    assert b.load("B-whole", prompt, groups, 0, N)
    assert b.moved["blocks"] == E
    check_loaded(0)
    # Half the prefix held already: FULL blocks from k only (B's blocks before k untouched), the window and state.
    for view in b.host_views:
        view[:] = bytes(len(view))
    k = E // 2
    assert b.match("B-first-block", prompt, k * BS) == N - k * BS
    assert b.load("B-first-block", prompt, groups, k * BS, N - k * BS)
    assert b.moved["blocks"] == E - k
    check_loaded(k)
    for view in b.host_views:
        view[:] = bytes(len(view))
    probe = b.probe(prompt, groups)
    assert probe["ok"] and len(probe["layer_ms"]) == g.total_layers, probe
    check_loaded(0)
    b.close()
