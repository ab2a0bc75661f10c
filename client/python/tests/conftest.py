"""A real CPU server for the tests: MLAVERIFY_SERVER names the binary (CTest
passes build/server/mlaverify-server). Small geometry: 3 layers, 4 heads,
page 16, drafts up to 8 per item, 4 items per Verify. start_server(backend="cuda")
serves the same geometry from a server built with CUDA (the GPU tests)."""

import os
import subprocess
import tempfile
import time

import pytest

from mlaverify import VerifyClient

SERVER_FLAGS = ["--backend", "cpu", "--layers", "3", "--heads", "4", "--page-size", "16",
                "--pool-bytes", "8MiB", "--draft-buckets", "1", "2", "4", "8",
                "--batch-buckets", "1", "2", "4", "--max-message-bytes", "1MiB",
                "--drain-grace-s", "0", "--drain-timeout-s", "2", "--log-level", "warn",
                "--allow-client-shm", "true"]


def start_server(extra=(), backend="cpu", listen="127.0.0.1:0"):
    binary = os.environ.get("MLAVERIFY_SERVER")
    if not binary or not os.path.exists(binary):
        pytest.fail("MLAVERIFY_SERVER must name the built mlaverify-server (CTest sets it)")
    tmp = tempfile.mkdtemp(prefix="mlaverify-pytest-")
    port_file = os.path.join(tmp, "ports")
    log = open(os.path.join(tmp, "server.log"), "w")
    proc = subprocess.Popen([binary, "--listen", listen, "--admin-port", "-1",
                             "--port-file", port_file,
                             *[backend if f == "cpu" else f for f in SERVER_FLAGS], *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
        if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
            break
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {open(log.name).read()}")
        time.sleep(0.05)
    grpc_port = open(port_file).read().split()[0]
    return proc, f"127.0.0.1:{grpc_port}", log.name


def stop_server(proc):
    proc.terminate()
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="session")
def server():
    proc, target, log = start_server()
    yield target
    assert stop_server(proc) == 0, open(log).read()


@pytest.fixture
def client(server):
    with VerifyClient(server, timeout=30) as c:
        yield c
