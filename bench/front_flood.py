#!/usr/bin/env python3
"""The Rapid Reset flood of tests/abuse_test.py for 8 s through a candidate
HTTP/2 front, or straight at the server, reconnecting whenever the
flooding connection is closed; a legitimate GetServerInfo every 0.25 s
through the same port meanwhile. Prints the streams sent, the server's and
the front's peak RSS, and the legitimate calls served.

  bench/front_flood.py BUILD_DIR {direct,nghttpx,haproxy}

nghttpx runs deploy/http2-front/nghttpx.conf (frontend and backend
replaced); haproxy 2.6 a minimal h2 front (the config below), the other
candidate the exposure mode was chosen against (docs/operations.md).
"""

import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
build, kind = sys.argv[1], sys.argv[2]
sys.argv = [sys.argv[0], os.path.join(build, "server", "mlaverify-server"),
            os.path.join(build, "client", "python")]
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import abuse_test as A  # noqa: E402

HAPROXY = """global
  maxconn 4096
defaults
  mode http
  timeout connect 5s
  timeout client 1h
  timeout server 1h
frontend grpc
  bind 127.0.0.1:{front} proto h2
  default_backend mlaverify
backend mlaverify
  server s1 127.0.0.1:{backend} proto h2
"""

server = A.Server()
front = None
if kind == "nghttpx":
    front = A.Front(server)
    port = front.port
elif kind == "haproxy":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = os.path.join(tempfile.mkdtemp(), "haproxy.cfg")
    open(conf, "w").write(HAPROXY.format(front=port, backend=server.port))
    proc = subprocess.Popen(["haproxy", "-f", conf], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    A.servers.append(proc)

    class Haproxy:
        def rss_mib(self):
            for line in open(f"/proc/{proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    front = Haproxy()
    time.sleep(1.0)
else:
    port = server.port
server_watch = A.RssWatch(server)
front_watch = A.RssWatch(front) if front else None
stop, legit = False, []


def probe():
    while not stop:
        t0 = time.time()
        try:
            status = A.unary(port, "GetServerInfo", b"", timeout=5.0)[0]
        except OSError as e:
            status = str(e)
        legit.append((status, time.time() - t0))
        time.sleep(0.25)


threading.Thread(target=probe, daemon=True).start()
sent, connections = A.reset_flood(port, 8.0, reconnect=True)
stop = True
time.sleep(0.3)
server_peak = server_watch.stop()
front_base, front_peak = (front_watch.base, front_watch.stop()) if front_watch else (0.0, 0.0)
served = sum(1 for s, _ in legit if s == 0)
print(f"{kind}: {sent} streams reset over {connections} connections in 8 s; server RSS "
      f"{server_watch.base:.0f} -> {server_peak:.0f} MiB; front RSS {front_base:.0f} -> "
      f"{front_peak:.0f} MiB; legitimate calls served {served} of {len(legit)}, slowest "
      f"{max(t for _, t in legit):.2f} s")
for p in A.servers:
    p.kill()
