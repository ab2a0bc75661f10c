"""The native path: Verify of items placed in shared memory (system or CUDA)
sent by the C++ client library instead of grpcio.

A Python Verify spends most of its client-side time in grpcio (a call over a
sync VerifyStream hops from the caller to grpcio's request-iterator thread
and back from the reader thread). Placed items travel as region names and
offsets, so nothing but references needs to cross from Python: this module
checks the request as VerifyClient does, puts the inputs in place, then hands
the references to libmlaverify_native.so (client/native: the C++ client's
Verify behind a C ABI, loaded with ctypes, the GIL released during the call)
and reads the outputs from the region as the pure-Python path does.

    with client.native_stream() as stream:           # NativeVerifyStream
        (result,) = stream.verify(layer, [VerifyItem(seq, q, draft_kv, parents, shm=place)])
    (result,) = client.native_verify(layer, items)   # one unary call

    with client.native_stream() as stream:           # a step's items bound once
        bound = stream.bind(items)                    # BoundVerify: checks made here
        for layer in range(num_layers):
            results = bound.verify(layer)

The library is looked for in lib/ next to this file (the CMake build writes
it into build/client/python/mlaverify/lib/; a wheel built with
MLAVERIFY_NATIVE_LIB_PATH carries it there, README.md says how) or at
$MLAVERIFY_NATIVE_LIB; a package installed without it has none, and then
these calls raise NativeUnavailableError saying so (`available()` tells
beforehand). The native client is its own HTTP/2
connection, plaintext (credentials objects are grpcio's and cannot be handed
over), with the VerifyClient's timeout, auth token, keepalive and message
limit.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import weakref
from typing import Any, List, Optional, Sequence

import grpc

from mlaverify import _wire, tensors
from mlaverify.errors import VerifyError, code_from_number

LIBRARY = "libmlaverify_native.so"
_MESSAGE_BYTES = 4096


class NativeUnavailableError(RuntimeError):
    """The native library could not be loaded (the message says why and how
    to get it)."""


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_load_error: Optional[str] = None


def library_path() -> str:
    """Where the library is looked for: $MLAVERIFY_NATIVE_LIB, else lib/
    next to this file."""
    return os.environ.get("MLAVERIFY_NATIVE_LIB") or os.path.join(os.path.dirname(__file__),
                                                                   "lib", LIBRARY)


def load() -> ctypes.CDLL:
    """The native library, loaded once; NativeUnavailableError saying why
    not (and how to get it)."""
    global _lib, _load_error
    with _lock:
        if _lib is not None:
            return _lib
        if _load_error is None:
            path = library_path()
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                _load_error = (f"the native path needs {LIBRARY}, which could not be loaded from "
                               f"{path}: {e}. It is built by CMake into "
                               "build/client/python/mlaverify/lib/ (put build/client/python on "
                               "PYTHONPATH, or set MLAVERIFY_NATIVE_LIB, or install a wheel "
                               "built with MLAVERIFY_NATIVE_LIB_PATH); without it the package "
                               "has only the pure-Python path (VerifyClient.verify, "
                               "verify_stream)")
            else:
                _declare(lib)
                _lib = lib
                return lib
        raise NativeUnavailableError(_load_error)


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    msg = [c.c_char_p, c.c_size_t]
    lib.mlaverify_native_client_create.argtypes = [
        c.c_char_p, c.c_double, c.c_char_p, c.c_int, c.c_double, c.c_double, c.c_int, c.c_int64,
        c.POINTER(c.c_void_p)] + msg
    lib.mlaverify_native_client_create.restype = c.c_int
    lib.mlaverify_native_client_destroy.argtypes = [c.c_void_p]
    lib.mlaverify_native_client_destroy.restype = None
    lib.mlaverify_native_stream_open.argtypes = [
        c.c_void_p, c.POINTER(c.c_char_p), c.c_int, c.POINTER(c.c_void_p)] + msg
    lib.mlaverify_native_stream_open.restype = c.c_int
    lib.mlaverify_native_stream_close.argtypes = [c.c_void_p] + msg
    lib.mlaverify_native_stream_close.restype = c.c_int
    lib.mlaverify_native_stream_destroy.argtypes = [c.c_void_p]
    lib.mlaverify_native_stream_destroy.restype = None
    lib.mlaverify_native_item_create.argtypes = [
        c.c_uint64, c.POINTER(c.c_int32), c.c_int, c.c_int, c.c_char_p, c.c_uint64, c.c_uint64,
        c.c_uint64, c.c_uint64]
    lib.mlaverify_native_item_create.restype = c.c_void_p
    lib.mlaverify_native_item_destroy.argtypes = [c.c_void_p]
    lib.mlaverify_native_item_destroy.restype = None
    lib.mlaverify_native_verify.argtypes = [
        c.c_void_p, c.c_void_p, c.c_int, c.POINTER(c.c_void_p), c.c_int, c.c_float, c.c_double,
        c.POINTER(c.c_char_p), c.c_int, c.POINTER(c.c_int64)] + msg
    lib.mlaverify_native_verify.restype = c.c_int


def available() -> bool:
    """Whether the native library loads here."""
    try:
        load()
        return True
    except NativeUnavailableError:
        return False


def _check_layer(g: "_wire.Geometry", layer: int) -> None:
    if not 0 <= layer < g.num_layers:
        raise ValueError(f"layer {layer}: the server has layers 0..{g.num_layers - 1}")


def _raise(code: int, message: ctypes.Array, rpc: str) -> None:
    raise VerifyError(code_from_number(code), message.value.decode("utf-8", "replace"), rpc)


class _Item:
    """One placed item's native handle (freed with the object)."""

    __slots__ = ("handle", "_lib")

    def __init__(self, lib: ctypes.CDLL, sequence_id: int, parents: List[int], num_heads: int,
                 region: str, offsets: Sequence[int]):
        self._lib = lib
        array = (ctypes.c_int32 * len(parents))(*parents)
        self.handle = lib.mlaverify_native_item_create(sequence_id, array, len(parents), num_heads,
                                                       region.encode(), *offsets)
        if not self.handle:
            raise ValueError("the native library refused the item")

    def __del__(self):
        if getattr(self, "handle", None):
            self._lib.mlaverify_native_item_destroy(self.handle)
            self.handle = None


