"""Finds the optional compiled fast path (flexkvd._fast, python/flexkvd/_fast.c) and binds it to the libflexkv that
_lib loaded; the rest of the package calls `ext` when it is set and its ctypes path otherwise. The package's
__init__ calls load() once, after every module is imported (binding needs OpResult).

Where the extension is looked for, first hit wins (none is an error: the package works without it):
  0. FLEXKV_NO_EXTENSION=1 in the environment: not at all (the pure ctypes path, e.g. to compare the two);
  1. $FLEXKV_EXTENSION (a path to _fast*.so; if set and unusable, ImportError says why);
  2. beside the package: flexkvd/_fast<EXT_SUFFIX> (an install next to the .py files);
  3. beside the libflexkv that was loaded (build/_fast<EXT_SUFFIX> in a build tree).
Only an extension built for this interpreter's ABI tag (EXT_SUFFIX) and the package's C ABI version is used.

`path` is the file in use ("" for the ctypes path) and `reason` says why the ctypes path is in use. Both paths give
the same results and raise the same errors: the extension hands back None for anything it does not read itself,
and the ctypes path then runs.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sysconfig
from types import ModuleType
from typing import Optional, Tuple

from . import _lib

_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _candidates() -> list:
    here = os.path.dirname(os.path.abspath(__file__))
    found = [os.path.join(here, "_fast" + _SUFFIX)]
    # A library loaded by its bare soname (an installed libflexkv.so.0 found by the dynamic linker) has no
    # folder of its own: never look in the current directory for it (that would load whatever lies there).
    lib_dir = os.path.dirname(_lib.lib._name or "")
    if lib_dir:
        found.append(os.path.join(os.path.abspath(lib_dir), "_fast" + _SUFFIX))
    return found


def _bind(module: ModuleType) -> None:
    from ._ticket import _STATUS_CODES, OpResult  # late: _ticket imports this module

    def addr(name: str) -> int:
        return ctypes.cast(getattr(_lib.lib, name), ctypes.c_void_p).value or 0

    module.bind(_lib.ABI_VERSION, addr("flexkv_match"), addr("flexkv_prefetch"), addr("flexkv_release"),
                addr("flexkv_wait"), addr("flexkv_try_wait"), addr("flexkv_compute_block_keys"), OpResult,
                _STATUS_CODES)


def _load_file(path: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("flexkvd._fast", path)
    spec = importlib.util.spec_from_file_location("flexkvd._fast", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _find() -> Tuple[Optional[ModuleType], str, str]:
    """(module or None, its path, why not)."""
    if os.environ.get("FLEXKV_NO_EXTENSION", "") not in ("", "0"):
        return None, "", "FLEXKV_NO_EXTENSION is set"
    explicit = os.environ.get("FLEXKV_EXTENSION")
    paths = [explicit] if explicit else _candidates()
    tried = []
    for path in paths:
        if not os.path.exists(path):
            if explicit:
                raise ImportError(f"flexkv: FLEXKV_EXTENSION={explicit}: no such file")
            tried.append(f"{path} (no such file)")
            continue
        try:
            module = _load_file(path)
            if getattr(module, "ABI_VERSION", None) != _lib.ABI_VERSION:
                raise ImportError(f"built for C ABI version {getattr(module, 'ABI_VERSION', '?')}, the package "
                                  f"speaks {_lib.ABI_VERSION}")
            _bind(module)
            return module, path, ""
        except (ImportError, OSError) as e:
            if explicit:
                raise ImportError(f"flexkv: cannot use FLEXKV_EXTENSION={explicit}: {e}") from None
            tried.append(f"{path} ({e})")
    return None, "", "no usable extension: " + "; ".join(tried)


ext: Optional[ModuleType] = None
path = ""
reason = "not loaded yet"


def load() -> None:
    """Finds and binds the extension (see above); sets ext, path and reason."""
    global ext, path, reason
    ext, path, reason = _find()
