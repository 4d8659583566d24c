#!/usr/bin/env python3
"""A prefix-aware router over N flexkvd nodes: each request goes to the node holding the longest prefix of its prompt.

It subscribes to every node's KV event stream (flexkvd.routing.KvEventFeed: a snapshot, then every block stored in or
removed from DRAM and SSD, resubscribing after a daemon restart), keeps one flexkvd.routing.RoutingIndex of them all,
and for each prompt computes its block keys with flexkvd's key function (the namespace and block size the engines
use) and picks a node with choose_prefix_aware: the longest cached prefix among the nodes not overloaded, ties to
the least loaded, and never a node that is not live (its event stream ended or went quiet: a request sent there
would fail). Load here is the number of requests this router sent to a node among its last --window; a real router
would use the engines' queue depths.

Requests come as JSON lines on stdin, {"id": ..., "tokens": [int, ...]}; each decision goes to stdout as a JSON
line {"id", "node", "cached_blocks", "prefixes": {node: [blocks, dram_blocks]}}, or {"id", "error"} when no node is
live. A real router would forward the request to that node's engine instead of printing.

  python3 examples/prefix_router.py --node a=/run/flexkvd-a/flexkvd.sock --node b=/run/flexkvd-b/flexkvd.sock \\
      --namespace "llama3-8b|bf16|tp1" --tokens-per-block 16 < requests.jsonl
(PYTHONPATH=python and FLEXKV_LIBRARY=build/libflexkv.so.0 in a build tree.)
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Dict, List, Optional

from flexkvd.errors import Unavailable
from flexkvd.routing import KvEventFeed, PrefixRouter, RoutingIndex


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--node", action="append", required=True, metavar="NAME=SOCKET",
                    help="a node and its flexkvd control socket (repeat per node)")
    ap.add_argument("--namespace", required=True, help="the engines' model namespace (cache domain)")
    ap.add_argument("--tokens-per-block", type=int, required=True, help="the engines' tokens per block")
    ap.add_argument("--max-load-ratio", type=float, default=2.0)
    ap.add_argument("--window", type=int, default=0, help="requests the load counts (default 8 x nodes)")
    ap.add_argument("--sync-timeout", type=float, default=10.0,
                    help="seconds to wait for every node's first snapshot before routing (a node that is not up by "
                         "then is not chosen until its daemon is heard from)")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    index = RoutingIndex()
    feeds: Dict[str, KvEventFeed] = {}
    for spec in args.node:
        name, sep, socket = spec.partition("=")
        if not sep or not name or not socket:
            raise SystemExit(f"prefix_router: --node {spec!r}; expected NAME=SOCKET")
        feeds[name] = KvEventFeed(index, index.add_node(name), socket, namespace=args.namespace)
    for name, feed in feeds.items():
        if not feed.wait_synced(args.sync_timeout):
            print(f"prefix_router: node {name} has no snapshot yet ({feed.last_error or 'no answer'}); it is not "
                  "chosen until its daemon answers", file=sys.stderr)
    router = PrefixRouter(index, args.namespace, args.tokens_per_block, args.max_load_ratio)
    names = list(feeds)
    window = args.window or 8 * len(names)
    recent: collections.deque = collections.deque()
    loads = [0.0] * len(names)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            try:
                node, prefixes = router.route(req["tokens"], loads)
            except Unavailable as err:  # no node is live: nowhere to send it
                print(json.dumps({"id": req.get("id"), "error": str(err)}), flush=True)
                continue
            recent.append(node)
            loads[node] += 1
            if len(recent) > window:
                loads[recent.popleft()] -= 1
            print(json.dumps({"id": req.get("id"), "node": names[node], "cached_blocks": prefixes[node].blocks,
                              "prefixes": {names[p.node]: [p.blocks, p.dram_blocks] for p in prefixes}}), flush=True)
    finally:
        for feed in feeds.values():
            feed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
