"""Several mlaverify servers (replicas) behind one client, as the C++
client's ReplicaSet (client/replica_set.h). Replicas share no state: a
sequence's KV lives in the replica that created it, so create_sequence
picks a replica and every later call of that sequence goes to it (a
PlacedSequence carries the owner). New sequences go to the healthy replica
with the most free pages (counts within a tenth of the most tie), then the
fewest live sequences this client placed there, then round robin. A replica
whose call fails with UNAVAILABLE is marked down: it gets no new sequences,
and calls for its sequences fail at once with UNAVAILABLE naming it. A down
replica is probed again (GetServerInfo) at most once per
`retry_down_after_s`; when it answers it takes new sequences again (after a
restart its old sequences are NOT_FOUND, which the server says).

    replicas = ReplicaSet(["10.0.0.1:50051", "10.0.0.2:50051"], timeout=10)
    seq = replicas.create_sequence("req-17")
    replicas.append_prompt(seq, kv)
    results = replicas.verify(seq.replica, layer, [VerifyItem(seq.id, q, draft_kv, parents)])
    replicas.commit(seq, accepted)
    replicas.release_sequence(seq)

Every method that makes calls takes metadata= (key, value) pairs, passed to
the replica's client for each call it makes (VerifyClient says how they join
the client's own); create_sequence sends them with its probes too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional, Sequence

import grpc

from mlaverify import _wire
from mlaverify._wire import Metadata
from mlaverify.aio import AsyncVerifyClient
from mlaverify.client import VerifyClient
from mlaverify.errors import VerifyError


@dataclass(frozen=True)
class PlacedSequence:
    """A sequence and the replica (index into the set) that owns it."""

    replica: int
    id: int


@dataclass
class ReplicaState:
    """What the set knows of one replica."""

    target: str
    up: bool = True
    down_reason: str = ""           # the failure that marked it down
    sequences_created: int = 0      # through this set
    live_sequences: int = 0         # created and not yet released through it
    free_pages: int = -1            # from the last GetServerInfo; -1: never answered
    instance_id: str = ""           # from the first GetServerInfo that answered


class _Book:
    """The replicas' states and the placement rule, shared by both sets."""

    def __init__(self, targets: Sequence[str], retry_down_after_s: float):
        if not targets:
            raise ValueError("no targets")
        seen = set()
        for t in targets:
            if t in seen:
                raise ValueError(f"target {t} given twice")
            seen.add(t)
        self.states = [ReplicaState(t) for t in targets]
        self.down_since = [0.0] * len(targets)
        self.retry_down_after_s = retry_down_after_s
        self.lock = threading.Lock()
        self.turn = 0

    def name(self, index: int) -> str:
        return f"replica {index} ({self.states[index].target})"

    def check_up(self, index: int) -> None:
        with self.lock:
            state = self.states[index]
            if state.up:
                return
            reason = state.down_reason
        raise VerifyError(grpc.StatusCode.UNAVAILABLE, f"{self.name(index)} is down: {reason}")

    def observe(self, index: int, error: VerifyError) -> VerifyError:
        """Marks the replica down on UNAVAILABLE; the error, named."""
        if error.code == grpc.StatusCode.UNAVAILABLE:
            self.mark_down(index, error.details)
        if len(self.states) == 1:
            return error
        return VerifyError(error.code, f"{self.name(index)}: {error.details}", error.rpc)

    def mark_down(self, index: int, reason: str) -> None:
        with self.lock:
            state = self.states[index]
            if state.up:
                state.up = False
                state.down_reason = reason
                self.down_since[index] = time.monotonic()

    def may_probe(self, index: int) -> bool:
        with self.lock:
            return self.states[index].up or \
                time.monotonic() - self.down_since[index] >= self.retry_down_after_s

    def answered(self, index: int, info: Any) -> None:
        with self.lock:
            state = self.states[index]
            state.up = True
            state.down_reason = ""
            state.free_pages = info.free_pages
            if not state.instance_id:
                state.instance_id = info.instance_id

    def pick(self, up: List[int], tried: List[bool]) -> int:
        """The next replica to create on, reserved (live_sequences + 1)
        under the lock so that concurrent creators see each other's picks."""
        n = len(self.states)
        with self.lock:
            most_free = max([1] + [self.states[i].free_pages for i in up])
            turn = self.turn
            self.turn += 1
            best, index = None, -1
            for i in up:
                if tried[i]:
                    continue
                s = self.states[i]
                key = (-(s.free_pages * 10 // most_free), s.live_sequences, (i - turn % n + n) % n)
                if best is None or key < best:
                    best, index = key, i
            self.states[index].live_sequences += 1
        return index

    def created(self, index: int, ok: bool) -> None:
        with self.lock:
            if ok:
                self.states[index].sequences_created += 1
            else:
                self.states[index].live_sequences -= 1

    def released(self, index: int) -> None:
        with self.lock:
            if self.states[index].live_sequences > 0:
                self.states[index].live_sequences -= 1

    def none_up(self) -> VerifyError:
        with self.lock:
            down = "; ".join(f"{self.name(i)}: {s.down_reason}" for i, s in enumerate(self.states))
        return VerifyError(grpc.StatusCode.UNAVAILABLE, f"no replica is up ({down})",
                           "CreateSequence")

    def snapshot(self) -> List[ReplicaState]:
        with self.lock:
            return [replace(s) for s in self.states]


class _ReplicaSetBase:
    """What ReplicaSet and AsyncReplicaSet share: the book, the clients and
    the members that make no call."""

    def __init__(self, targets: Sequence[str], retry_down_after_s: float,
                 client_class: Callable[..., Any], client_options: Any):
        self._book = _Book(targets, retry_down_after_s)
        self._clients = [client_class(t, **client_options) for t in targets]

    def __len__(self) -> int:
        return len(self._clients)

    def replica(self, index: int) -> Any:
        """The client of replica `index` (for calls made on it directly,
        e.g. a VerifyStream: pass their errors to observe())."""
        return self._clients[index]

    def name(self, index: int) -> str:
        """"replica 1 (127.0.0.1:50052)"."""
        return self._book.name(index)

    def states(self) -> List[ReplicaState]:
        """A copy of every replica's state."""
        return self._book.snapshot()

    def check_up(self, index: int) -> None:
        """Raises UNAVAILABLE naming the replica when it is marked down."""
        self._book.check_up(index)

    def observe(self, index: int, error: VerifyError) -> VerifyError:
        """The outcome of a call made on replica(index) directly: marks it
        down on UNAVAILABLE; returns the error named after the replica."""
        return self._book.observe(index, error)


class ReplicaSet(_ReplicaSetBase):
    """Replicas behind one synchronous client: one VerifyClient per target,
    made with `client_options` (VerifyClient's keyword arguments)."""

    def __init__(self, targets: Sequence[str], retry_down_after_s: float = 1.0,
                 **client_options: Any):
        super().__init__(targets, retry_down_after_s, VerifyClient, client_options)

    def _refresh(self, index: int, metadata: Metadata) -> bool:
        if not self._book.may_probe(index):
            return False
        try:
            info = self._clients[index].server_info(metadata=metadata)
        except VerifyError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                self._book.mark_down(index, e.details)
            return False
        self._book.answered(index, info)
        return True

    def create_sequence(self, label: str = "", *, metadata: Metadata = None) -> PlacedSequence:
        """A new sequence on a healthy replica (the module says which). A
        replica's own refusal (e.g. its sequence limit) after trying the
        others; UNAVAILABLE naming every replica when none is up."""
        up = [i for i in range(len(self._clients)) if self._refresh(i, metadata)]
        tried = [False] * len(self._clients)
        last: Optional[VerifyError] = None
        for _ in up:
            index = self._book.pick(up, tried)
            tried[index] = True
            try:
                sequence_id = self._clients[index].create_sequence(label, metadata=metadata)
            except VerifyError as e:
                self._book.created(index, False)
                last = self._book.observe(index, e)
                continue
            self._book.created(index, True)
            return PlacedSequence(index, sequence_id)
        raise last if last is not None else self._book.none_up()

    def _on(self, index: int, call: Callable[[VerifyClient], Any]) -> Any:
        self._book.check_up(index)
        try:
            return call(self._clients[index])
        except VerifyError as e:
            raise self._book.observe(index, e) from None

    def append_kv(self, seq: PlacedSequence, start_position: int, kv: Any, *,
                  metadata: Metadata = None) -> int:
        """VerifyClient.append_kv on the owner."""
        return self._on(seq.replica, lambda c: c.append_kv(seq.id, start_position, kv,
                                                           metadata=metadata))

    def append_prompt(self, seq: PlacedSequence, kv: Any, start_position: int = 0, *,
                      metadata: Metadata = None) -> int:
        """VerifyClient.append_prompt on the owner."""
        return self._on(seq.replica, lambda c: c.append_prompt(seq.id, kv, start_position,
                                                               metadata=metadata))

    def verify(self, owner: int, layer: int, items: Sequence[_wire.VerifyItem],
               softmax_scale: float = 0.0, *,
               metadata: Metadata = None) -> List[_wire.VerifyResult]:
        """VerifyClient.verify on replica `owner`; every item's sequence must
        be on it."""
        return self._on(owner, lambda c: c.verify(layer, items, softmax_scale,
                                                  metadata=metadata))

    def commit(self, seq: PlacedSequence, accepted: Sequence[int], *,
               metadata: Metadata = None) -> _wire.CommitResult:
        """VerifyClient.commit on the owner."""
        return self._on(seq.replica, lambda c: c.commit(seq.id, accepted, metadata=metadata))

    def release_sequence(self, seq: PlacedSequence, *, metadata: Metadata = None) -> int:
        """VerifyClient.release_sequence on the owner."""
        self._book.check_up(seq.replica)
        try:
            freed = self._clients[seq.replica].release_sequence(seq.id, metadata=metadata)
        except VerifyError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                self._book.released(seq.replica)
            raise self._book.observe(seq.replica, e) from None
        self._book.released(seq.replica)
        return freed

    def close(self) -> None:
        """Closes every replica's client."""
        for c in self._clients:
            c.close()

    def __enter__(self) -> "ReplicaSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncReplicaSet(_ReplicaSetBase):
    """As ReplicaSet, over AsyncVerifyClients: the same methods, coroutines."""

    def __init__(self, targets: Sequence[str], retry_down_after_s: float = 1.0,
                 **client_options: Any):
        super().__init__(targets, retry_down_after_s, AsyncVerifyClient, client_options)

    async def _refresh(self, index: int, metadata: Metadata) -> bool:
        if not self._book.may_probe(index):
            return False
        try:
            info = await self._clients[index].server_info(metadata=metadata)
        except VerifyError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                self._book.mark_down(index, e.details)
            return False
        self._book.answered(index, info)
        return True

    async def create_sequence(self, label: str = "", *,
                              metadata: Metadata = None) -> PlacedSequence:
        """As ReplicaSet.create_sequence."""
        up = [i for i in range(len(self._clients)) if await self._refresh(i, metadata)]
        tried = [False] * len(self._clients)
        last: Optional[VerifyError] = None
        for _ in up:
            index = self._book.pick(up, tried)
            tried[index] = True
            try:
                sequence_id = await self._clients[index].create_sequence(label, metadata=metadata)
            except VerifyError as e:
                self._book.created(index, False)
                last = self._book.observe(index, e)
                continue
            self._book.created(index, True)
            return PlacedSequence(index, sequence_id)
        raise last if last is not None else self._book.none_up()

    async def _on(self, index: int, call: Callable[[AsyncVerifyClient], Any]) -> Any:
        self._book.check_up(index)
        try:
            return await call(self._clients[index])
        except VerifyError as e:
            raise self._book.observe(index, e) from None

    async def append_kv(self, seq: PlacedSequence, start_position: int, kv: Any, *,
                        metadata: Metadata = None) -> int:
        """As ReplicaSet.append_kv."""
        return await self._on(seq.replica, lambda c: c.append_kv(seq.id, start_position, kv,
                                                                 metadata=metadata))

    async def append_prompt(self, seq: PlacedSequence, kv: Any, start_position: int = 0, *,
                            metadata: Metadata = None) -> int:
        """As ReplicaSet.append_prompt."""
        return await self._on(seq.replica, lambda c: c.append_prompt(seq.id, kv, start_position,
                                                                     metadata=metadata))

    async def verify(self, owner: int, layer: int, items: Sequence[_wire.VerifyItem],
                     softmax_scale: float = 0.0, *,
                     metadata: Metadata = None) -> List[_wire.VerifyResult]:
        """As ReplicaSet.verify."""
        return await self._on(owner, lambda c: c.verify(layer, items, softmax_scale,
                                                        metadata=metadata))

    async def commit(self, seq: PlacedSequence, accepted: Sequence[int], *,
                     metadata: Metadata = None) -> _wire.CommitResult:
        """As ReplicaSet.commit."""
        return await self._on(seq.replica, lambda c: c.commit(seq.id, accepted,
                                                              metadata=metadata))

    async def release_sequence(self, seq: PlacedSequence, *, metadata: Metadata = None) -> int:
        """As ReplicaSet.release_sequence."""
        self._book.check_up(seq.replica)
        try:
            freed = await self._clients[seq.replica].release_sequence(seq.id, metadata=metadata)
        except VerifyError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                self._book.released(seq.replica)
            raise self._book.observe(seq.replica, e) from None
        self._book.released(seq.replica)
        return freed

    async def close(self) -> None:
        """As ReplicaSet.close."""
        for c in self._clients:
            await c.close()

    async def __aenter__(self) -> "AsyncReplicaSet":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
