#!/usr/bin/env python3
"""The server against clients that break the rules: it must stay up, keep
its probes answering and, where the server can bound it, its memory under a
stated bound.

  abuse_test.py SERVER_BINARY PYTHON_PACKAGE_DIR [CASE ...]

Cases (all by default), each against a fresh CPU server:
  rapid_reset     one HTTP/2 connection opens streams and resets them at once,
                  as fast as it can (the Rapid Reset pattern, CVE-2023-44487)
  unread_calls    one connection sends complete unary calls and never reads
  unread_streams  VerifyStreams that never read their answers: the answers
                  they hold count against --max-queued-bytes, streams past
                  --max-streams are refused, memory stays bounded
  slow_admin      256 connections from four addresses to the admin port that
                  send a request a byte every 2 s (slowloris) while /healthz,
                  /readyz and /metrics are asked from a fifth
  undecodable     requests whose bytes do not parse: INVALID_ARGUMENT, counted;
                  on a VerifyStream in band, and the stream goes on
  compression_bomb  gzip messages that inflate to 1 GiB each, without a token:
                  refused before they inflate
  tokenless_streams  VerifyStreams without the token: refused at open, the
                  scheduler's stream served
  rapid_reset_front, unread_calls_front  the two floods through the HTTP/2
                  front (deploy/http2-front, nghttpx): memory bounded and a
                  legitimate Verify served during the flood

The first two are gRPC 1.51's own residual risk (docs/operations.md,
"Security model"): their memory growth is printed, not asserted.
Raw HTTP/2 frames (python3-h2's hyperframe and hpack) let a case do what a
well-behaved gRPC client never does. Memory is the server's resident set
(VmRSS) sampled while the abuse runs.
Exit 77 (skipped) without hyperframe/hpack, grpc or the generated stubs.
"""

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib

try:
    import hpack
    from hyperframe.frame import (DataFrame, Frame, HeadersFrame, RstStreamFrame, SettingsFrame,
                                  WindowUpdateFrame)
except ImportError:
    print("SKIPPED: python3 lacks hyperframe/hpack (Debian's python3-h2; scripts/install_deps.sh installs it)")
    sys.exit(77)

SERVER = sys.argv[1]
sys.path.insert(0, sys.argv[2])
try:
    import grpc  # noqa: E402,F401
    from mlaverify.v1 import verify_pb2  # noqa: E402
except ImportError as e:
    print(f"SKIPPED: no python3-grpcio or no generated Python stubs under {sys.argv[2]} ({e})")
    sys.exit(77)

import numpy as np  # noqa: E402

SERVICE = "/mlaverify.v1.VerifyService/"
HEADS = 16
LATENT = 576
VALUE = 512
failures = []
servers = []  # every server started, so that a case that fails midway leaves none running


def check(condition, message):
    print(("ok   " if condition else "FAIL ") + message, flush=True)
    if not condition:
        failures.append(message)


