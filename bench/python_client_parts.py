#!/usr/bin/env python3
"""Where a Python Verify's client-side time goes: each part of one call of
the pure-Python and the native path timed alone, in a loop, against a
running server (one sequence, layer 0's pending tree verified again and
again, one item placed in system shared memory, or with --plane cuda-shm in
a CUDA region as torch views: the server needs --allow-client-shm). p50 and mean microseconds per call of each part, the
parts called in turn:

  request build / answer decode  the package's own code (Geometry.verify_request,
                                 verify_results)
  grpcio unary (stub)            grpcio's unary call of a built request, alone
  verify / stream.verify         the whole pure-Python call, unary / VerifyStream
  native prepare (checks)        the native path's Python side before the C call
  region prepare (sync)          the region's wait for the current torch stream (cuda-shm)
  native C call (stream)         libmlaverify_native.so's Verify on a stream, alone
  native stream.verify / native_verify  the whole native call, stream / unary
  native bound.verify            the whole native call of items bound once (stream.bind)

    PYTHONPATH=build/client/python python3 bench/python_client_parts.py --target 127.0.0.1:50051
"""

import argparse
import sys
import time

import numpy as np

from mlaverify import SharedMemoryRegion, VerifyClient, VerifyItem, bf16_from_float32, place_item
from mlaverify.shm import item_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--drafts", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000, help="per part")
    ap.add_argument("--parts", default="",
                    help="comma-separated part names to run (default: all); one part alone "
                         "runs back to back, with no other part's work between its calls")
    ap.add_argument("--plane", choices=["shm", "cuda-shm"], default="shm",
                    help="cuda-shm: the item's tensors are torch views of a CUDA region on "
                         "cuda:0 (in place: no copy per call)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)

    def bf16(*shape):
        return bf16_from_float32(rng.standard_normal(shape).astype(np.float32) * 0.5)

    with VerifyClient(args.target, timeout=60) as client:
        info = client.server_info()
        n, heads = min(args.drafts, info.max_draft_len), info.num_heads
        seq = client.create_sequence("python_client_parts")
        client.append_prompt(seq, bf16(info.num_layers, 64, 576))
        place = place_item("py-parts", 0, n, heads)
        q, draft_kv = bf16(n, heads, 576), bf16(n, 576)
        if args.plane == "cuda-shm":
            import torch
            from mlaverify import CudaSharedMemoryRegion
            region = CudaSharedMemoryRegion(item_bytes(n, heads), device="cuda:0")
            client.register_cuda_shared_memory("py-parts", region)
            views = region.item_views(place)
            views.q.copy_(torch.from_numpy(q.view(np.int16)).view(torch.bfloat16))
            views.draft_kv.copy_(torch.from_numpy(draft_kv.view(np.int16)).view(torch.bfloat16))
            q, draft_kv = views.q, views.draft_kv
        else:
            region = SharedMemoryRegion(item_bytes(n, heads))
            client.register_system_shared_memory("py-parts", region)
        item = VerifyItem(seq, q, draft_kv, [-1] + list(range(n - 1)), shm=place)
        g = client.geometry
        request = g.verify_request(0, [item], 0.0, 1)
        response = client._stub.Verify(request)

        from mlaverify import native
        stream = client.verify_stream()
        parts = [("request build", lambda: g.verify_request(0, [item], 0.0, 1)),
                 ("answer decode", lambda: g.verify_results(request, response, client._output)),
                 ("grpcio unary (stub)", lambda: client._stub.Verify(request)),
                 ("verify", lambda: client.verify(0, [item])),
                 ("stream.verify", lambda: stream.verify(0, [item]))]
        fast = None
        if native.available():
            fast = client.native_stream()
            fast.verify(0, [item])
            nc = client._native
            bound = fast.bind([item])
            call = bound._call  # the prepared C arguments
            lens, msg = call.prefix_lens_type(), fast._message
            view = g._region("py-parts", "parts")
            parts += [("native prepare (checks)", lambda: nc._prepare(0, [item], 0.0)),
                      ("region prepare (sync)", view.prepare),
                      ("native C call (stream)", lambda: nc._lib.mlaverify_native_verify(
                          nc.handle, fast._handle, 0, call.array, 1, 0.0, lens, msg, len(msg))),
                      ("native stream.verify", lambda: fast.verify(0, [item])),
                      ("native bound.verify", lambda: bound.verify(0)),
                      ("native_verify", lambda: client.native_verify(0, [item]))]
        else:
            print("native path: no library (mlaverify/lib/libmlaverify_native.so)")
        if args.parts:
            wanted = [w.strip() for w in args.parts.split(",")]
            unknown = [w for w in wanted if w not in {name for name, _ in parts}]
            if unknown:
                # The region goes first: a later run may register the same name.
                client.unregister_system_shared_memory("py-parts")
                ap.error(f"unknown part(s) {unknown}; parts: {[name for name, _ in parts]}")
            parts = [(name, fn) for name, fn in parts if name in wanted]
        # Round robin, one call of each part in turn, so that a change of the
        # host's load or the server's pace weighs on every part alike.
        times = [[] for _ in parts]
        for k in range(args.calls + 100):
            for (_, fn), t in zip(parts, times):
                t0 = time.perf_counter()
                fn()
                if k >= 100:
                    t.append(time.perf_counter() - t0)
        print(f"{args.plane}, N={n}, H={heads}, {args.calls} calls of each part in turn; "
              "us per call:")
        for (name, _), t in zip(parts, times):
            t = np.array(t) * 1e6
            print(f"  {name:26s} p50 {np.percentile(t, 50):8.1f}  mean {t.mean():8.1f}")
        stream.close()
        if fast is not None:
            fast.close()
        client.unregister_system_shared_memory("py-parts")
        region.close()
        client.release_sequence(seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
