#!/usr/bin/env python3
"""Names at file scope that two sources of one target both define: an error in a unity build (CMake UNITY_BUILD,
FLEXKV_UNITY_BUILD) when the two land in one batch, or worse, a silent overload when their parameters differ. Reads
compile_commands.json of a configured build to know which sources make up which target; lists each name defined in
two or more of them, for the targets built in batches (functions, types and constants in a file's anonymous namespace or at file scope with
internal linkage). Exit 1 when any.   scripts/check_unity_names.py [BUILD_DIR]"""
import collections, json, os, re, sys

build = sys.argv[1] if len(sys.argv) > 1 else "build"
with open(os.path.join(build, "compile_commands.json")) as f:
    commands = json.load(f)

target_re = re.compile(r"CMakeFiles/([^/]+)\.dir/")
by_target = collections.defaultdict(set)
# The sources that share batches: read from the batch files (a source outside them, SKIP_UNITY_BUILD_INCLUSION, is a
# translation unit of its own and cannot collide).
for c in commands:
    m = target_re.search(c["command"])
    if m and "/Unity/" in c["file"]:
        for line in open(c["file"]):
            inc = re.match(r'#include "(.+)"', line)
            if inc:
                by_target[m.group(1)].add(os.path.realpath(inc.group(1)))

decl_res = [
    re.compile(r"^(?:struct|class|enum class|enum|union)\s+(\w+)\b(?!;)"),
    re.compile(r"^(?:static\s+)?(?:inline\s+)?(?:constexpr|const)\s+[\w:<>,\s\*&]+?\s(\w+)\s*(?:\[\w*\])?\s*[={]"),
    re.compile(r"^(?:static\s+|inline\s+|\[\[nodiscard\]\]\s+)*(?!return\b|else\b|case\b|namespace\b|using\b)"
               r"[\w:<>,\*&]+(?:\s*<[^;()]*>)?[\s\*&]+(\w+)\s*\([^;]*$"),
]

def file_scope_names(path):
    """Names a source defines in an anonymous namespace (brace depth of that namespace) or as static at file scope."""
    names = set()
    depth = 0
    anon_depths = []
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return names
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    for raw in text.splitlines():
        line = re.sub(r"//.*", "", raw)
        if re.match(r"^\s*#", line):
            continue
        stripped = line.strip()
        in_anon = bool(anon_depths) and depth == anon_depths[-1]
        at_file_scope = line[:1] not in (" ", "\t", "}", "") and depth <= (anon_depths[-1] if anon_depths else 99)
        if (in_anon and line[:1] not in (" ", "\t")) or (stripped.startswith("static ") and at_file_scope and depth == 0):
            for r in decl_res:
                m = r.match(stripped)
                if m and m.group(1) not in ("main", "operator"):
                    names.add(m.group(1))
                    break
        if re.match(r"^\s*namespace\s*\{", line):
            anon_depths.append(depth + 1)
        opened = line.count("{") - line.count("}")
        depth += opened
        while anon_depths and depth < anon_depths[-1]:
            anon_depths.pop()
    return names

problems = 0
for target, files in sorted(by_target.items()):
    where = collections.defaultdict(list)
    for f in sorted(files):
        for n in file_scope_names(f):
            where[n].append(os.path.relpath(f))
    for n, fs in sorted(where.items()):
        if len(fs) > 1:
            problems += 1
            print(f"{target}: {n}: {', '.join(fs)}")
if problems:
    print(f"check_unity_names: {problems} name(s) defined in more than one source of a target: give each a name of "
          "its own or move it to a shared header (CMakeLists.txt, FLEXKV_UNITY_BUILD)", file=sys.stderr)
sys.exit(1 if problems else 0)