class Server:
    """A CPU server on loopback ports; `flags` are added to a small geometry."""

    def __init__(self, *flags, listen="127.0.0.1:0"):
        self.tmp = tempfile.mkdtemp(prefix="mlaverify-abuse-")
        port_file = os.path.join(self.tmp, "ports")
        self.log_path = os.path.join(self.tmp, "server.log")
        self.proc = subprocess.Popen(
            [SERVER, "--backend", "cpu", "--listen", listen, "--admin-host", "127.0.0.1",
             "--admin-port", "0", "--port-file", port_file, "--layers", "2", "--heads",
             str(HEADS), "--page-size", "16", "--pool-bytes", "64MiB", "--draft-buckets", "1",
             "8", "64", "--batch-buckets", "1", "--cpu-threads", "1", "--drain-grace-s", "0",
             "--drain-timeout-s", "2", "--log-level", "warn", *flags],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)
        servers.append(self.proc)
        deadline = time.time() + 60
        while not (os.path.exists(port_file) and os.path.getsize(port_file) > 0):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not start: {open(self.log_path).read()}")
            time.sleep(0.05)
        ports = open(port_file).read().split()
        self.port, self.admin_port = int(ports[0]), int(ports[1])
        while not self.ready() and time.time() < deadline:
            time.sleep(0.05)

    def rss_mib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def http(self, path, timeout=2.0):
        """(status, body) of GET path on the admin port; (None, reason) on failure."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}",
                                        timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except Exception as e:  # timeouts, resets: the probe failed
            return None, str(e)

    def ready(self):
        return self.http("/readyz")[0] == 200

    def metric(self, sample):
        """The value of one sample, e.g. 'mlaverify_queued_bytes' or
        'name{code="X",rpc="Y"}' (labels as the server prints them, sorted)."""
        status, body = self.http("/metrics")
        if status != 200:
            return None
        for line in body.splitlines():
            if line.rsplit(" ", 1)[0] == sample:
                return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self):
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


class RawH2:
    """One HTTP/2 connection written frame by frame."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.next_stream = 1
        self.pending = b""
        self.streams = {}  # stream id -> its headers, data and how it ended
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize())

    def open(self, method, end_stream=False, extra_headers=()):
        """HEADERS of a new gRPC call; returns (stream id, bytes)."""
        sid = self.next_stream
        self.next_stream += 2
        frame = HeadersFrame(sid)
        frame.data = self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", SERVICE + method),
            (":authority", "abuse"), ("content-type", "application/grpc"), ("te", "trailers"),
            *extra_headers])
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return sid, frame.serialize()

    @staticmethod
    def message(sid, payload, end_stream=False, max_frame=16384, compressed=False):
        """A gRPC length-prefixed message as DATA frames."""
        body = struct.pack(">BI", 1 if compressed else 0, len(payload)) + payload
        out = []
        for i in range(0, len(body), max_frame):
            frame = DataFrame(sid)
            frame.data = body[i:i + max_frame]
            if end_stream and i + max_frame >= len(body):
                frame.flags.add("END_STREAM")
            out.append(frame.serialize())
        return b"".join(out)

    @staticmethod
    def reset(sid):
        frame = RstStreamFrame(sid)
        frame.error_code = 8  # CANCEL
        return frame.serialize()

    def read_frame(self, timeout):
        self.sock.settimeout(timeout)
        while len(self.pending) < 9:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.pending += chunk
        frame, length = Frame.parse_frame_header(memoryview(self.pending[:9]))
        while len(self.pending) < 9 + length:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.pending += chunk
        frame.parse_body(memoryview(self.pending[9:9 + length]))
        self.pending = self.pending[9 + length:]
        self._track(frame)
        if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            self.sock.sendall(SettingsFrame(0, flags=["ACK"]).serialize())
        if isinstance(frame, DataFrame) and length > 0:
            for sid in (0, frame.stream_id):  # keep the server's windows open
                update = WindowUpdateFrame(sid)
                update.window_increment = length
                self.sock.sendall(update.serialize())
        return frame

    def send_within_windows(self, sid, body, timeout=30.0):
        """DATA frames of `body` (ending the stream) sent only as far as the
        server's flow-control windows allow, reading its SETTINGS and
        WINDOW_UPDATEs as it opens them. False if the stream ended first."""
        conn_window = stream_window = 65535
        initial = 65535
        sent, deadline = 0, time.time() + timeout
        while sent < len(body):
            n = min(conn_window, stream_window, 16384, len(body) - sent)
            if n > 0:
                frame = DataFrame(sid)
                frame.data = body[sent:sent + n]
                sent += n
                if sent == len(body):
                    frame.flags.add("END_STREAM")
                self.sock.sendall(frame.serialize())
                conn_window -= n
                stream_window -= n
                continue
            if time.time() > deadline:
                return False
            frame = self.read_frame(deadline - time.time())
            if frame is None:
                return False
            if isinstance(frame, SettingsFrame) and 4 in frame.settings:  # INITIAL_WINDOW_SIZE
                stream_window += frame.settings[4] - initial
                initial = frame.settings[4]
            elif isinstance(frame, WindowUpdateFrame):
                if frame.stream_id == 0:
                    conn_window += frame.window_increment
                elif frame.stream_id == sid:
                    stream_window += frame.window_increment
            elif self.streams.get(sid, {}).get("end") is not None:
                return False  # answered (or reset) before it was all sent
        return True

    def _track(self, frame):
        """Keeps every stream's headers, data and end as frames arrive. Every
        header block is decoded in arrival order, whichever stream it is on
        (HPACK's table is per connection)."""
        sid = getattr(frame, "stream_id", 0)
        if sid == 0:
            return
        st = self.streams.setdefault(sid, {"headers": {}, "data": b"", "end": None})
        if isinstance(frame, HeadersFrame):
            st["headers"].update({k.decode() if isinstance(k, bytes) else k:
                                  v.decode() if isinstance(v, bytes) else v
                                  for k, v in self.decoder.decode(frame.data)})
        elif isinstance(frame, DataFrame):
            st["data"] += frame.data
        elif isinstance(frame, RstStreamFrame) and st["end"] is None:
            # (After trailers, gRPC resets a stream the client has not
            # half-closed: the trailers are the answer.)
            st["end"] = f"RST_STREAM {frame.error_code}"
        if "END_STREAM" in getattr(frame, "flags", ()) and st["end"] is None:
            st["end"] = "END_STREAM"

    def call_result(self, sid, timeout=10.0):
        """Reads until `sid` ends: (grpc-status, grpc-message, [messages])."""
        deadline = time.time() + timeout
        while time.time() < deadline and self.streams.get(sid, {}).get("end") is None:
            if self.read_frame(deadline - time.time()) is None:
                break
        st = self.streams.get(sid, {"headers": {}, "data": b"", "end": None})
        if st["end"] is not None and st["end"].startswith("RST_STREAM"):
            return None, st["end"], []
        headers, data = st["headers"], st["data"]
        messages = []
        while len(data) >= 5:
            _, n = struct.unpack(">BI", data[:5])
            messages.append(data[5:5 + n])
            data = data[5 + n:]
        status = headers.get("grpc-status")
        return (int(status) if status is not None else None), headers.get("grpc-message", ""), messages

    def close(self):
        self.sock.close()


