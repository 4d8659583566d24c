#!/usr/bin/env python3
"""A gRPC client in another language, generated from proto/flexkv/v1/control.proto alone, calls
GetStatus on a real flexkvd's unix socket and finds the status fields docs/operations.md lists."""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

CONTRACT_FIELDS = ["state", "version", "pid", "uptime_s", "pool", "index", "sessions", "counters", "backends"]
POOL_FIELDS = ["block_bytes", "capacity_blocks", "used_blocks", "pinned_blocks", "backing"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flexkvd", required=True)
    ap.add_argument("--proto-root", required=True)
    args = ap.parse_args()
    try:
        import grpc  # noqa: F401
    except ImportError:
        print("FAIL: python3-grpcio is not installed (scripts/test.sh installs it)")
        return 1
    plugin = shutil.which("grpc_python_plugin")
    if plugin is None:
        print("FAIL: grpc_python_plugin not found (package protobuf-compiler-grpc)")
        return 1
    work = tempfile.mkdtemp(prefix="flexkv-interop-")
    os.chmod(work, 0o755)
    gen = os.path.join(work, "gen")
    os.makedirs(gen)
    subprocess.run(["protoc", f"--proto_path={args.proto_root}", f"--python_out={gen}", f"--grpc_out={gen}",
                    f"--plugin=protoc-gen-grpc={plugin}", "flexkv/v1/control.proto"], check=True)
    sys.path.insert(0, gen)
    import grpc
    from flexkv.v1 import control_pb2, control_pb2_grpc

    sock = os.path.join(work, "flexkvd.sock")
    daemon = subprocess.Popen([args.flexkvd, "--socket", sock, "--pool-size", "64MiB",
                               "--pool-path", os.path.join(work, "pool")], stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 10
        while not os.path.exists(sock) and time.time() < deadline:
            time.sleep(0.02)
        channel = grpc.insecure_channel("unix:" + sock)
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = control_pb2_grpc.ControlStub(channel)
        status = stub.GetStatus(control_pb2.GetStatusRequest(), timeout=10)
        failures = []
        for field in CONTRACT_FIELDS:
            if field not in control_pb2.GetStatusResponse.DESCRIPTOR.fields_by_name:
                failures.append(f"GetStatusResponse lacks {field}")
        for field in POOL_FIELDS:
            if field not in control_pb2.PoolStatus.DESCRIPTOR.fields_by_name:
                failures.append(f"PoolStatus lacks {field}")
        if status.state != "serving":
            failures.append(f"state is {status.state!r}; expected 'serving'")
        if status.pid != daemon.pid:
            failures.append(f"pid is {status.pid}; expected {daemon.pid}")
        if status.pool.budget_bytes != 64 << 20:
            failures.append(f"pool.budget_bytes is {status.pool.budget_bytes}; expected {64 << 20}")
        if not any(b.name == "host" for b in status.backends):
            failures.append("backends lacks host")
        if not status.counters.HasField("errors"):
            failures.append("counters.errors is absent")
        # A bad request gets INVALID_ARGUMENT naming the field.
        bad = control_pb2.AttachRequest(model_namespace="m", protocol_version=1,
                                        geometry=control_pb2.Geometry(tokens_per_block=16, num_layers=0, kv_planes=2,
                                                                      kv_heads_per_rank=8, head_dim=128,
                                                                      dtype_bytes=2, tp_size=1))
        try:
            stub.Attach(bad, timeout=10)
            failures.append("Attach with num_layers=0 succeeded")
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT or "num_layers" not in e.details():
                failures.append(f"Attach with num_layers=0: {e.code()} {e.details()!r}")
        for f in failures:
            print("FAIL:", f)
        print(f"GetStatus over unix:{sock}: state={status.state} version={status.version} pid={status.pid}")
        print(f"{len(CONTRACT_FIELDS) + len(POOL_FIELDS) + 6 - len(failures)} passed, {len(failures)} failed")
    finally:
        daemon.terminate()
        _, daemon_stderr = daemon.communicate(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    # Sanitizer builds: a report in the daemon's stderr fails the test.
    if b"Sanitizer:" in daemon_stderr:
        sys.stderr.write(daemon_stderr.decode(errors="replace"))
        failures.append("sanitizer report in flexkvd's stderr")
        print("FAIL:", failures[-1])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