class _Call:
    """The prepared arguments of one list of placed items: their handles in
    a C array, the regions to prepare, and where the outputs are read."""

    __slots__ = ("items", "array", "prefix_lens_type", "regions", "outputs")

    def __init__(self, items: List[_Item], regions: list, outputs: list):
        self.items = items  # keeps the handles alive
        self.array = (ctypes.c_void_p * len(items))(*[i.handle for i in items])
        # Each call gets its own (threads may make the same call at once).
        self.prefix_lens_type = ctypes.c_int64 * len(items)
        self.regions = regions
        self.outputs = outputs


class _Memo:
    """A thread's last call of verify(layer, items): the items it was made
    from, what each held then, and the items bound (a BoundVerify). A
    scheduler sends the same items on every layer of a step; when nothing
    they hold changed, the bound call is made again as bind()'s would be."""

    __slots__ = ("fields", "bound")

    def __init__(self, items: Sequence[_wire.VerifyItem], bound: "BoundVerify"):
        self.fields = [self._fields(item) for item in items]
        self.bound = bound

    @staticmethod
    def _fields(item: _wire.VerifyItem) -> tuple:
        """What the call was built from: the objects compared by identity,
        then the values compared by value."""
        p = item.shm
        return ((item, item.q, item.draft_kv, p),
                (item.sequence_id, tuple(item.parents), p.region, p.q_offset, p.draft_kv_offset,
                 p.out_offset, p.lse_offset))

    def matches(self, items: Sequence[_wire.VerifyItem], regions: dict) -> bool:
        if len(items) != len(self.fields):
            return False
        for item, (objects, values) in zip(items, self.fields):
            if item is not objects[0] or item.shm is None:
                return False
            now_objects, now_values = self._fields(item)
            if any(a is not b for a, b in zip(now_objects, objects)) or now_values != values:
                return False
        return self.bound.unregistered(regions) is None