class ZeroWindowH2(RawH2):
    """A client that sends within the server's flow-control windows but opens
    none of its own (SETTINGS_INITIAL_WINDOW_SIZE 0, no WINDOW_UPDATE): the
    server can send it headers but never a byte of an answer, like a client
    that stopped reading. A thread reads the server's frames for their
    window updates."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.next_stream, self.pending = 1, b""
        self.lock = threading.Condition()
        self.conn_window, self.initial_window, self.windows = 65535, 65535, {}
        self.closed = False
        settings = SettingsFrame(0)
        settings.settings[SettingsFrame.INITIAL_WINDOW_SIZE] = 0
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings.serialize())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            while True:
                frame, length = Frame.parse_frame_header(memoryview(self._exact(9)))
                frame.parse_body(memoryview(self._exact(length)))
                with self.lock:
                    if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                        new = frame.settings.get(SettingsFrame.INITIAL_WINDOW_SIZE)
                        if new is not None:
                            for sid in self.windows:
                                self.windows[sid] += new - self.initial_window
                            self.initial_window = new
                        self.sock.sendall(SettingsFrame(0, flags=["ACK"]).serialize())
                    elif isinstance(frame, WindowUpdateFrame):
                        if frame.stream_id == 0:
                            self.conn_window += frame.window_increment
                        else:
                            self.windows[frame.stream_id] = (
                                self.windows.get(frame.stream_id, self.initial_window)
                                + frame.window_increment)
                    self.lock.notify_all()
        except OSError:
            pass
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def _exact(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def close(self):
        # shutdown, not just close: the reading thread is blocked in recv.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def send_message(self, sid, payload, timeout=30.0):
        """One gRPC message on `sid`, DATA frames sent as the windows allow;
        False when the windows stayed shut for `timeout`."""
        body = struct.pack(">BI", 0, len(payload)) + payload
        deadline = time.time() + timeout
        while body:
            with self.lock:
                while not self.closed and min(self.conn_window, self.windows.setdefault(
                        sid, self.initial_window)) <= 0:
                    if not self.lock.wait(deadline - time.time()):
                        return False
                if self.closed:
                    return False
                n = min(16384, len(body), self.conn_window, self.windows[sid])
                self.conn_window -= n
                self.windows[sid] -= n
                frame = DataFrame(sid)
                frame.data, body = body[:n], body[n:]
                self.sock.sendall(frame.serialize())
        return True


class RssWatch:
    """Samples the resident set of `processes` (anything with rss_mib(): the
    server, the front) every 50 ms in a thread; `base` and the peak are of
    their sum, in MiB."""

    def __init__(self, *processes):
        self.processes = processes
        self.base = self.total()
        self.peak, self.stop_flag = self.base, False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def total(self):
        return sum(p.rss_mib() for p in self.processes)

    def run(self):
        while not self.stop_flag:
            try:
                self.peak = max(self.peak, self.total())
            except Exception:
                return
            time.sleep(0.05)

    def stop(self):
        self.stop_flag = True
        self.thread.join()
        return self.peak


def health_during(server, seconds, results):
    """Asks /healthz every 0.25 s for `seconds`; appends the worst latency."""
    worst, failed = 0.0, 0
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.time()
        status, _ = server.http("/healthz", timeout=3.0)
        if status != 200:
            failed += 1
        worst = max(worst, time.time() - t0)
        time.sleep(0.25)
    results.append((worst, failed))


def verify_request(sequence_id, drafts, request_id, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0x3c00, 0x3c80, size=(drafts, HEADS, LATENT), dtype=np.uint16)
    kv = rng.integers(0x3c00, 0x3c80, size=(drafts, LATENT), dtype=np.uint16)
    req = verify_pb2.VerifyRequest(layer=0, request_id=request_id)
    item = req.items.add()
    item.sequence_id = sequence_id
    item.parents.extend([-1] + list(range(drafts - 1)))
    item.q.CopyFrom(verify_pb2.Tensor(dtype=verify_pb2.DTYPE_BF16, shape=list(q.shape),
                                      raw=q.tobytes()))
    item.draft_kv.CopyFrom(verify_pb2.Tensor(dtype=verify_pb2.DTYPE_BF16, shape=list(kv.shape),
                                             raw=kv.tobytes()))
    return req.SerializeToString()


def unary(port, method, payload, timeout=10.0, extra_headers=()):
    conn = RawH2(port)
    sid, headers = conn.open(method, extra_headers=extra_headers)
    conn.sock.sendall(headers + RawH2.message(sid, payload, end_stream=True))
    result = conn.call_result(sid, timeout)
    conn.close()
    return result


def create_sequence(port, extra_headers=()):
    status, message, msgs = unary(port, "CreateSequence", b"", extra_headers=extra_headers)
    assert status == 0 and msgs, (status, message)
    return verify_pb2.CreateSequenceResponse.FromString(msgs[0]).sequence_id


# ---- cases -----------------------------------------------------------------

def reset_flood(port, seconds, reconnect):
    """Opens and resets streams on one connection as fast as it can for
    `seconds` (bursts of 100 HEADERS + RST_STREAM pairs, reading whatever
    comes back without waiting); when the peer closes the connection, opens
    another if `reconnect`, else stops. Returns (streams, connections)."""
    sent, connections, end = 0, 0, time.time() + seconds
    while time.time() < end and (reconnect or connections == 0):
        conn = RawH2(port)
        connections += 1
        try:
            while time.time() < end and conn.next_stream < 2**31 - 400:
                burst = []
                for _ in range(100):
                    sid, headers = conn.open("GetServerInfo")
                    burst.append(headers + RawH2.reset(sid))
                conn.sock.sendall(b"".join(burst))
                sent += 100
                conn.sock.setblocking(False)
                try:
                    while conn.sock.recv(1 << 20):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass
                conn.sock.setblocking(True)
        except OSError as e:
            if not reconnect:
                print(f"     the peer closed the flooding connection after {sent} streams: {e}")
        conn.close()
    return sent, connections


def rapid_reset():
    """8 s of one connection opening and resetting streams. gRPC 1.51's server
    has no bound on the memory this takes (each stream leaves a call that
    waits for the handlers; later gRPC releases bound them): the growth is
    printed as the residual risk docs/operations.md ("Security model")
    states, not asserted. Asserted: /healthz answers throughout, a new
    connection is served afterwards and the server exits cleanly."""
    server = Server()
    base = server.rss_mib()
    watch = RssWatch(server)
    health = []
    prober = threading.Thread(target=health_during, args=(server, 8.0, health))
    prober.start()
    sent, _ = reset_flood(server.port, 8.0, reconnect=False)
    prober.join()
    time.sleep(1.0)
    peak = watch.stop()
    print(f"     {sent} streams opened and reset; RSS {base:.0f} -> peak {peak:.0f} MiB "
          f"(residual risk of gRPC 1.51, not asserted)")
    check(health and health[0][1] == 0, f"rapid reset: /healthz answered throughout "
          f"(failures {health[0][1] if health else '?'}, worst {health[0][0]:.2f} s)")
    # The calls the flood left are still being worked off: a new connection
    # is served once they are (seconds on a busy machine).
    status, t0 = None, time.time()
    while status != 0 and time.time() - t0 < 90:
        try:
            status, _, _ = unary(server.port, "GetServerInfo", b"", timeout=5.0)
        except OSError:
            status = None
    check(status == 0, f"rapid reset: a new connection is served afterwards "
          f"(status {status} after {time.time() - t0:.1f} s)")
    check(server.stop() == 0, "rapid reset: clean exit")


def send_unread_calls(conn, calls=65000):
    """Sends `calls` complete GetServerInfo calls on `conn` in bursts of
    100, reading nothing; returns how many went out before the peer
    stopped taking them."""
    conn.sock.settimeout(5.0)
    sent = 0
    try:
        while sent < calls:
            burst = []
            for _ in range(100):
                sid, headers = conn.open("GetServerInfo")
                burst.append(headers + RawH2.message(sid, b"", end_stream=True))
            conn.sock.sendall(b"".join(burst))
            sent += 100
    except OSError as e:
        print(f"     sending stopped after {sent} calls: {e}")
    return sent


def unread_calls():
    """One connection sends 65,000 complete calls and reads nothing, not even
    the server's SETTINGS, so --http2-max-concurrent-streams never takes
    effect on it (gRPC 1.51 enforces the acknowledged value): the growth is
    printed as residual risk, not asserted. Asserted: /healthz answers and the
    server exits cleanly."""
    server = Server()
    base = server.rss_mib()
    watch = RssWatch(server)
    conn = RawH2(server.port)
    sent = send_unread_calls(conn)
    time.sleep(2.0)
    health = []
    health_during(server, 1.0, health)
    peak = watch.stop()
    conn.close()
    print(f"     {sent} calls sent, none read; RSS {base:.0f} -> peak {peak:.0f} MiB "
          f"(residual risk of gRPC 1.51, not asserted)")
    check(health[0][1] == 0, f"unread calls: /healthz answered (worst {health[0][0]:.2f} s)")
    check(server.stop() == 0, "unread calls: clean exit")


def unread_streams():
    """32 streams on 4 connections that opened no window for answers (a
    client that stopped reading) send 8 Verify requests each (16 drafts: 0.3
    MiB in, 0.26 MiB out). The answers they hold count against
    --max-queued-bytes (4 MiB here): once the work is done (no call queued),
    the queued-bytes gauge still shows them and a new call is refused
    RESOURCE_EXHAUSTED saying why (before: the gauge read 0 and the server
    took more work while holding ~420 MiB for 32 such streams). A 33rd
    stream over --max-streams 32 is refused; RSS grows by less than 256 MiB."""
    import grpc
    from mlaverify.v1 import verify_pb2_grpc

    server = Server("--max-queued-bytes", "4MiB", "--max-streams", "32")
    seq, probe_seq = create_sequence(server.port), create_sequence(server.port)
    base = server.rss_mib()
    watch = RssWatch(server)
    conns = [ZeroWindowH2(server.port) for _ in range(4)]
    payload = verify_request(seq, 16, 1)
    sids = []
    for k in range(32):
        conn = conns[k % 4]
        sid, headers = conn.open("VerifyStream")
        conn.sock.sendall(headers)
        sids.append((conn, sid))
    senders = []
    for conn, sid in sids:
        t = threading.Thread(target=lambda c=conn, i=sid: [c.send_message(i, payload, 10.0)
                                                           for _ in range(8)], daemon=True)
        t.start()
        senders.append(t)
    deadline = time.time() + 20
    time.sleep(2.0)
    while time.time() < deadline and server.metric("mlaverify_queued_calls") != 0:
        time.sleep(0.2)
    time.sleep(0.5)
    queued_calls = server.metric("mlaverify_queued_calls")
    held = server.metric("mlaverify_queued_bytes")

    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                    options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = verify_pb2_grpc.VerifyServiceStub(channel)
    probe = verify_pb2.VerifyRequest.FromString(verify_request(probe_seq, 16, 2))

    def outcome(call):
        try:
            call()
            return 0, ""
        except grpc.RpcError as e:
            return e.code().value[0], e.details()

    status, message = outcome(lambda: stub.Verify(probe, timeout=10))
    stream_status, stream_message = outcome(
        lambda: next(stub.VerifyStream(iter([probe]), timeout=10)))
    health = []
    health_during(server, 1.0, health)
    peak = watch.stop()
    print(f"     RSS {base:.0f} -> peak {peak:.0f} MiB; queued calls {queued_calls}, bytes {held}; "
          f"new Verify {status} {message!r}; 33rd stream {stream_status} {stream_message!r}")
    check(peak - base < 256, f"unread streams: RSS grew {peak - base:.0f} MiB (< 256)")
    check(queued_calls == 0 and held is not None and held >= 2 << 20,
          f"unread streams: with no call queued, mlaverify_queued_bytes counts the unread "
          f"answers ({held} bytes, {queued_calls} calls)")
    check(status == 8 and "not yet read" in message,
          f"unread streams: a new Verify is RESOURCE_EXHAUSTED naming the unread answers "
          f"(got {status} {message!r})")
    check(stream_status == 8 and "--max-streams" in stream_message,
          f"unread streams: a stream past --max-streams is RESOURCE_EXHAUSTED naming the flag "
          f"(got {stream_status} {stream_message!r})")
    check(health[0][1] == 0, "unread streams: /healthz answered")
    for conn in conns:
        conn.close()
    deadline = time.time() + 10
    while time.time() < deadline and (server.metric("mlaverify_queued_bytes") or 0) > 0:
        time.sleep(0.1)
    check(server.metric("mlaverify_queued_bytes") == 0,
          "unread streams: the held bytes are given back when the streams end")
    status, message = outcome(lambda: stub.Verify(probe, timeout=10))
    check(status == 0, f"unread streams: calls are admitted again (status {status} {message!r})")
    channel.close()
    check(server.stop() == 0, "unread streams: clean exit")


def slow_admin():
    """256 connections from four addresses (127.0.0.2-5, 64 each) each send
    one byte of a request every 2 s; /healthz, /readyz and /metrics asked
    from 127.0.0.1 must keep answering within 1 s (before: 4 such
    connections held every admin worker; then 256 from four addresses took
    every connection slot and silenced the probes for as long as they
    lasted). The server takes 8 connections per address: 32 of the 256."""
    server = Server()
    stop = threading.Event()
    held = []

    def slowloris(source):
        try:
            s = socket.create_connection(("127.0.0.1", server.admin_port), source_address=(source, 0))
            s.send(b"G")
            held.append(s)
            for byte in b"ET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
                if stop.wait(2.0):
                    break
                s.send(bytes([byte]))
            s.close()
        except OSError:
            pass  # refused or closed by the server: that is what should happen

    threads = [threading.Thread(target=slowloris, args=(f"127.0.0.{2 + i % 4}",), daemon=True)
               for i in range(256)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    worst, failed = 0.0, 0
    for path in ["/healthz", "/metrics", "/readyz"] * 8:
        t0 = time.time()
        status, _ = server.http(path, timeout=5.0)
        worst = max(worst, time.time() - t0)
        failed += status != 200
        time.sleep(0.5)
    stop.set()
    print(f"     24 probes under 256 slow connections from 4 addresses: {failed} failed, "
          f"worst {worst:.2f} s")
    check(failed == 0 and worst < 1.0, f"slow admin: probes answered within 1 s "
          f"({failed} failed, worst {worst:.2f} s)")
    check(server.stop() == 0, "slow admin: clean exit")


def undecodable():
    """Bytes that do not parse get INVALID_ARGUMENT, counted in
    mlaverify_request_errors_total; on a VerifyStream the answer is in band
    and the stream goes on (before: UNIMPLEMENTED with no message; the
    stream ended OK and dropped later requests)."""
    server = Server()
    cases = {
        "garbage": b"\xff\xff\xff\xff",
        "truncated varint": b"\x08\xff",
        "invalid UTF-8 in a string field": b"\x0a\x02\xc3\x28",  # label, field 1
    }
    for what, payload in cases.items():
        status, message, _ = unary(server.port, "CreateSequence", payload)
        check(status == 3 and "CreateSequence" in message,
              f"undecodable ({what}): INVALID_ARGUMENT naming the RPC (got {status} {message!r})")
    errors = server.metric(
        'mlaverify_request_errors_total{code="INVALID_ARGUMENT",rpc="CreateSequence"}')
    check(errors == len(cases), f"undecodable: counted as CreateSequence INVALID_ARGUMENT ({errors})")

    seq = create_sequence(server.port)
    conn = RawH2(server.port)
    sid, headers = conn.open("VerifyStream")
    conn.sock.sendall(headers + RawH2.message(sid, b"\xff\xff\xff")
                      + RawH2.message(sid, verify_request(seq, 1, 7), end_stream=True))
    status, message, messages = conn.call_result(sid)
    conn.close()
    answers = [verify_pb2.VerifyResponse.FromString(m) for m in messages]
    codes = [(a.request_id, a.error_code) for a in answers]
    check(status == 0 and codes == [(0, 3), (7, 0)],
          f"undecodable on a stream: answered INVALID_ARGUMENT in band, the next request "
          f"served (status {status} {message!r}, answers {codes})")
    check(server.stop() == 0, "undecodable: clean exit")


def gzip_bomb(inflated_bytes):
    """gzip bytes that inflate to `inflated_bytes` zeros (about 1/1000 the size)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    out = [packer.compress(zeros) for _ in range(inflated_bytes >> 20)]
    out.append(packer.flush())
    return b"".join(out)


