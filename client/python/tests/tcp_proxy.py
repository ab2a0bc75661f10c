"""A TCP forwarder for the connection tests: counts the connections the
client opens, can cut one, and can freeze (stop forwarding while keeping
the sockets open, as a dead peer or a dropped NAT flow looks)."""

import socket
import threading


class TcpProxy:
    def __init__(self, target: str, port: int = 0):
        host, upstream_port = target.rsplit(":", 1)
        self._upstream = (host, int(upstream_port))
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(64)
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.connections = []  # (client socket, upstream socket), in accept order
        self.frozen = threading.Event()  # every connection
        self.frozen_connections = set()  # some, by index
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self._upstream)
            with self.lock:
                index = len(self.connections)
                self.connections.append((conn, up))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b, index), daemon=True).start()

    def _pump(self, src, dst, index):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            if self.frozen.is_set() or index in self.frozen_connections:
                continue  # swallowed: the peer looks dead, the socket stays open
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def count(self) -> int:
        with self.lock:
            return len(self.connections)

    def freeze(self, index: int) -> None:
        """Stops forwarding on connection `index`, sockets left open."""
        self.frozen_connections.add(index)

    def cut(self, index: int) -> None:
        """Resets connection `index` (both sides)."""
        with self.lock:
            pair = self.connections[index]
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self._closed = True
        self._listener.close()
        with self.lock:
            pairs = list(self.connections)
        for pair in pairs:
            for s in pair:
                try:
                    s.close()
                except OSError:
                    pass
