"""flexkvd.routing: the routing index against a per-node set model, tiers, idempotent updates, the choice, and the
router's keys agreeing with flexkvd.block_keys (what engines store under)."""
import random

import pytest

import flexkvd
from flexkvd.routing import NodePrefix, PrefixRouter, RoutingIndex, Tier, choose_prefix_aware

NS = "routing-test|bf16|tp1"


def prompt(i, blocks, bs=16):
    return [i * 100000 + t for t in range(blocks * bs)]


def test_prefix_per_node_and_tier():
    index = RoutingIndex()
    a, b, c = index.add_node("a"), index.add_node("b"), index.add_node("c")
    keys = flexkvd.block_keys(NS, prompt(1, 10), 16)
    index.stored(a, Tier.DRAM, keys[:6])
    index.stored(b, Tier.DRAM, keys[:4])
    index.stored(b, Tier.SSD, keys[4:8])
    index.stored(c, Tier.DRAM, keys[2:5])
    p = index.prefix_lengths(keys)
    assert p == [NodePrefix(a, 6, 6), NodePrefix(b, 8, 4), NodePrefix(c, 0, 0)]
    assert index.prefix_lengths(keys[:5]) == [NodePrefix(a, 5, 5), NodePrefix(b, 5, 4), NodePrefix(c, 0, 0)]
    assert index.prefix_lengths([]) == [NodePrefix(a, 0, 0), NodePrefix(b, 0, 0), NodePrefix(c, 0, 0)]
    assert index.key_count(b, Tier.SSD) == 4 and len(index) == 8


def test_idempotent_updates_and_clear():
    index = RoutingIndex()
    a, b = index.add_node("a"), index.add_node("b")
    keys = flexkvd.block_keys(NS, prompt(2, 8), 16)
    index.stored(a, Tier.DRAM, keys)
    index.stored(a, Tier.DRAM, keys)  # a snapshot replayed
    index.stored(b, Tier.DRAM, keys[:2])
    assert index.key_count(a, Tier.DRAM) == 8
    index.removed(a, Tier.DRAM, keys[5:])
    index.stored(a, Tier.SSD, keys[5:])
    assert index.prefix_lengths(keys)[a] == NodePrefix(a, 8, 5)
    index.removed(b, Tier.SSD, keys)  # not held: nothing changes
    assert index.key_count(b, Tier.DRAM) == 2
    index.clear_node(a)
    assert len(index) == 2 and index.key_count(a, Tier.SSD) == 0
    assert index.prefix_lengths(keys) == [NodePrefix(a, 0, 0), NodePrefix(b, 2, 2)]


def test_agrees_with_a_set_model():
    rng = random.Random(5)
    index = RoutingIndex()
    nodes = [index.add_node(f"n{i}") for i in range(5)]
    prompts = [flexkvd.block_keys(NS, prompt(10 + i, 12), 16) for i in range(10)]
    model = [[set(), set()] for _ in nodes]
    for step in range(1500):
        node, tier = rng.choice(nodes), rng.choice([Tier.DRAM, Tier.SSD])
        keys = rng.choice(prompts)
        lo = rng.randrange(len(keys))
        run = keys[lo:rng.randrange(lo + 1, len(keys) + 1)]
        if rng.random() < 0.33:
            index.removed(node, tier, run)
            model[node][tier].difference_update(run)
        else:
            index.stored(node, tier, run)
            model[node][tier].update(run)
        if step % 97 == 0:
            cleared = rng.choice(nodes)
            index.clear_node(cleared)
            model[cleared] = [set(), set()]
        probe = rng.choice(prompts)
        got = index.prefix_lengths(probe)
        for n in nodes:
            any_, dram = 0, 0
            while any_ < len(probe) and (probe[any_] in model[n][0] or probe[any_] in model[n][1]):
                any_ += 1
            while dram < len(probe) and probe[dram] in model[n][0]:
                dram += 1
            assert got[n] == NodePrefix(n, any_, dram), f"step {step} node {n}"
            assert index.key_count(n, Tier.DRAM) == len(model[n][0])
            assert index.key_count(n, Tier.SSD) == len(model[n][1])


def test_refusals_name_the_problem():
    index = RoutingIndex()
    with pytest.raises(flexkvd.InvalidArgument):
        index.add_node("")
    index.add_node("x")
    with pytest.raises(flexkvd.AlreadyExists):
        index.add_node("x")
    with pytest.raises(flexkvd.NotFound):
        index.find_node("y")
    with pytest.raises(flexkvd.InvalidArgument, match="never added"):
        index.stored(3, Tier.DRAM, [(1, 2)])
    for i in range(1, 64):
        index.add_node(f"n{i}")
    with pytest.raises(flexkvd.ResourceExhausted):
        index.add_node("one-too-many")
    index.stored(63, Tier.SSD, [(1, 2)])
    assert index.prefix_lengths([(1, 2)])[63] == NodePrefix(63, 1, 0)