def compression_bomb():
    """Four calls at once, each a 1 MiB gzip message that inflates to 1 GiB
    (`grpc-encoding: gzip`), before any authentication: the server takes
    identity only and refuses them before inflating a byte (gRPC 1.51
    inflates a whole message before its size check: 1 GiB of memory per
    call). Asserted: every call refused UNIMPLEMENTED, RSS growth <= 64 MiB,
    an uncompressed call served afterwards."""
    server = Server("--auth-token-file", server_token_file())
    bomb = gzip_bomb(1 << 30)
    base = server.rss_mib()
    watch = RssWatch(server)
    results = []

    def send():
        conn = RawH2(server.port)
        sid, headers = conn.open("CreateSequence", extra_headers=[("grpc-encoding", "gzip")])
        conn.sock.sendall(headers)
        try:
            conn.send_within_windows(sid, struct.pack(">BI", 1, len(bomb)) + bomb)
        except OSError:
            pass  # the server may answer and close before reading it all
        results.append(conn.call_result(sid, timeout=30.0))
        conn.close()

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.5)
    peak = watch.stop()
    print(f"     {len(bomb) / 2**20:.2f} MiB of gzip per call, 1 GiB inflated; "
          f"RSS {base:.0f} -> peak {peak:.0f} MiB; answers {[r[:2] for r in results]}")
    check(len(results) == 4 and all(r[0] == 12 for r in results),
          "compression bomb: every call refused UNIMPLEMENTED")
    check(peak - base <= 64, f"compression bomb: RSS growth {peak - base:.0f} MiB <= 64 MiB")
    status, message, _ = unary(server.port, "GetServerInfo", b"")
    check(status == 16, f"compression bomb: the server still answers (an uncompressed call "
          f"without the token: UNAUTHENTICATED, got {status} {message!r})")
    check(server.stop() == 0, "compression bomb: clean exit")


