"""Loading libflexkv (python/flexkv/_lib.py): $FLEXKV_LIBRARY first, and a clear error when it is wrong."""
from __future__ import annotations

import os
import subprocess
import sys


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_flexkv_library_names_the_library_that_is_loaded():
    lib = os.environ["FLEXKV_LIBRARY"]
    out = run("import flexkv._lib as l; print(l.lib._name)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == lib


def test_a_wrong_flexkv_library_is_an_import_error_naming_it():
    out = run("import flexkv", FLEXKV_LIBRARY="/nonexistent/libflexkv.so.0")
    assert out.returncode != 0
    assert "ImportError" in out.stderr
    assert "/nonexistent/libflexkv.so.0 (no such file)" in out.stderr
    assert "FLEXKV_LIBRARY" in out.stderr


def test_the_library_next_to_the_package_is_found(tmp_path):
    """Installed layout: flexkv/ with libflexkv.so.0 beside it, no FLEXKV_LIBRARY."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("flexkv").__file__)))
    os.symlink(os.path.join(src, "flexkv"), tmp_path / "flexkv")
    os.symlink(os.path.realpath(os.environ["FLEXKV_LIBRARY"]), tmp_path / "libflexkv.so.0")
    env = {k: v for k, v in os.environ.items() if k not in ("FLEXKV_LIBRARY", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", "import flexkv, flexkv._lib as l; print(l.lib._name); "
                          "print(flexkv.block_keys('tiny', [7], 1).hex()[0])"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[1] == "5d7af4f593344df28c3ad9be7eb4acd7"
    assert lines[0] == str(tmp_path / "libflexkv.so.0")
