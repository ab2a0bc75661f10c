"""The Python snippet of the top-level README.md works as written."""

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")


def test_readme_snippet_runs(server):
    text = open(README).read()
    match = re.search(r"<!-- python-snippet -->\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its python-snippet block"
    code = match.group(1).replace("127.0.0.1:50051", server)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "(4, 4, 512) (4, 4) 100"