def tokenless_streams():
    """With a token and --max-streams 4: 64 VerifyStreams opened without the
    token on 4 connections and left idle. Before, each took a slot at open
    (the token was checked per request) and the scheduler was locked out.
    Asserted: each is refused UNAUTHENTICATED at open, and the scheduler's
    stream, with the token, is served meanwhile."""
    token = "abuse-test-token-0123456789abcdef"
    server = Server("--auth-token-file", server_token_file(), "--max-streams", "4")
    refused = []
    conns = [RawH2(server.port) for _ in range(4)]
    for conn in conns:
        sids = []
        for _ in range(16):
            sid, headers = conn.open("VerifyStream")
            conn.sock.sendall(headers)
            sids.append(sid)
        for sid in sids:
            refused.append(conn.call_result(sid, timeout=3.0)[0])
    check(refused == [16] * 64, f"token-less streams: refused UNAUTHENTICATED at open "
          f"({sum(1 for r in refused if r == 16)} of 64; others {[r for r in refused if r != 16]})")
    auth = [("authorization", f"Bearer {token}")]
    seq = create_sequence(server.port, auth)
    conn = RawH2(server.port)
    sid, headers = conn.open("VerifyStream", extra_headers=auth)
    conn.sock.sendall(headers + RawH2.message(sid, verify_request(seq, 1, 9), end_stream=True))
    status, message, messages = conn.call_result(sid)
    conn.close()
    answers = [verify_pb2.VerifyResponse.FromString(m) for m in messages]
    check(status == 0 and [(a.request_id, a.error_code) for a in answers] == [(9, 0)],
          f"token-less streams: the scheduler's stream is served beside them "
          f"(status {status} {message!r}, answers {[(a.request_id, a.error_code) for a in answers]})")
    for c in conns:
        c.close()
    check(server.stop() == 0, "token-less streams: clean exit")