def test_choice_and_router():
    prefixes = [NodePrefix(0, 4, 4), NodePrefix(1, 9, 9), NodePrefix(2, 9, 2), NodePrefix(3, 0, 0)]
    assert choose_prefix_aware(prefixes, [1, 3, 2, 0]) == 2
    assert choose_prefix_aware(prefixes, [1, 1, 5, 0]) == 1
    assert choose_prefix_aware(prefixes, [1, 7, 5, 0]) == 0
    with pytest.raises(flexkvd.InvalidArgument):
        choose_prefix_aware(prefixes, [1, 2])
    index = RoutingIndex()
    a, b = index.add_node("a"), index.add_node("b")
    tokens = prompt(3, 6) + [7, 7, 7]  # a trailing partial block is never keyed
    index.stored(b, Tier.DRAM, flexkvd.block_keys(NS, tokens, 16)[:5])
    router = PrefixRouter(index, NS, 16)
    assert list(router.keys(tokens)) == list(flexkvd.block_keys(NS, tokens[:96], 16))
    node, prefixes = router.route(tokens, loads=[0, 0])
    assert node == b and prefixes[b].blocks == 5 and prefixes[a].blocks == 0
    node, _ = router.route(tokens, loads=[0, 10])  # b overloaded
    assert node == a


def test_replace_node_leaves_exactly_the_keys_given():
    index = RoutingIndex()
    a, b = index.add_node("a"), index.add_node("b")
    keys = flexkvd.block_keys(NS, prompt(4, 10), 16)
    index.stored(a, Tier.DRAM, keys[:6])
    index.stored(a, Tier.SSD, keys[6:])
    index.stored(b, Tier.DRAM, keys[:3])
    index.replace_node(a, keys[:2], keys[2:5])  # keys 5-9 are held by no one now: they leave the index
    assert index.prefix_lengths(keys) == [NodePrefix(a, 5, 2), NodePrefix(b, 3, 3)]
    assert (index.key_count(a, Tier.DRAM), index.key_count(a, Tier.SSD), len(index)) == (2, 3, 5)
    index.replace_node(a, [keys[0], keys[0]])  # a key given twice counts once; no SSD keys
    assert (index.key_count(a, Tier.DRAM), index.key_count(a, Tier.SSD)) == (1, 0)
    index.replace_node(a, [])
    assert index.prefix_lengths(keys)[a] == NodePrefix(a, 0, 0) and len(index) == 3
    with pytest.raises(flexkvd.InvalidArgument, match="never added"):
        index.replace_node(5, keys[:1])
    assert len(index) == 3


def test_a_reader_during_replace_node_never_sees_a_half_replaced_node():
    """Regression (issue 20 review): KvEventFeed applied a snapshot as clear_node, stored(DRAM), stored(SSD), each
    locked on its own, so a router reading in between saw the node holding nothing or its DRAM part alone."""
    import sys
    import threading

    index = RoutingIndex()
    a = index.add_node("a")
    keys = flexkvd.block_keys(NS, prompt(5, 16), 16)
    index.replace_node(a, keys)
    done = threading.Event()
    torn, reads = [], [0]

    def read():
        while not done.is_set():
            p = index.prefix_lengths(keys)[a]
            if p.blocks != 16 or p.dram_blocks not in (8, 16):
                torn.append(p)
            reads[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: a torn view would show
    try:
        reader = threading.Thread(target=read)
        reader.start()
        i = 0
        while i < 3000 or reads[0] < 300:
            if i % 2 == 0:
                index.replace_node(a, keys[:8], keys[8:])
            else:
                index.replace_node(a, keys)
            i += 1
        done.set()
        reader.join()
    finally:
        sys.setswitchinterval(old)
    assert not torn, f"{len(torn)} of {reads[0]} reads saw a half-replaced node, e.g. {torn[0]}"


def test_a_node_that_is_not_live_is_never_chosen():
    """Regression (issue 29, item 8): liveness was not part of the choice, so a dead node holding the longest prefix
    was chosen: a request sent there fails, it does not cost a miss."""
    index = RoutingIndex()
    a, b = index.add_node("a"), index.add_node("b")
    keys = flexkvd.block_keys(NS, prompt(5, 6), 16)
    index.stored(a, Tier.DRAM, keys)
    index.stored(b, Tier.DRAM, keys[:2])
    assert choose_prefix_aware(index.prefix_lengths(keys), [0, 0]) == a
    index.set_live(a, False)
    p = index.prefix_lengths(keys)
    assert p[a] == NodePrefix(a, 6, 6, live=False)  # its keys stay (it may come back with them)
    assert choose_prefix_aware(p, [0, 0]) == b
    # The load limit is taken over the live nodes: b, the only live one, qualifies however loaded.
    assert choose_prefix_aware(p, [0, 100]) == b
    index.set_live(b, False)
    with pytest.raises(flexkvd.Unavailable, match="none of the 2 nodes is live"):
        choose_prefix_aware(index.prefix_lengths(keys), [0, 0])
    index.set_live(a, True)
    assert choose_prefix_aware(index.prefix_lengths(keys), [0, 0]) == a
    assert index.live_nodes() == [a]


def test_liveness_lapses_without_renewal_and_follows_membership():
    import time

    index = RoutingIndex()
    a, b = index.add_node("node-a"), index.add_node("node-b")
    assert index.is_live(a) and index.is_live(b)  # no feed, no membership: every node counts
    index.set_live(a, True, ttl_s=0.2)
    assert index.is_live(a)
    time.sleep(0.3)
    assert not index.is_live(a)  # not renewed: its daemon went quiet
    index.set_live(a, True, ttl_s=60)
    index.set_members(["node-b"])  # node-a's lease ended
    assert not index.is_live(a) and index.is_live(b)
    assert [p.live for p in index.prefix_lengths([])] == [False, True]
    index.set_members(None)  # membership not known: no node excluded for it
    assert index.is_live(a)
    with pytest.raises(flexkvd.InvalidArgument):
        index.set_live(7, True)
