#!/usr/bin/env python3
"""Catch test names that ctest cannot register one by one.

catch_discover_tests hands CMake a list of test names separated by ';'. A name holding a ';' is split in two, and a
name holding an unbalanced '[' (e.g. "blocks [k, e)") stops CMake's list splitting until a ']' - every later name of
the binary then becomes part of one "test" that matches nothing and fails. Exit 1 naming each such test; 0 otherwise.
Usage: python3 scripts/check_test_names.py [repository root]
"""
import glob
import os
import re
import sys

CASE = re.compile(r'TEST_CASE\(((?:\s*"(?:[^"\\]|\\.)*")+)')
PART = re.compile(r'"((?:[^"\\]|\\.)*)"')


def balanced(name):
    depth = 0
    for ch in name:
        if ch == "[":
            depth += 1
        elif ch == "]":
            if depth == 0:
                return False
            depth -= 1
    return depth == 0


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    problems = []
    for path in sorted(glob.glob(os.path.join(root, "tests", "**", "*.cc"), recursive=True)):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for m in CASE.finditer(text):
            name = "".join(PART.findall(m.group(1)))
            line = text.count("\n", 0, m.start()) + 1
            where = f"{os.path.relpath(path, root)}:{line}"
            if ";" in name:
                problems.append(f"{where}: test name holds ';' (ctest splits it there): {name!r}")
            elif not balanced(name):
                problems.append(f"{where}: test name has an unbalanced '[' or ']' (it merges the names after it "
                                f"into one ctest test): {name!r}")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