FRONT_CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy",
                          "http2-front", "nghttpx.conf")


class Front:
    """deploy/http2-front/nghttpx.conf in front of `server`: the repository's
    file with only its frontend (a free loopback port), backend (the
    server's port), workers (1) and error log (a file) replaced."""

    def __init__(self, server):
        self.nghttpx = shutil.which("nghttpx") or ("/usr/sbin/nghttpx"
                                                   if os.path.exists("/usr/sbin/nghttpx") else None)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.log_path = os.path.join(server.tmp, "front.log")
        lines = []
        for line in open(FRONT_CONF):
            key = line.split("=", 1)[0].strip()
            if key in ("frontend", "backend", "workers", "errorlog-file"):
                continue
            lines.append(line)
        lines += [f"frontend=127.0.0.1,{self.port};no-tls\n",
                  f"backend=127.0.0.1,{server.port};;proto=h2\n", "workers=1\n",
                  f"errorlog-file={self.log_path}\n"]
        conf = os.path.join(server.tmp, "nghttpx.conf")
        with open(conf, "w") as f:
            f.writelines(lines)
        self.proc = subprocess.Popen([self.nghttpx, f"--conf={conf}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        servers.append(self.proc)
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"nghttpx did not start: {open(self.log_path).read()}")
                time.sleep(0.05)

    def rss_mib(self):
        """The master's and its workers' resident sets together."""
        pids = [self.proc.pid]
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
        total = 0.0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) / 1024
            except OSError:
                pass
        return total

    def stop(self):
        """SIGQUIT: nghttpx's graceful shutdown (SIGTERM ends it at once)."""
        self.proc.send_signal(signal.SIGQUIT)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def front_available():
    if shutil.which("nghttpx") or os.path.exists("/usr/sbin/nghttpx"):
        return True
    print("     SKIPPED: no nghttpx (Debian's nghttp2-proxy; scripts/install_deps.sh installs it)")
    return False


