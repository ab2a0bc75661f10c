#!/usr/bin/env python3
"""Per-layer Verify latency of the Python client, measured as
`mlaverify-client load --concurrency 1` measures the C++ client's: one
sequence with a prompt of --prompt-len tokens, per step a random tree of
--drafts drafts verified on every layer (one call in flight, over one
VerifyStream with --stream), a random root path committed; each Verify timed
from before the request is built to its decoded results.

    PYTHONPATH=build/client/python python3 bench/python_client_latency.py \\
        --target 127.0.0.1:50051 --plane cuda-shm --prompt-len 16384 --drafts 16 --stream \\
        --duration-s 5 --json py-cuda-shm.json

Planes (as `load --data-plane`): inline (bytes in the messages), shm (a /dev/shm region;
servers with --allow-client-shm), cuda-shm (a torch CUDA region, q and
draft_kv written in place once; results read in place).

--native: the calls go through the native path (VerifyClient.native_stream /
native_verify: the C++ client library by ctypes) instead of grpcio; shm and
cuda-shm only. Exits 2 when the native library is not there. --bind (with
--native): each step's item is bound once (NativeVerifyStream.bind /
VerifyClient.native_bind) and every layer calls the BoundVerify;
--no-stream-wait (with --bind, cuda-shm): bound with wait_for_stream=False,
as the C++ client's load makes no wait per call either (the inputs were
written once, synchronously, before the first call).
"""

import argparse
import json
import sys
import time

import numpy as np

from mlaverify import SharedMemoryRegion, VerifyClient, VerifyItem, bf16_from_float32, place_item
from mlaverify.shm import item_bytes


def random_tree(rng, n):
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


def root_path(parents, node):
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--plane", choices=["inline", "shm", "cuda-shm"], default="inline")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--drafts", type=int, default=16)
    ap.add_argument("--stream", action="store_true", help="over one VerifyStream (else unary)")
    ap.add_argument("--native", action="store_true",
                    help="through the native path (the C++ client; shm and cuda-shm)")
    ap.add_argument("--bind", action="store_true",
                    help="with --native: bind each step's item once, call the BoundVerify per "
                         "layer")
    ap.add_argument("--no-stream-wait", action="store_true",
                    help="with --bind: bound with wait_for_stream=False (no wait for the current "
                         "CUDA stream per call)")
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    if args.bind and not args.native:
        ap.error("--bind takes --native")
    if args.no_stream_wait and not args.bind:
        ap.error("--no-stream-wait takes --bind")
    if args.native:
        from mlaverify import native
        if args.plane == "inline":
            ap.error("--native takes --plane shm or cuda-shm (placed items only)")
        try:
            native.load()
        except native.NativeUnavailableError as e:
            print(f"python_client_latency: {e}", file=sys.stderr)
            return 2
    rng = np.random.default_rng(args.seed)

    with VerifyClient(args.target, timeout=60) as client:
        info = client.server_info()
        layers, heads = info.num_layers, info.num_heads
        n = min(args.drafts, info.max_draft_len)

        def bf16(*shape):
            return bf16_from_float32(rng.standard_normal(shape).astype(np.float32) * 0.5)

        seq = client.create_sequence("python_client_latency")
        # A 256-token block of random rows repeated: drawing 16K tokens x 61
        # layers of normals takes NumPy tens of seconds and GBs; the latency
        # does not depend on the values.
        block = bf16(layers, min(args.prompt_len, 256), 576)
        reps = -(-args.prompt_len // block.shape[1])
        client.append_prompt(seq, np.tile(block, (1, reps, 1))[:, :args.prompt_len])
        q, draft_kv = bf16(n, heads, 576), bf16(n, 576)
        place, region = None, None
        if args.plane == "shm":
            region = SharedMemoryRegion(item_bytes(n, heads))
            client.register_system_shared_memory("py-latency", region)
            place = place_item("py-latency", 0, n, heads)
        elif args.plane == "cuda-shm":
            import torch
            from mlaverify import CudaSharedMemoryRegion
            region = CudaSharedMemoryRegion(item_bytes(n, heads), device="cuda:0")
            client.register_cuda_shared_memory("py-latency", region)
            place = place_item("py-latency", 0, n, heads)
            views = region.item_views(place)
            views.q.copy_(torch.from_numpy(q.view(np.int16)).view(torch.bfloat16))
            views.draft_kv.copy_(torch.from_numpy(draft_kv.view(np.int16)).view(torch.bfloat16))
            q, draft_kv = views.q, views.draft_kv  # in place: nothing copied per call
            torch.cuda.synchronize()  # the inputs are written before the first call

        if args.native:
            stream = client.native_stream() if args.stream else None
            call = stream.verify if stream else client.native_verify
        else:
            stream = client.verify_stream() if args.stream else None
            call = stream.verify if stream else client.verify
        latencies, steps, length = [], 0, args.prompt_len
        start = time.perf_counter()
        measure_from = start + args.warmup_s
        end = measure_from + args.duration_s
        opened = None  # ServerInfo when the measured window opened
        while time.perf_counter() < end:
            if opened is None and time.perf_counter() >= measure_from:
                opened = client.server_info()
            parents = random_tree(rng, n)
            item = VerifyItem(seq, q, draft_kv, parents, shm=place)
            bind_s = 0.0  # counted in the step's first call (its checks are made here)
            if args.bind:
                wait = not args.no_stream_wait
                b0 = time.perf_counter()
                bound = stream.bind([item], wait_for_stream=wait) if stream else \
                    client.native_bind([item], wait_for_stream=wait)
                bind_s = time.perf_counter() - b0
            for layer in range(layers):
                t0 = time.perf_counter()
                (result,) = bound.verify(layer) if args.bind else call(layer, [item])
                t1 = time.perf_counter() + (bind_s if layer == 0 else 0.0)
                if t0 >= measure_from:
                    latencies.append((t1 - t0) * 1e3)
            accepted = root_path(parents, int(rng.integers(0, n)))
            length = client.commit(seq, accepted).length
            steps += 1
            if length + n > info.max_sequence_len:
                break
        closed = client.server_info()
        if stream:
            stream.close()
        if place is not None:
            client.unregister_system_shared_memory("py-latency")
            region.close()
        client.release_sequence(seq)

    lat = np.array(latencies)
    report = {
        "client": "python-native" if args.native else "python", "plane": args.plane,
        "bound": args.bind, "stream_wait": not args.no_stream_wait,
        "stream": args.stream,
        "prompt_len": args.prompt_len, "drafts": n, "num_layers": layers, "num_heads": heads,
        "verify_calls": len(lat), "steps": steps,
        "latency_ms": {"p50": float(np.percentile(lat, 50)), "p90": float(np.percentile(lat, 90)),
                       "p99": float(np.percentile(lat, 99)), "mean": float(lat.mean()),
                       "max": float(lat.max())},
    }
    if opened is not None and closed.verify_calls_timed > opened.verify_calls_timed:
        # As `load` reports it: the server's own mean time per Verify over the
        # measured window (what the clients' latencies add to it is theirs and
        # the transport's).
        calls = closed.verify_calls_timed - opened.verify_calls_timed
        report["server_split_us"] = {
            "calls": calls,
            "server": (closed.verify_server_seconds_total -
                       opened.verify_server_seconds_total) / calls * 1e6}
    l = report["latency_ms"]
    print(f"{report['client']} {args.plane}{' stream' if args.stream else ''}: {len(lat)} calls, "
          f"latency ms p50 {l['p50']:.3f} p90 {l['p90']:.3f} p99 {l['p99']:.3f} (mean {l['mean']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
