#!/usr/bin/env python3
"""A speculative-decoding step loop against an mlaverify server, each layer's
answer checked against the NumPy reference of the math.

One sequence: create it, upload a random prompt's latent KV (every layer),
then per decode step send a random draft tree's queries and draft KV for
every layer over one VerifyStream, check out/lse, accept a random
root-to-node path, commit it, and at the end release the sequence.

    PYTHONPATH=build/client/python python3 client/python/examples/verify_layers.py \\
        --target 127.0.0.1:50051 --prompt-len 512 --steps 3 --drafts 8
"""

import argparse
import sys

import numpy as np

from mlaverify import VerifyClient, VerifyItem, bf16_from_float32, float32_from_bf16
from mlaverify.reference import relative_error, verify_reference


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--drafts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rel-err", type=float, default=1e-2)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)

    def bf16(*shape):  # random bf16 bits, values ~N(0, 0.25)
        return bf16_from_float32(rng.standard_normal(shape).astype(np.float32) * 0.5)

    with VerifyClient(args.target) as client:
        info = client.server_info()
        layers, heads, scale = info.num_layers, info.num_heads, info.default_softmax_scale
        n = min(args.drafts, info.max_draft_len)
        print(f"server {args.target}: {info.backend}, {layers} layers, {heads} heads, "
              f"page {info.page_size}, N={n}")

        seq = client.create_sequence("verify_layers.py")
        prompt = bf16(layers, args.prompt_len, 576)
        client.append_prompt(seq, prompt)
        committed = [prompt[layer] for layer in range(layers)]  # our copy of the KV, per layer
        worst = 0.0
        with client.verify_stream() as stream:
            for step in range(args.steps):
                parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
                items = [VerifyItem(seq, bf16(n, heads, 576), bf16(n, 576), parents)
                         for _ in range(layers)]
                # Send every layer ahead, then read the answers in order.
                futures = [stream.submit(layer, [items[layer]]) for layer in range(layers)]
                for layer, future in enumerate(futures):
                    (result,) = future.result(timeout=60)
                    want_out, want_lse = verify_reference(committed[layer], items[layer].q,
                                                          items[layer].draft_kv, parents, scale)
                    out = float32_from_bf16(result.out)
                    err = relative_error(out, want_out)
                    lse_err = float(np.abs(result.lse - want_lse).max())
                    ok = np.isfinite(out).all() and err <= args.max_rel_err
                    worst = max(worst, err) if np.isfinite(err) else float("nan")
                    print(f"step {step} layer {layer:3d}: P={result.prefix_len} rel err {err:.2e} "
                          f"lse err {lse_err:.2e} {'ok' if ok else 'FAIL'}")
                    if not ok:
                        return 1
                # Accept the root path of a random draft: what a sampler would pick.
                node, accepted = int(rng.integers(0, n)), []
                while node != -1:
                    accepted.insert(0, node)
                    node = parents[node]
                length = client.commit(seq, accepted).length
                for layer in range(layers):
                    committed[layer] = np.concatenate([committed[layer],
                                                       items[layer].draft_kv[accepted]])
                print(f"step {step}: accepted {accepted}, length {length}")
        freed = client.release_sequence(seq)
        print(f"PASS: {args.steps} steps x {layers} layers, max rel err {worst:.2e}; "
              f"released {freed} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
