"""The example runs as a user would run it, against the test server."""

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "verify_layers.py")


def test_verify_layers_example_passes(server):
    run = subprocess.run([sys.executable, EXAMPLE, "--target", server, "--prompt-len", "70",
                          "--steps", "2", "--drafts", "8"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS: 2 steps x 3 layers" in run.stdout
    assert run.stdout.count(" ok") == 6
