"""The README's client example runs as written against a real server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    """The first ```python block of README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no ```python block"
    return m.group(1)


def test_readme_example_runs(start_server, tmp_path):
    srv = start_server()
    code, n = re.subn(r'^ADDR = "[^"]*"', f'ADDR = "{srv.addr}"', readme_example(), count=1, flags=re.M)
    assert n == 1, 'the README example must set ADDR = "..." at the start of a line'
    script = tmp_path / "readme_example.py"
    script.write_text(code, encoding="utf-8")
    # sys.executable is the virtualenv's python under `make test`.
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"example exited {proc.returncode}:\n{proc.stderr}\nserver:\n{srv.logs()}"
    lines = proc.stdout.splitlines()
    assert lines and lines[0].startswith("200 "), proc.stdout
    assert all(line.startswith("200 ") for line in lines), proc.stdout
