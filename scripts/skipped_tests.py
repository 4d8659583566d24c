#!/usr/bin/env python3
"""Lists the tests of a ctest run that skipped themselves, with the reason each printed: ctest's own skips
(SKIP_RETURN_CODE, "Test Skipped") and tests that passed after saying they skipped ("...; skipped", "skipped: ...",
"SKIP ..."; the GPU tests without a GPU, the network-namespace tests without the rights to make one). Reads
<build>/Testing/Temporary/LastTest.log; prints one line per skipped test.
    scripts/skipped_tests.py BUILD_DIR [LABEL]"""
import os, re, sys

build = sys.argv[1]
label = sys.argv[2] if len(sys.argv) > 2 else os.path.basename(build.rstrip("/"))
path = os.path.join(build, "Testing", "Temporary", "LastTest.log")
if not os.path.exists(path):
    sys.exit(0)
text = open(path, errors="replace").read()
# What the tests print when they skip: Catch2 WARNs ending "; skipped", pytest's "SKIPPED [n] file:line: why",
# "skipped: why", and the scripts' "SKIP ...". (Not any log line with the word: "skipped key ..." is a daemon log.)
skip_line = re.compile(r"(;\s*skipped\b|^\s*SKIPPED\b|\bskipped:|^\s*SKIP\b)", re.I)
for block in re.split(r"\n(?=\d+/\d+ Testing: )", text):
    head = re.match(r"\d+/\d+ Testing: (.+)", block)
    if not head:
        continue
    name = head.group(1).strip()
    out = block.split("Output:", 1)[-1].split("<end of output>", 1)[0]
    reasons = []
    for line in out.splitlines():
        if skip_line.search(line) and not re.search(r"\b0 skipped\b|skipped 0\b", line):
            reasons.append(line.strip())
    if "Test Skipped" in block or reasons:
        reason = reasons[0] if reasons else "skipped (ctest)"
        print(f"  {label}: {name}: {reason[:200]}")
