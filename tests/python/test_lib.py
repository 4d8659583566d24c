"""Loading libflexkv (python/flexkvd/_lib.py): $FLEXKV_LIBRARY first, and a clear error when it is wrong."""
from __future__ import annotations

import os
import subprocess
import sys


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_flexkv_library_names_the_library_that_is_loaded():
    lib = os.environ["FLEXKV_LIBRARY"]
    out = run("import flexkvd._lib as l; print(l.lib._name)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == lib


def test_a_wrong_flexkv_library_is_an_import_error_naming_it():
    out = run("import flexkvd", FLEXKV_LIBRARY="/nonexistent/libflexkv.so.0")
    assert out.returncode != 0
    assert "ImportError" in out.stderr
    assert "/nonexistent/libflexkv.so.0 (no such file)" in out.stderr
    assert "FLEXKV_LIBRARY" in out.stderr


def test_the_library_next_to_the_package_is_found(tmp_path):
    """Installed layout: flexkv/ with libflexkv.so.0 beside it, no FLEXKV_LIBRARY."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("flexkvd").__file__)))
    os.symlink(os.path.join(src, "flexkvd"), tmp_path / "flexkvd")
    os.symlink(os.path.realpath(os.environ["FLEXKV_LIBRARY"]), tmp_path / "libflexkv.so.0")
    env = {k: v for k, v in os.environ.items() if k not in ("FLEXKV_LIBRARY", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", "import flexkvd, flexkvd._lib as l; print(l.lib._name); "
                          "print(flexkvd.block_keys('tiny', [7], 1).hex()[0])"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[1] == "5d7af4f593344df28c3ad9be7eb4acd7"
    assert lines[0] == str(tmp_path / "libflexkv.so.0")


# ---- the C ABI check at import: a libflexkv of another ABI is refused, saying what differs ----

# Loads the package with ctypes.CDLL replaced by a subclass whose `name` function answers `value` instead of the
# library's: a libflexkv of another build, as the package would see it.
_FAKE_LIBRARY = """
import ctypes, sys
real_cdll = ctypes.CDLL
class OtherBuild(real_cdll):
    def __getattr__(self, name):
        if name == {name!r}:
            value = {value!r}
            if value is None:
                raise AttributeError(name)
            if name == "flexkv_abi_version":
                fn = ctypes.CFUNCTYPE(ctypes.c_uint32)(lambda: value)
            else:
                fn = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_char_p)(lambda struct_name: value)
            self.__dict__[name] = fn
            return fn
        return super().__getattr__(name)
ctypes.CDLL = OtherBuild
try:
    import flexkvd
except ImportError as e:
    print("REFUSED", e)
    sys.exit(0)
print("LOADED")
"""


def test_a_library_of_another_abi_version_is_refused_at_import():
    out = run(_FAKE_LIBRARY.format(name="flexkv_abi_version", value=5))  # the version before layer events
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED"), out.stdout
    assert "speaks C ABI version 5; this package speaks version 6" in out.stdout
    assert os.environ["FLEXKV_LIBRARY"] in out.stdout and "FLEXKV_LIBRARY" in out.stdout


def test_a_library_whose_struct_sizes_differ_is_refused_at_import():
    out = run(_FAKE_LIBRARY.format(name="flexkv_struct_size", value=8))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED"), out.stdout
    assert "struct flexkv_geometry is 8 bytes in" in out.stdout and "but 40 bytes in this package" in out.stdout


def test_a_library_without_abi_version_is_refused_at_import():
    out = run(_FAKE_LIBRARY.format(name="flexkv_abi_version", value=None))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED"), out.stdout
    assert "has no flexkv_abi_version()" in out.stdout


def test_verify_abi_accepts_the_library_it_was_built_with():
    from flexkvd import _lib
    _lib.verify_abi(_lib.lib, _lib.lib._name)  # what the import did
    assert _lib.lib.flexkv_abi_version() == _lib.ABI_VERSION


def test_the_version_is_the_project_version_written_once_in_cmake():
    import re
    import flexkvd
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "CMakeLists.txt")) as f:
        project = re.search(r"project\(flexkv VERSION (\S+)", f.read()).group(1)
    assert flexkvd.__version__ == project
    for path in ("python/flexkvd/__init__.py", "common/version.h"):  # no second copy of it
        with open(os.path.join(repo, path)) as f:
            assert f'"{project}"' not in f.read(), path
