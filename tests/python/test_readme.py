"""README.md's Python example works as written: the code block of "## In an engine (Python" runs unchanged
against a private daemon ($FLEXKV_SOCKET), twice: the second run finds what the first stored."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO, settled_status


def readme_python_example() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## In an engine (Python", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README.md has no python code block in its Python section"
    return m.group(1)


def test_readme_example_is_short():
    lines = [l for l in readme_python_example().splitlines() if l.strip() and not l.strip().startswith("#")]
    assert len(lines) <= 12, lines


def test_readme_example_runs_as_written(daemon, observer):
    code = readme_python_example()
    env = {**os.environ, "FLEXKV_SOCKET": daemon.socket}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "0 of 6 blocks were cached"
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "6 of 6 blocks were cached"
    s = settled_status(observer)
    assert (s.index_blocks, s.pinned_blocks, s.sessions) == (6, 0, 0)
