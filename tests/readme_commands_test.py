#!/usr/bin/env python3
"""The README's shell examples run as written (CTest `readme_commands`).

From README.md, "Running it by hand": the CPU server line of the first `sh`
block is started as written, and every line of the "Calling it" block then
runs against it, in order, each of which must exit 0 (health SERVING, the
demo PASS, every load PASS). Only the two ports are changed, to free ones
(the README's 50051 and 9090 may be taken on the test machine), and
`build/` is the build tree under test. A README edit that breaks an example
(a load the server's pool cannot hold, a rate the server cannot answer, a
flag that is gone) fails here.

  readme_commands_test.py BUILD_DIR SOURCE_DIR
"""

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

from test_support import free_port


def shell_blocks(text):
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def commands(block):
    """The block's command lines, continuations joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.split("\n"):
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def main():
    build, source = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    text = open(os.path.join(source, "README.md")).read()
    section = text.split("## Running it by hand", 1)[1].split("\n## ", 1)[0]
    blocks = shell_blocks(section)
    server_line = next(c for b in blocks for c in commands(b) if "--backend cpu" in c)
    calling = section.split("Calling it:", 1)[1]
    calls = commands(shell_blocks(calling)[0])
    grpc_port, admin_port = free_port(), free_port()

    def localize(line):
        return line.replace("50051", str(grpc_port)).replace("9090", str(admin_port))

    with tempfile.TemporaryDirectory(prefix="mlaverify-readme-") as work:
        return run_in(work, build, server_line, calls, localize)


def run_in(work, build, server_line, calls, localize):
    os.symlink(build, os.path.join(work, "build"))
    server_cmd = localize(server_line)
    print(f"server: {server_cmd}", flush=True)
    log = open(os.path.join(work, "server.log"), "w")
    server = subprocess.Popen(shlex.split(server_cmd), cwd=work, stdout=log,
                              stderr=subprocess.STDOUT)
    failures = []
    try:
        health = localize(calls[0].split("=", 1)[1].strip('"')) + " health"
        deadline = time.time() + 180
        while subprocess.run(shlex.split(health), cwd=work, capture_output=True).returncode != 0:
            if server.poll() is not None or time.time() > deadline:
                print(open(os.path.join(work, "server.log")).read()[-3000:])
                print("FAIL: the README's CPU server did not start serving")
                return 1
            time.sleep(1)
        script = "set -o pipefail\n" + "\n".join(localize(c) for c in calls[:1])
        for line in calls[1:]:
            started = time.time()
            r = subprocess.run(["bash", "-c", script + "\n" + localize(line)], cwd=work,
                               capture_output=True, text=True, timeout=600)
            took = time.time() - started
            tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
            if r.returncode != 0:
                failures.append(line)
                print(f"FAIL ({r.returncode}, {took:.0f} s): {line}\n    " + "\n    ".join(tail),
                      flush=True)
            else:
                print(f"ok ({took:.0f} s): {line}", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if failures:
        print(f"{len(failures)} of {len(calls) - 1} README lines failed")
        return 1
    print(f"all {len(calls) - 1} README lines of 'Calling it' passed against its CPU server line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
