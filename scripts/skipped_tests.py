#!/usr/bin/env python3
"""Lists the tests of a ctest run that skipped themselves, with the reasons each printed: ctest's own skips
(SKIP_RETURN_CODE: listed in LastTestsDisabled.log, while LastTest.log says "Test Passed."), Catch2 warnings that
say they skipped (WARN("no GPU visible; skipped"), "skipped: ..."), pytest's -rs lines ("SKIPPED [n] file:line:
why") and the scripts' "SKIP ..." / "skipped: ..." lines. Reads <build>/Testing/Temporary/ (the last ctest run in
that directory); prints one line per skipped test.

    scripts/skipped_tests.py [--ci] BUILD_DIR [LABEL]

--ci: exits 1 when a test skipped for any reason but the missing GPU (a CI machine has none; the GPU work is
checked on the device machine with scripts/device_*.sh), after listing each such test as "not run in CI".
Exits 2 when BUILD_DIR has no ctest log (nothing to say what ran)."""
import os
import re
import sys

# What CI may legitimately lack: a GPU, and with it CUDA-enabled torch.
CI_MAY_LACK = re.compile(r"\bGPU\b|\bCUDA\b|\btorch\b")
SKIP_WORD = re.compile(r"\bskip(ped|ping|s)?\b", re.I)


def reasons_of(output):
    """The skip reasons one test printed (in order, without repeats)."""
    found = []
    lines = output.splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        reason = None
        if text == "warning:" or text.endswith(": warning:"):
            # Catch2: the message follows, indented, up to a blank line.
            message = []
            for follow in lines[i + 1:]:
                if not follow.strip():
                    break
                message.append(follow.strip())
            if SKIP_WORD.search(" ".join(message)):
                reason = " ".join(message)
        elif re.match(r"SKIPPED \[\d+\] ", text):  # pytest -rs
            reason = text
        elif re.match(r"SKIP\b|skipped:", text, re.I):  # the scripts' own ("SKIP: systemd-analyze not available")
            reason = text
        if reason and reason not in found:
            found.append(reason)
    return found


def main(argv):
    ci = "--ci" in argv
    args = [a for a in argv if a != "--ci"]
    if not args:
        sys.exit(__doc__)
    build = args[0]
    label = args[1] if len(args) > 1 else os.path.basename(build.rstrip("/"))
    path = os.path.join(build, "Testing", "Temporary", "LastTest.log")
    if not os.path.exists(path):
        print(f"  {label}: no ctest log at {path}: cannot tell which tests skipped")
        return 2
    text = open(path, errors="replace").read()
    # "<test number>:<name>" of each test that did not run (ctest's skips; disabled tests, which the project has none
    # of, would be listed here too).
    not_run = set()
    disabled = os.path.join(build, "Testing", "Temporary", "LastTestsDisabled.log")
    if os.path.exists(disabled):
        not_run = {line.split(":", 1)[1].strip() for line in open(disabled, errors="replace") if ":" in line}
    not_in_ci = 0
    for block in re.split(r"\n(?=\d+/\d+ Testing: )", text):
        head = re.match(r"\d+/\d+ Testing: (.+)", block)
        if not head:
            continue
        name = head.group(1).strip()
        output = block.split("Output:", 1)[-1].split("<end of output>", 1)[0]
        reasons = reasons_of(output)
        if name in not_run and not reasons:
            reasons = ["skipped (ctest: SKIP_RETURN_CODE; the test printed no reason)"]
        if not reasons:
            continue
        reason = "; ".join(reasons)
        mark = ""
        if ci and not all(CI_MAY_LACK.search(r) for r in reasons):
            mark = "NOT RUN IN CI: "
            not_in_ci += 1
        print(f"  {label}: {mark}{name}: {reason[:300]}")
    if not_in_ci:
        print(f"  {label}: {not_in_ci} test(s) skipped in CI for a reason other than the missing GPU (above): "
              "CI must run them; give the CI machine what they need")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
