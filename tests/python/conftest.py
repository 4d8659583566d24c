"""pytest fixtures for the flexkvd package: a private flexkvd per test, as tests/support/process.cc starts one.

The daemon listens on a socket in a fresh temporary directory and keeps its pool in a uniquely named directory
under /dev/shm with a small --pool-size; it is always stopped (SIGTERM, then SIGKILL) and both directories are
removed, whatever the test did to it (SIGSTOP included).

Paths come from the environment that tests/CMakeLists.txt sets, with build-tree defaults for a manual run
(`python3 -m pytest tests/python` from the repository root after building):
  FLEXKV_LIBRARY  libflexkv.so.0 (default build/libflexkv.so.0)
  FLEXKVD         the daemon (default build/flexkvd)
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator, List, Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Absolute, so that child processes started in another directory load the same library.
os.environ["FLEXKV_LIBRARY"] = os.path.abspath(os.environ.get("FLEXKV_LIBRARY") or
                                               os.path.join(REPO, "build", "libflexkv.so.0"))
FLEXKVD = os.path.abspath(os.environ.get("FLEXKVD") or os.path.join(REPO, "build", "flexkvd"))
if os.path.join(REPO, "python") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "python"))
# Child Python processes (engines, examples) find the package and the library the same way.
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "python")] +
                                           [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")

import flexkvd  # noqa: E402

from engine_process import TEST_GEOMETRY, TEST_NAMESPACE  # noqa: E402


class Daemon:
    """A flexkvd in a private directory. stop() is idempotent; signal() sends to the daemon only."""

    def __init__(self, extra_args: Optional[List[str]] = None, pool_size: str = "64MiB") -> None:
        self.dir = tempfile.mkdtemp(prefix="flexkv-pytest-")
        os.chmod(self.dir, 0o755)
        self.socket = os.path.join(self.dir, "flexkvd.sock")
        self.pool_dir = f"/dev/shm/flexkv-pytest-{os.getpid()}-{secrets.token_hex(4)}"
        self.stderr_path = os.path.join(self.dir, "flexkvd.stderr")
        argv = [FLEXKVD, "--socket", self.socket, "--pool-path", os.path.join(self.pool_dir, "pool"),
                "--pool-size", pool_size] + list(extra_args or [])
        self.argv = argv
        self._stderr = open(self.stderr_path, "wb")
        self._start()

    def _start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=self._stderr)
        self.pid = self.process.pid

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flexkvd exited with {self.process.returncode}:\n{self.stderr()}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(self.socket)
                    return
                except OSError:
                    pass
            time.sleep(0.01)
        raise RuntimeError(f"flexkvd not ready after {timeout} s:\n{self.stderr()}")

    def kill(self) -> None:
        """SIGKILL, returning once the daemon is gone (its sockets closed: clients see their sessions lost)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def restart(self) -> None:
        """A crash and a restart: kill(), then a new flexkvd on the same socket and pool; returns once it accepts."""
        self.kill()
        self._start()
        self.wait_ready()

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, sig)

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP, returning once every thread of the daemon is stopped (kill() only queues the signal; a
        thread running on another core would still serve a request submitted right after it)."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for task in os.listdir(f"/proc/{self.pid}/task"):
                try:
                    with open(f"/proc/{self.pid}/task/{task}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:
                    pass
            if states and all(s in ("T", "t") for s in states):
                return
            time.sleep(0.001)
        raise RuntimeError("flexkvd did not stop after SIGSTOP")

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def stderr(self) -> str:
        with open(self.stderr_path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.send_signal(signal.SIGCONT)  # a test may have left it stopped
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.pool_dir, ignore_errors=True)


def settled_status(observer: "flexkvd.Client", timeout: float = 2.0) -> "flexkvd.DaemonStatus":
    """The daemon's status once no session is left. An engine process that exits without detaching is noticed
    by the daemon when its session channel closes: a few ms after the process is gone, not before."""
    deadline = time.monotonic() + timeout
    s = observer.status()
    while s.sessions and time.monotonic() < deadline:
        time.sleep(0.005)
        s = observer.status()
    return s


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    """A running private flexkvd, stopped after the test."""
    d = Daemon()
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


@pytest.fixture
def make_daemon() -> Iterator:
    """Starts daemons with extra flags: make_daemon(["--flag", ...], pool_size="1MiB"); all stopped after the test."""
    started: List[Daemon] = []

    def make(extra_args: Optional[List[str]] = None, pool_size: str = "64MiB") -> Daemon:
        d = Daemon(extra_args, pool_size)
        started.append(d)
        d.wait_ready()
        return d

    try:
        yield make
    finally:
        for d in started:
            d.stop()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[flexkvd.Client]:
    """A Client of the private daemon, attached with the small test geometry (16 KiB blocks)."""
    with flexkvd.connect(daemon.socket) as c:
        c.attach("pytest", TEST_NAMESPACE, TEST_GEOMETRY)
        yield c


@pytest.fixture
def observer(daemon: Daemon) -> Iterator[flexkvd.Client]:
    """A Client of the private daemon that never attaches: for status() while others work."""
    with flexkvd.connect(daemon.socket) as c:
        yield c
