"""Channel options and the connection pool both clients share: N channels,
each with its own subchannel pool so that each is its own HTTP/2 (TCP)
connection; the calls of one sequence stay on one of them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import grpc

# Up to the largest message the server takes (its --max-message-bytes;
# GetServerInfo says what it is).
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
MAX_CONNECTIONS = 256


@dataclass(frozen=True)
class ChannelSettings:
    """What every channel of a client is made with.

    connections: HTTP/2 connections to the target (1..256). One Python
    process stays under one connection's rate (a bare echo of Verify-sized
    messages peaks near 6.3k calls/s on one connection on the H200 host; a
    Python client's calls cost more than that in the interpreter), so the
    default is 1; more help several processes' worth of concurrency, e.g. an
    asyncio scheduler with many streams. The target must name one server (a
    balancer that spreads connections would split a sequence's calls).

    keepalive_time_s / keepalive_timeout_s: a connection with a call open
    (an idle VerifyStream included) is pinged after keepalive_time_s without
    traffic and closed when the ack takes longer than keepalive_timeout_s
    (its calls fail UNAVAILABLE; the next call reconnects). 30 s keeps NAT
    and L4 balancer flows alive (their idle timeouts are minutes) and stays
    above the server's minimum ping interval (--http2-min-ping-interval-ms,
    10 s), below which the server closes the connection. None: no pings.
    keepalive_permit_without_calls: ping connections with no call open too.

    wait_for_ready: queue calls while the channel connects instead of
    failing them at once with UNAVAILABLE (the deadline still applies); safe
    for every RPC, since nothing was sent.
    """

    connections: int = 1
    keepalive_time_s: Optional[float] = 30.0
    keepalive_timeout_s: float = 10.0
    keepalive_permit_without_calls: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    wait_for_ready: bool = False
    extra_options: Tuple[Tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= MAX_CONNECTIONS:
            raise ValueError(f"connections {self.connections}: must be 1..{MAX_CONNECTIONS}")
        if self.keepalive_time_s is not None and (self.keepalive_time_s < 0.001 or
                                                  self.keepalive_timeout_s < 0.001):
            raise ValueError(f"keepalive_time_s {self.keepalive_time_s} and keepalive_timeout_s "
                             f"{self.keepalive_timeout_s}: need both >= 0.001 (None: no pings)")

    def options(self, index: int) -> List[Tuple[str, Any]]:
        """The channel arguments of connection `index`."""
        opts: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # A subchannel pool of its own and an argument that differs make
            # this channel its own TCP connection: gRPC shares one
            # connection between channels of equal arguments.
            ("grpc.use_local_subchannel_pool", 1),
            ("mlaverify.connection_index", index),
        ]
        if self.keepalive_time_s is not None:
            opts += [("grpc.keepalive_time_ms", max(1, int(self.keepalive_time_s * 1000))),
                     ("grpc.keepalive_timeout_ms", max(1, int(self.keepalive_timeout_s * 1000))),
                     ("grpc.keepalive_permit_without_calls",
                      1 if self.keepalive_permit_without_calls else 0),
                     # Unlimited pings between data frames: an idle stream
                     # is the case keepalive is for.
                     ("grpc.http2.max_pings_without_data", 0)]
        return opts + list(self.extra_options)


class ConnectionPool:
    """N channels (plain or asyncio, made by `make_channel(options)`) and the
    rule that picks one: a sequence's calls go to `sequence_id % N` (so they
    keep their order), everything else round robin."""

    def __init__(self, settings: ChannelSettings,
                 make_channel: Callable[[Sequence[Tuple[str, Any]]], Any]):
        self.settings = settings
        self.channels = [make_channel(settings.options(i)) for i in range(settings.connections)]
        self._turn = itertools.count()

    def __len__(self) -> int:
        return len(self.channels)

    def for_sequence(self, sequence_id: int) -> int:
        """The connection index of a sequence's calls."""
        return int(sequence_id) % len(self.channels)

    def next(self) -> int:
        """A connection index, round robin."""
        return next(self._turn) % len(self.channels)


def retry_delays(retries: int, backoff_s: float):
    """The waits before each retry: backoff_s, doubling, capped at 1 s."""
    delay = backoff_s
    for _ in range(retries):
        yield delay
        delay = min(delay * 2, 1.0)


# The RPCs a retry cannot harm: they read and change nothing. CreateSequence
# is not among them (a retried one that had run leaves a sequence nobody
# releases), nor AppendKv, Verify, Commit, ReleaseSequence or the region
# registrations: a call that failed on the way back may have run.
IDEMPOTENT = frozenset({"Health.Check", "GetServerInfo", "SystemSharedMemoryStatus",
                        "CudaSharedMemoryStatus", "GetStep"})
# Only UNAVAILABLE is retried: the server was unreachable, starting or
# draining. DEADLINE_EXCEEDED is the caller's budget, spent.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
