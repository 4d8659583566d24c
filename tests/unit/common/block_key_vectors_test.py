#!/usr/bin/python3
"""Recomputes the block-key test vectors in docs/protocol.md ("## Block keys") with Python's xxhash.

Usage: block_key_vectors_test.py [path/to/docs/protocol.md]

This is an implementation of the construction independent of common/block_key.cc, so it checks that the
documented vectors follow the documented construction (the C++ unit test checks the C++ code against the
same vectors). Exit status 0 when every vector matches, 1 otherwise.
"""

import os
import re
import struct
import sys

MASK64 = (1 << 64) - 1


def block_keys(xxhash, namespace, tokens, tokens_per_block):
    """key[i] = XXH3_128(seed=XXH3_64(ns), key[i-1] lo64 LE || hi64 LE || block i as int32 LE)."""
    if tokens_per_block <= 0:
        return []
    seed = xxhash.xxh3_64_intdigest(namespace.encode("utf-8"), seed=0)
    prev = 0
    keys = []
    for b in range(len(tokens) // tokens_per_block):
        block = tokens[b * tokens_per_block:(b + 1) * tokens_per_block]
        data = struct.pack("<QQ", prev & MASK64, prev >> 64) + struct.pack("<%di" % len(block), *block)
        prev = xxhash.xxh3_128_intdigest(data, seed=seed)
        keys.append("%032x" % prev)
    return keys


def parse_tokens(text):
    """'0..31, 1000..1015, -1' -> list of ints (ranges inclusive)."""
    tokens = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"(-?\d+)\s*\.\.\s*(-?\d+)", item)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise ValueError("empty range %r" % item)
            tokens.extend(range(lo, hi + 1))
        else:
            tokens.append(int(item))
    for t in tokens:
        if not -(1 << 31) <= t < (1 << 31):
            raise ValueError("token %d is not an int32" % t)
    return tokens


def unquote(cell):
    cell = cell.strip()
    if len(cell) >= 2 and cell.startswith("`") and cell.endswith("`"):
        return cell[1:-1]
    return cell


def split_row(line):
    line = line.strip()
    if not (line.startswith("|") and line.endswith("|")):
        return None
    return [c.strip() for c in line[1:-1].split("|")]


def parse_vectors(doc_text):
    """Returns [(label, namespace, tokens_per_block, tokens, [hex keys])] from the Block keys section."""
    m = re.search(r"^## Block keys[ \t]*$", doc_text, re.MULTILINE)
    if not m:
        raise ValueError("no '## Block keys' section")
    section = doc_text[m.end():]
    nxt = re.search(r"^## ", section, re.MULTILINE)  # next top-level section, if any
    if nxt:
        section = section[:nxt.start()]

    lines = section.splitlines()
    header_at = None
    for i, line in enumerate(lines):
        cells = split_row(line)
        if cells and [c.lower() for c in cells[1:]] == ["namespace", "tokens_per_block", "tokens", "keys"]:
            header_at = i
            break
    if header_at is None:
        raise ValueError("no '| # | namespace | tokens_per_block | tokens | keys |' table")

    vectors = []
    for line in lines[header_at + 2:]:  # skip the |---| row
        cells = split_row(line)
        if cells is None:
            break  # end of table
        if len(cells) != 5:
            raise ValueError("row has %d cells, want 5: %s" % (len(cells), line))
        label, ns, tpb, toks, keys = cells
        keys_hex = re.findall(r"[0-9a-f]{32}", keys)
        leftover = re.sub(r"`?[0-9a-f]{32}`?|<br\s*/?>|[\s,]", "", keys)
        if leftover:
            raise ValueError("vector %s: cannot parse keys cell: %r" % (label, keys))
        vectors.append((label, unquote(ns), int(tpb), parse_tokens(unquote(toks)), keys_hex))
    if not vectors:
        raise ValueError("the test-vector table is empty")
    return vectors


def main(argv):
    if len(argv) > 1:
        doc_path = argv[1]
    else:
        doc_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "docs", "protocol.md")
    try:
        import xxhash
    except ImportError as e:
        print("FAIL: cannot import the Python xxhash module (%s); install python3-xxhash" % e)
        return 1
    if not hasattr(xxhash, "xxh3_128_intdigest"):
        print("FAIL: Python xxhash %s has no xxh3_128_intdigest (need xxhash >= 2.0)"
              % getattr(xxhash, "VERSION", "?"))
        return 1

    try:
        with open(doc_path, encoding="utf-8") as f:
            vectors = parse_vectors(f.read())
    except (OSError, ValueError) as e:
        print("FAIL: %s: %s" % (doc_path, e))
        return 1

    passed = failed = 0
    for label, ns, tpb, tokens, want in vectors:
        got = block_keys(xxhash, ns, tokens, tpb)
        if got == want:
            passed += 1
            continue
        failed += 1
        print("FAIL vector %s (namespace %r, tokens_per_block %d, %d tokens):" % (label, ns, tpb, len(tokens)))
        for i in range(max(len(got), len(want))):
            g = got[i] if i < len(got) else "(none)"
            w = want[i] if i < len(want) else "(none)"
            print("  key[%d] doc %s computed %s%s" % (i, w, g, "" if g == w else "  <-- differs"))
    print("%d passed, %d failed" % (passed, failed))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