def verify_during(port, seq, seconds, results):
    """A legitimate Verify through `port` every 0.25 s for `seconds`:
    appends (status, seconds) per call."""
    end, n = time.time() + seconds, 0
    while time.time() < end:
        n += 1
        t0 = time.time()
        try:
            status, _, msgs = unary(port, "Verify", verify_request(seq, 1, n), timeout=5.0)
            ok = status == 0 and msgs and verify_pb2.VerifyResponse.FromString(msgs[0]).error_code == 0
            results.append((0 if ok else status, time.time() - t0))
        except OSError as e:
            results.append((str(e), time.time() - t0))
        time.sleep(0.25)


def rapid_reset_front():
    """The Rapid Reset flood of `rapid_reset`, through the HTTP/2 front
    (deploy/http2-front), reconnecting whenever the front closes the
    flooding connection. Asserted: the server's and the front's RSS
    together grow <= 300 MiB, and a legitimate Verify through the front is
    served every time it is sent during the flood."""
    if not front_available():
        return
    server = Server()
    front = Front(server)
    seq = create_sequence(front.port)
    watch = RssWatch(server, front)
    legit = []
    prober = threading.Thread(target=verify_during, args=(front.port, seq, 8.0, legit))
    prober.start()
    sent, connections = reset_flood(front.port, 8.0, reconnect=True)
    prober.join()
    peak = watch.stop()
    served = sum(1 for status, _ in legit if status == 0)
    worst = max((t for _, t in legit), default=0.0)
    print(f"     {sent} streams opened and reset over {connections} connections; server + front "
          f"RSS {watch.base:.0f} -> peak {peak:.0f} MiB; legitimate Verify {served}/{len(legit)}, "
          f"worst {worst:.3f} s")
    check(peak - watch.base <= 300, f"rapid reset through the front: RSS growth "
          f"{peak - watch.base:.0f} MiB <= 300 MiB")
    check(len(legit) >= 10 and served == len(legit),
          f"rapid reset through the front: every legitimate Verify served during the flood "
          f"({served} of {len(legit)}, worst {worst:.2f} s)")
    check(front.stop() == 0, "rapid reset through the front: the front exits cleanly")
    check(server.stop() == 0, "rapid reset through the front: clean exit")


