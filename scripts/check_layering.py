#!/usr/bin/env python3
"""The build's layering: which folder's code may include which folder's headers.

Run by the build (the flexkv_layering target, which flexkvd_lib and libflexkv depend on) and usable alone:
`python3 scripts/check_layering.py [repository root]`. Exit 1, naming each file, line and include, when a source
file includes a header of a folder its own folder may not use; 0 otherwise. A folder may always include its own
headers and those of the folders above it in LAYERS' order of allowed dependencies below - never the other way,
so that a cache that starts knowing its tiers, or a client that starts including the daemon, fails the build.
"""
import os
import re
import sys

# folder -> the folders (prefixes) its code may include besides its own. Generated headers (flexkv/v1/*.pb.h, the
# etcd protos) and the public types in common/include/flexkv/ are everybody's.
ALLOWED = {
    "common": [],
    "client": ["common"],
    "daemon/lifecycle": ["common"],
    "daemon/sessions": ["common"],
    "daemon/metrics": ["common"],
    "daemon/cache": ["common"],
    "daemon/cluster": ["common", "daemon/cluster"],
    "daemon/transfer": ["common", "daemon/cache", "daemon/transfer"],
    "daemon/tiers": ["common", "daemon/cache", "daemon/cluster", "daemon/lifecycle", "daemon/metrics", "daemon/tiers"],
    "daemon/events": ["common", "daemon/cache", "daemon/tiers"],
    "daemon/config": ["common", "daemon/cache", "daemon/metrics", "daemon/sessions"],
    "daemon/dataplane": ["common", "daemon/cache", "daemon/lifecycle", "daemon/metrics", "daemon/sessions",
                         "daemon/tiers", "daemon/transfer"],
    "daemon/server": ["common", "daemon/cache", "daemon/config", "daemon/dataplane", "daemon/events",
                      "daemon/lifecycle", "daemon/metrics", "daemon/sessions", "daemon/tiers", "daemon/transfer"],
    "daemon": ["common", "daemon"],  # daemon.cc and main.cc put the parts together
}
PUBLIC = ("flexkv/v1/", "etcd/", "flexkv/block_key.h", "flexkv/geometry.h", "flexkv/status.h")
SOURCES = (".cc", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def folder_of(path):
    """The longest ALLOWED key the path lies in (daemon/cache/x.h -> daemon/cache; daemon/daemon.cc -> daemon)."""
    best = None
    for key in ALLOWED:
        if path == key or path.startswith(key + "/"):
            if best is None or len(key) > len(best):
                best = key
    return best


def header_folder(include, root):
    if include.startswith(PUBLIC):
        return None
    if include.startswith("flexkv/"):  # a public header of the client library
        return "client" if os.path.exists(os.path.join(root, "client/include", include)) else "common"
    return folder_of(include)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    root = os.path.abspath(root)
    problems = []
    for top in ("common", "client", "daemon"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.relpath(os.path.join(dirpath, name), root)
                own = folder_of(path)
                if own is None:
                    continue
                with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        target = header_folder(m.group(1), root)
                        if target is None or target == own or own.startswith(target + "/"):
                            continue
                        if any(target == a or target.startswith(a + "/") for a in ALLOWED[own]):
                            continue
                        problems.append(f"{path}:{number}: {own}/ may not include \"{m.group(1)}\" ({target}/); "
                                        f"it may use: {', '.join(ALLOWED[own]) or 'nothing outside itself'}")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_layering: {len(problems)} include(s) against the layering (scripts/check_layering.py says "
              "which folder may use which)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
