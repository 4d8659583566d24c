"""python3 -m flexkvd.bench: the Python client's costs beside the C/C++ ones, from one run against one daemon.

Measures (docs/performance.md "Python fast path (issue 17)"):
  - a match round trip, Client.match(keys).wait(), 4 keys that all hit: p50/p99, unpinned and pinned + release
    (match(pin=True).wait() then release(handle).wait()); beside it the same calls in a C loop in this process and
    session (flexkvd._fast.bench_round_trips, when the extension is there) and `flexkv-bench ring --clients 1`
    against the same daemon (a C++ process of its own, unpinned only);
  - flexkvd.block_keys over 1k / 8k / 32k tokens from a Python list and from a NumPy int32 array (when NumPy is
    installed): p50 and keys/s; beside it flexkv_compute_block_keys called once per iteration on a ready int32
    array (one ctypes call: ~0.5 us of it is ctypes).
The daemon: --socket S uses a running flexkvd (the bench attaches in its own namespace "flexkv-bench-python" with
a 16-token, 8 KiB-block geometry and stores 4 blocks); without --socket it starts a private one (socket and pool
in a temporary directory, --pool-size 64MiB) from $FLEXKVD, else the flexkvd beside the loaded libflexkv (a build
tree), else `flexkvd` on PATH, and stops it at the end. flexkv-bench is found the same way ($FLEXKV_BENCH).
FLEXKV_NO_EXTENSION=1 measures the pure ctypes path ("before"). The figures depend on where the scheduler puts
this process and the daemon's poller (see docs/performance.md); compare columns of one run, not runs.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, Optional, Sequence

import flexkvd
from flexkvd import _lib, _native

NAMESPACE = "flexkv-bench-ring"  # flexkv-bench ring's cache domain (namespace and geometry): a daemon serves one
GEOMETRY = flexkvd.Geometry(tokens_per_block=16, num_layers=2, kv_planes=2, kv_heads_per_rank=1, head_dim=64,
                           dtype_bytes=2, tp_size=1)
KEY_SIZES = (1024, 8192, 32768)


def _percentile(sorted_ns: Sequence[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(len(sorted_ns) * q))] / 1e3


def _summary(samples_ns: List[int]) -> dict:
    s = sorted(samples_ns)
    return {"p50_us": round(_percentile(s, 0.50), 2), "p99_us": round(_percentile(s, 0.99), 2), "n": len(s)}


def _time(fn: Callable[[], object], iterations: int, warmup: int) -> List[int]:
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    out = [0] * iterations
    for i in range(iterations):
        t0 = clock()
        fn()
        out[i] = clock() - t0
    return out


def _beside_library(name: str, env: str) -> Optional[str]:
    if os.environ.get(env):
        return os.environ[env]
    here = os.path.join(os.path.dirname(os.path.abspath(_lib.lib._name)), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


class _PrivateDaemon:
    """A flexkvd in a temporary directory, stopped by stop()."""

    def __init__(self, binary: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="flexkv-pybench-")
        self.socket = os.path.join(self.dir, "flexkvd.sock")
        self.pool_dir = f"/dev/shm/flexkv-pybench-{os.getpid()}"
        self.log = open(os.path.join(self.dir, "flexkvd.log"), "wb")
        self.process = subprocess.Popen([binary, "--socket", self.socket, "--pool-path",
                                         os.path.join(self.pool_dir, "pool"), "--pool-size", "64MiB"],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                                        start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.process.poll() is None:
            with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as s:
                try:
                    s.connect(self.socket)
                    return
                except OSError:
                    time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"flexkvd ({binary}) did not start; its log is gone with {self.dir}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.pool_dir, ignore_errors=True)


def _cpp_ring(bench: Optional[str], socket: str, iterations: int) -> Optional[dict]:
    """flexkv-bench ring --clients 1 against `socket`: the C++ client's match round trip, or None without it."""
    if not bench:
        return None
    cmd = [bench, "ring", "--socket", socket, "--clients", "1", "--iterations", str(iterations),
           "--grpc-iterations", "10", "--json"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600,
                          start_new_session=True)
    if done.returncode != 0:
        print(f"flexkvd.bench: {' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}", file=sys.stderr)
        return None
    ring = json.loads(done.stdout)["ring"]
    return {"p50_us": round(ring["p50_us"], 2), "p99_us": round(ring["p99_us"], 2), "n": iterations}