def unread_calls_front():
    """The stream flood of `unread_calls` (65,000 complete calls on one
    connection that reads nothing), through the HTTP/2 front. Asserted: the
    server's and the front's RSS together grow <= 300 MiB, and a legitimate
    Verify through the front is served meanwhile."""
    if not front_available():
        return
    server = Server()
    front = Front(server)
    seq = create_sequence(front.port)
    watch = RssWatch(server, front)
    conn = RawH2(front.port)
    sent = send_unread_calls(conn)
    legit = []
    verify_during(front.port, seq, 2.0, legit)
    time.sleep(1.0)
    peak = watch.stop()
    conn.close()
    served = sum(1 for status, _ in legit if status == 0)
    print(f"     {sent} calls sent, none read; server + front RSS {watch.base:.0f} -> peak "
          f"{peak:.0f} MiB; legitimate Verify {served}/{len(legit)}")
    check(peak - watch.base <= 300, f"unread calls through the front: RSS growth "
          f"{peak - watch.base:.0f} MiB <= 300 MiB")
    check(legit and served == len(legit),
          f"unread calls through the front: legitimate Verify served ({served} of {len(legit)})")
    check(front.stop() == 0, "unread calls through the front: the front exits cleanly")
    check(server.stop() == 0, "unread calls through the front: clean exit")


def server_token_file():
    path = os.path.join(tempfile.mkdtemp(prefix="mlaverify-abuse-token-"), "token")
    with open(path, "w") as f:
        f.write("abuse-test-token-0123456789abcdef\n")
    os.chmod(path, 0o600)
    return path


CASES = {f.__name__: f for f in [rapid_reset, unread_calls, unread_streams, slow_admin,
                                 undecodable, compression_bomb, tokenless_streams,
                                 rapid_reset_front, unread_calls_front]}


def main():
    names = sys.argv[3:] or list(CASES)
    for name in names:
        print(f"== {name}: {CASES[name].__doc__.split(chr(10))[0]}", flush=True)
        try:
            CASES[name]()
        except Exception as e:  # a case that crashes fails, the others still run
            check(False, f"{name}: {type(e).__name__}: {e}")
        finally:
            for proc in servers:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            servers.clear()
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