class NativeClient:
    """The C++ client behind a VerifyClient's native calls: one connection,
    made on first use (VerifyClient.native_verify / native_bind /
    native_stream)."""

    def __init__(self, client: Any):
        lib = load()
        if client._credentials is not None:
            raise ValueError("the native path speaks plaintext only: TLS credentials are grpcio "
                             "objects the C++ client cannot take (use verify / verify_stream)")
        settings = client._pool.settings
        self._lib = lib
        self._client = client
        self._calls: dict = {}
        self._streams: "weakref.WeakSet[NativeVerifyStream]" = weakref.WeakSet()
        self._local = threading.local()  # each thread's error message buffer (unary calls)
        # Unary calls in flight: the C++ client must not go while one runs.
        self._guard = threading.Lock()
        self._in_flight = 0
        handle = ctypes.c_void_p()
        message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        token = ""
        for key, value in client._metadata or ():
            if key == "authorization":
                token = value[len("Bearer "):]
        code = lib.mlaverify_native_client_create(
            client.target.encode(), client._timeout or 0.0, token.encode(),
            int(settings.wait_for_ready), settings.keepalive_time_s or 0.0,
            settings.keepalive_timeout_s, int(settings.keepalive_permit_without_calls),
            settings.max_message_bytes, ctypes.byref(handle), message, _MESSAGE_BYTES)
        if code != 0:
            _raise(code, message, "native client")
        self.handle = handle.value

    def close(self) -> None:
        """Cancels its open streams and closes the connection. RuntimeError
        while a native call is in flight (the C++ client would be freed under
        it): let the calls return first."""
        with self._guard:
            if not self.handle:
                return
            if self._in_flight:
                raise RuntimeError(f"{self._in_flight} native call(s) in flight: let them return "
                                   "before closing the client")
            for stream in list(self._streams):
                stream._destroy(blocking=False)
            self._calls.clear()
            self._lib.mlaverify_native_client_destroy(self.handle)
            self.handle = None

    def _prepare(self, layer: int, items: Sequence[_wire.VerifyItem],
                 softmax_scale: float) -> tuple:
        """The checks of VerifyClient.verify and the items bound (this
        thread's last ones when they still hold the same: a scheduler
        repeats them on every layer of a step); (bound, whether the inputs
        were just written by the checks)."""
        g = self._client.geometry
        _check_layer(g, layer)
        memo = getattr(self._local, "memo", None)
        if memo is not None and memo.matches(items, g.regions):
            if not math.isfinite(softmax_scale):
                raise ValueError(f"softmax_scale {softmax_scale} is not finite")
            return memo.bound, False
        bound = self.bind(items, softmax_scale)
        self._local.memo = _Memo(items, bound)
        return bound, True

    def _build(self, items: Sequence[_wire.VerifyItem], softmax_scale: float) -> tuple:
        """Checks `items` (all but the layer), writes their inputs, and
        returns the prepared call, the regions it uses as (name, view) and
        the inputs to copy again per call (those not already in place)."""
        g = self._client.geometry
        if not 1 <= len(items) <= g.max_batch:
            raise ValueError(f"{len(items)} items, the server takes 1..{g.max_batch} per Verify")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale {softmax_scale} is not finite")
        keys, written, seen, copies, used = [], [], set(), [], []
        for k, item in enumerate(items):
            what = f"items[{k}] (sequence {item.sequence_id})"
            if item.sequence_id in seen:
                raise ValueError(f"{what}: sequence twice in one Verify")
            seen.add(item.sequence_id)
            if item.shm is None:
                raise ValueError(f"{what}: the native path takes items placed in shared memory "
                                 "only (VerifyItem.shm); use verify / verify_stream for inline "
                                 "tensors")
            parents = _wire.check_parents(item.parents, g.max_draft_len, what)
            p = item.shm
            region = g._region(p.region, what)
            q_shape, kv_shape = [len(parents), g.num_heads, _wire.LATENT_DIM], \
                [len(parents), _wire.LATENT_DIM]
            for offset, value, shape, name in ((p.q_offset, item.q, q_shape, f"{what} q"),
                                               (p.draft_kv_offset, item.draft_kv, kv_shape,
                                                f"{what} draft_kv")):
                region.write(offset, value, shape, name)
                if not region.in_place(offset, value, shape):
                    copies.append((region, offset, value, shape, name))
            if (p.region, region) not in used:
                used.append((p.region, region))
            keys.append((id(region), region.ref_offset(0), p.region, p.q_offset,
                         p.draft_kv_offset, p.out_offset, p.lse_offset, item.sequence_id,
                         tuple(parents)))
            written.append((region, p, item.sequence_id, parents))
        key = tuple(keys)
        call = self._calls.get(key)
        if call is None:
            if len(self._calls) >= 4096:
                self._calls.clear()
            call = self._calls[key] = self._new_call(written)
        return call, used, copies

    def _new_call(self, written: list) -> _Call:
        g = self._client.geometry
        items, regions, outputs = [], [], []
        for region, p, sequence_id, parents in written:
            offsets = [region.ref_offset(o) for o in (p.q_offset, p.draft_kv_offset, p.out_offset,
                                                       p.lse_offset)]
            items.append(_Item(self._lib, sequence_id, parents, g.num_heads, p.region, offsets))
            if region not in regions:
                regions.append(region)
            n = len(parents)
            out_shape, lse_shape = [n, g.num_heads, _wire.VALUE_DIM], [n, g.num_heads]
            # Views of a CUDA region are made once (the same objects every call).
            views = (region.read(offsets[2], tensors.BF16, out_shape, self._client._output),
                     region.read(offsets[3], tensors.FP32, lse_shape, self._client._output)) \
                if region.outputs_are_views else None
            outputs.append((sequence_id, region, offsets[2], out_shape, offsets[3], lse_shape,
                            views))
        return _Call(items, regions, outputs)

    def verify(self, layer: int, items: Sequence[_wire.VerifyItem], softmax_scale: float = 0.0,
               stream: Optional[int] = None, message: Optional[ctypes.Array] = None,
               rpc: str = "Verify", timeout: Optional[float] = None,
               metadata: _wire.Metadata = None) -> List[_wire.VerifyResult]:
        """One layer's Verify of placed items, unary or over `stream` (a
        stream handle, with its message buffer; the stream keeps its client
        open while it is). A unary call takes its own `timeout` (seconds;
        None: the client's) and `metadata` (as VerifyClient's calls)."""
        bound, written = self._prepare(layer, items, softmax_scale)
        return bound._write_and_send(layer, softmax_scale, stream, message, rpc,
                                     copy_inputs=not written, timeout=timeout,
                                     metadata=metadata)

    def bind(self, items: Sequence[_wire.VerifyItem], softmax_scale: float = 0.0,
             wait_for_stream: bool = True, stream: Optional["NativeVerifyStream"] = None
             ) -> "BoundVerify":
        """`items` checked once for the layers of a step (BoundVerify), sent
        unary or over `stream`."""
        call, used, copies = self._build(items, softmax_scale)
        return BoundVerify(self, stream, call, used, copies, softmax_scale, wait_for_stream)

    def _send(self, call: _Call, layer: int, softmax_scale: float, wait_for_stream: bool,
              stream: Optional[int], message: Optional[ctypes.Array],
              rpc: str, timeout: Optional[float] = None,
              metadata: _wire.Metadata = None) -> List[_wire.VerifyResult]:
        """Sends a prepared call (its inputs already written) and reads its
        results."""
        if stream is not None and (timeout is not None or metadata):
            raise ValueError("a stream message takes no timeout or metadata of its own (the "
                             "stream's metadata goes with its opening)")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout {timeout!r}: need seconds > 0 (None: the client's)")
        pairs, pair_count = _c_metadata(metadata)
        if message is None:
            message = getattr(self._local, "message", None)
            if message is None:
                message = self._local.message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        if wait_for_stream:
            for region in call.regions:
                # CUDA regions: the inputs were written on the device's current
                # stream; the server reads them once the request arrives.
                region.prepare()
        prefix_lens = call.prefix_lens_type()
        with self._guard:
            handle = self.handle
            if not handle:
                raise VerifyError(grpc.StatusCode.FAILED_PRECONDITION, "the client is closed", rpc)
            self._in_flight += 1
        try:
            code = self._lib.mlaverify_native_verify(handle, stream, layer, call.array,
                                                     len(call.items), softmax_scale,
                                                     float(timeout or 0.0), pairs, pair_count,
                                                     prefix_lens, message, _MESSAGE_BYTES)
        finally:
            with self._guard:
                self._in_flight -= 1
        if code != 0:
            _raise(code, message, rpc)
        output = self._client._output
        results = []
        for k, (seq, region, out_at, out_shape, lse_at, lse_shape, views) in \
                enumerate(call.outputs):
            out, lse = views if views is not None else (
                region.read(out_at, tensors.BF16, out_shape, output),
                region.read(lse_at, tensors.FP32, lse_shape, output))
            results.append(_wire.VerifyResult(sequence_id=seq, out=out, lse=lse,
                                              prefix_len=prefix_lens[k]))
        return results


def _c_metadata(metadata: _wire.Metadata):
    """The caller's pairs for the C functions: (keys and values alternating
    as a char* array, the pair count), or (None, 0). Checked as the gRPC
    calls check them; the C++ client merges them with its token."""
    pairs = _wire.merge_metadata(None, metadata) or ()
    if not pairs:
        return None, 0
    flat = []
    for key, value in pairs:
        flat.append(key.encode())
        flat.append(value if isinstance(value, bytes) else str(value).encode())
    # The array keeps the bytes objects it points into alive.
    return (ctypes.c_char_p * len(flat))(*flat), len(pairs)


class BoundVerify:
    """Placed items bound for the layers of one step: the checks, the
    placement lookups and the prepared C arguments are made once by bind();
    each verify(layer) then only checks the layer, copies in the inputs that
    are not the placements' own views (from the same tensor objects, so
    their new contents go), waits for a CUDA region's current stream (unless
    bound with wait_for_stream=False) and makes the call. Made by
    NativeVerifyStream.bind (over that stream) or VerifyClient.native_bind
    (unary calls).

    The bound items must not change (sequence, parents, placement, which
    tensor objects): bind again for the next step. A region unregistered or
    registered again under its name since bind() makes verify raise
    ValueError without sending anything.

    wait_for_stream=False: the caller orders its writes of the inputs (and
    any reader of the last outputs) before each call itself, e.g. it wrote
    them with synchronous copies or synchronized the stream that wrote them;
    the call then skips the wait for the current CUDA stream (10-25 us per
    call from Python on the H200, bench/NOTES.md). Inputs that are not the
    placements' own views are copied in by the call itself and still waited
    for. Getting this wrong lets the server read inputs still being written.
    """

    __slots__ = ("_native", "_stream", "_call", "_regions", "_copies", "_softmax_scale",
                 "_wait", "_waits_for_copies")

    def __init__(self, native: NativeClient, stream: Optional["NativeVerifyStream"], call: _Call,
                 regions: list, copies: list, softmax_scale: float, wait_for_stream: bool):
        self._native = native
        self._stream = stream
        self._call = call
        self._regions = regions
        self._copies = copies
        self._softmax_scale = float(softmax_scale)
        self._wait = bool(wait_for_stream)
        # Regions whose writes are queued on a stream (CUDA) that this call
        # itself copies inputs into.
        self._waits_for_copies = []
        for region, *_ in copies:
            if region.writes_are_queued and region not in self._waits_for_copies:
                self._waits_for_copies.append(region)

    def unregistered(self, registered: dict) -> Optional[str]:
        """The first region the items use that is not registered
        (`registered`: the client's name -> view) as it was when they were
        bound; None when all are."""
        for name, view in self._regions:
            if registered.get(name) is not view:
                return name
        return None

    def verify(self, layer: int, *, timeout: Optional[float] = None,
               metadata: _wire.Metadata = None) -> List[_wire.VerifyResult]:
        """Layer `layer`'s Verify of the bound items; results in their order.
        Unary (bound by VerifyClient.native_bind): the call's own `timeout`
        and `metadata`; over a stream neither (ValueError)."""
        g = self._native._client.geometry
        _check_layer(g, layer)
        name = self.unregistered(g.regions)
        if name is not None:
            raise ValueError(f"region {name!r} is no longer registered as it was when the "
                             "items were bound: bind them again")
        stream = self._stream
        if stream is None:
            return self._write_and_send(layer, self._softmax_scale, None, None, "Verify",
                                        timeout=timeout, metadata=metadata)
        if timeout is not None or metadata:
            raise ValueError("a stream message takes no timeout or metadata of its own (the "
                             "stream's metadata goes with its opening)")
        with stream._lock:  # the inputs written too: threads sharing the stream take turns
            return self._write_and_send(layer, self._softmax_scale, stream._open_handle(),
                                        stream._message, "VerifyStream")

    def _write_and_send(self, layer: int, softmax_scale: float, handle: Optional[int],
                        message: Optional[ctypes.Array], rpc: str,
                        copy_inputs: bool = True, timeout: Optional[float] = None,
                        metadata: _wire.Metadata = None) -> List[_wire.VerifyResult]:
        """Copies in the inputs not in place (unless the caller just wrote
        them), waits as bound, sends."""
        if copy_inputs:
            for region, offset, value, shape, what in self._copies:
                region.write(offset, value, shape, what)
        if not self._wait:
            # Copies this call queued itself are waited for whatever the
            # caller ordered: only it knows they were made.
            for region in self._waits_for_copies:
                region.prepare()
        return self._native._send(self._call, layer, softmax_scale, self._wait, handle, message,
                                  rpc, timeout, metadata)


class NativeVerifyStream:
    """A VerifyStream of the C++ client: verify() sends one layer's Verify and
    returns its results (one call in flight; calls from several threads take
    turns; like the C++ session, a call has no deadline of its own). An
    in-band error raises VerifyError and the stream goes on; a broken stream
    raises its final status from then on. Use as a context manager, or call
    close()."""

    def __init__(self, native: NativeClient, metadata: _wire.Metadata = None):
        """`metadata`: sent with the stream's opening (as VerifyClient's
        calls take it)."""
        self._native = native
        self._lib = native._lib
        handle = ctypes.c_void_p()
        message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        pairs, pair_count = _c_metadata(metadata)
        code = self._lib.mlaverify_native_stream_open(native.handle, pairs, pair_count,
                                                      ctypes.byref(handle), message,
                                                      _MESSAGE_BYTES)
        if code != 0:
            _raise(code, message, "VerifyStream")
        self._handle = handle.value
        self._message = message
        # Held for each call and by close: the C++ session takes one call at
        # a time, and must not be freed under one.
        self._lock = threading.Lock()
        native._streams.add(self)

    def verify(self, layer: int, items: Sequence[_wire.VerifyItem],
               softmax_scale: float = 0.0) -> List[_wire.VerifyResult]:
        """One layer's Verify of placed items; results in the order of `items`."""
        with self._lock:
            return self._native.verify(layer, items, softmax_scale, self._open_handle(),
                                       self._message, "VerifyStream")

    def bind(self, items: Sequence[_wire.VerifyItem], softmax_scale: float = 0.0,
             wait_for_stream: bool = True) -> BoundVerify:
        """`items` checked once for the layers of a step: the BoundVerify's
        verify(layer) sends them over this stream with less Python work per
        call than verify(layer, items). ValueError as verify's checks."""
        with self._lock:
            self._open_handle()
        return self._native.bind(items, softmax_scale, wait_for_stream, self)

    def _open_handle(self) -> int:
        """The C++ session's handle; FAILED_PRECONDITION once the stream is
        closed. Call with the lock held."""
        if self._handle is None:
            raise VerifyError(grpc.StatusCode.FAILED_PRECONDITION, "the stream is closed",
                              "VerifyStream")
        return self._handle

    def close(self) -> None:
        """Half-closes the stream; raises VerifyError when the server ended it
        with an error."""
        with self._lock:
            if self._handle is None:
                return
            message = ctypes.create_string_buffer(_MESSAGE_BYTES)
            code = self._lib.mlaverify_native_stream_close(self._handle, message, _MESSAGE_BYTES)
            self._lib.mlaverify_native_stream_destroy(self._handle)
            self._handle = None
        if code != 0:
            _raise(code, message, "VerifyStream")

    def __enter__(self) -> "NativeVerifyStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _destroy(self, blocking: bool = True) -> None:
        """Cancels the stream if it is open (before its client goes);
        RuntimeError when not blocking and a call holds it."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return  # __init__ failed before the stream existed
        if not lock.acquire(blocking):
            raise RuntimeError("a call on a native stream is in flight: let it return before "
                               "closing the client")
        try:
            if self._handle:
                self._lib.mlaverify_native_stream_destroy(self._handle)
                self._handle = None
        finally:
            lock.release()

    def __del__(self):
        self._destroy()