def _round_trips(client: "flexkvd.Client", iterations: int, rounds: int, cpp: Callable[[], Optional[dict]]) -> dict:
    kv = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, 8)
    del kv  # the bytes do not matter; the session keeps the buffer
    rng = random.Random(17)
    keys = flexkvd.block_keys(NAMESPACE, [rng.randrange(128000) for _ in range(4 * 16)], 16)
    client.store(keys, [0, 1, 2, 3]).wait(timeout=10)
    hit = client.match(keys).wait(timeout=10)
    if hit.matched_blocks != len(keys):
        raise RuntimeError(f"matched {hit.matched_blocks} of {len(keys)} stored blocks")

    def unpinned() -> None:
        client.match(keys).wait()

    def pinned() -> None:
        client.release(client.match(keys, pin=True).wait().match_handle).wait()

    def c_loop(pin: bool) -> List[int]:
        got = ext.bench_round_trips(client._handle.ptr, keys._array, pin, iterations)
        if isinstance(got, int):
            raise _lib.error_from_last(got, "C round trip loop")
        return got

    # Rounds, each figure once per round in turn, so that a change of the scheduler's placement (the slow mode of
    # docs/performance.md) lands on every column rather than on whichever ran then.
    warmup = min(2000, iterations)
    ext = _native.ext
    samples: dict = {}
    for _ in range(rounds):
        samples.setdefault("python_unpinned", []).extend(_time(unpinned, iterations, warmup))
        if ext is not None:
            samples.setdefault("c_unpinned", []).extend(c_loop(False))
        samples.setdefault("python_pinned_release", []).extend(_time(pinned, iterations, warmup))
        if ext is not None:
            samples.setdefault("c_pinned_release", []).extend(c_loop(True))
        got = cpp()
        if got is not None:
            samples.setdefault("cpp_unpinned", []).append(got)
    out = {name: _summary(s) for name, s in samples.items() if name != "cpp_unpinned"}
    if "cpp_unpinned" in samples:  # one p50/p99 per flexkv-bench run: the median run's
        runs = sorted(samples["cpp_unpinned"], key=lambda r: r["p50_us"])
        out["cpp_unpinned"] = dict(runs[len(runs) // 2], runs=len(runs))
    return out


def _keys(iterations: int) -> dict:
    try:
        import numpy
    except ImportError:
        numpy = None
    rng = random.Random(20261204)
    out = {}
    for n in KEY_SIZES:
        tokens = [rng.randrange(128000) for _ in range(n)]
        its = max(20, iterations * 1024 // n // 20)
        row = {"list": _summary(_time(lambda: flexkvd.block_keys(NAMESPACE, tokens, 16), its, its // 10 + 1))}
        if numpy is not None:
            arr = numpy.array(tokens, dtype=numpy.int32)
            row["numpy"] = _summary(_time(lambda: flexkvd.block_keys(NAMESPACE, arr, 16), its, its // 10 + 1))
        raw = (ctypes.c_int32 * n)(*tokens)
        keys_out = (_lib.BlockKeyStruct * (n // 16))()
        count = ctypes.c_size_t(0)
        ns = NAMESPACE.encode()
        fn = _lib.lib.flexkv_compute_block_keys
        row["c"] = _summary(_time(lambda: fn(ns, len(ns), raw, n, 16, keys_out, n // 16, ctypes.byref(count)), its,
                                  its // 10 + 1))
        for v in row.values():
            v["keys_per_s"] = round(n // 16 / (v["p50_us"] / 1e6)) if v["p50_us"] > 0 else 0
        out[str(n)] = row
    return out


def _print(report: dict) -> None:
    print(f"flexkvd.bench {report['date']} on {report['machine']}: path {report['path']}")
    rt = report["round_trip"]
    print(f"\nMatch round trip, 4 keys, all hit (us), {report['rounds']} rounds      p50      p99")
    rows = [("Python  match().wait()", "python_unpinned"), ("C loop  match+wait (same session)", "c_unpinned"),
            ("C++     flexkv-bench ring --clients 1", "cpp_unpinned"),
            ("Python  match(pin).wait(); release().wait()", "python_pinned_release"),
            ("C loop  match(pin)+wait+release+wait", "c_pinned_release")]
    for label, key in rows:
        v = rt.get(key)
        print(f"  {label:42s} " + (f"{v['p50_us']:7.2f}  {v['p99_us']:7.2f}" if v else "    n/a"))
    print("\nflexkv.block_keys, 16 tokens per block      p50 us      keys/s")
    for n, row in report["block_keys"].items():
        for kind, label in (("list", "Python list"), ("numpy", "NumPy int32"), ("c", "C call, ready int32")):
            v = row.get(kind)
            if v:
                print(f"  {int(n):6d} tokens, {label:21s}  {v['p50_us']:9.1f}  {v['keys_per_s']:11,d}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m flexkvd.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", help="a running flexkvd's socket (default: start a private one)")
    parser.add_argument("--iterations", type=int, default=10000,
                        help="round trips per figure and round (default 10000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, every figure once per round (default 3)")
    parser.add_argument("--no-cpp", action="store_true", help="skip flexkv-bench (the C++ client's figure)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.rounds < 1:
        parser.error("--iterations and --rounds must be >= 1")
    daemon = None
    socket = args.socket
    if socket is None:
        binary = _beside_library("flexkvd", "FLEXKVD")
        if not binary:
            parser.error("no flexkvd found ($FLEXKVD, beside libflexkv, PATH); pass --socket")
        daemon = _PrivateDaemon(binary)
        socket = daemon.socket
    try:
        report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "machine": f"{os.uname().nodename}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
                  "path": f"extension {flexkvd.fast_path}" if flexkvd.fast_path else
                          f"ctypes ({_native.reason})",
                  "python": sys.version.split()[0], "rounds": args.rounds}
        bench = None if args.no_cpp else _beside_library("flexkv-bench", "FLEXKV_BENCH")
        with flexkvd.connect(socket) as client:
            client.attach("flexkv-bench-python", NAMESPACE, GEOMETRY)
            report["round_trip"] = _round_trips(client, args.iterations, args.rounds,
                                                lambda: _cpp_ring(bench, socket, args.iterations))
        report["block_keys"] = _keys(args.iterations)
    finally:
        if daemon is not None:
            daemon.stop()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
