#!/usr/bin/env python3
"""Host model of the attention kernel's fp8 tile producer.

Mirrors by hand issue_tile's fp8 branch and ConvertFp8Row
(kernels/verify_pipelined_kernel.cuh) with the slot functions of
kernels/verify_config.cuh: the 128 loader threads (16 rows x 8 lanes) place
their cp.async pieces of random 656-byte rows into an 18,432-byte stage, then
convert in place, the lanes of a warp interleaved in random order between the
two __syncwarp. Checks, for many random orders:

  - every 16-byte piece lands in a slot no other piece of the tile uses;
  - a thread reads only bytes its own cp.async wrote, except the row's scale
    chunk (lane 0's), and only between the first and second __syncwarp;
  - no read sees a byte some thread has already overwritten;
  - the stage ends as the swizzled bf16 tile a bf16 pool's cp.async would
    have written, each value e4m3(code) x scale in fp32 rounded to bf16.

    fp8_producer_model.py                       # exits non-zero on a fault
    fp8_producer_model.py --plant scale-early   # must report the planted fault
    fp8_producer_model.py --plant rope-unswizzled

No dependencies beyond python3.
"""
import argparse
import random
import struct
import sys

ROW_BYTES = 1152
ROWS = 16
LANES = 8
STAGE_BYTES = ROWS * ROW_BYTES
FP8_ROW_BYTES = 656
SCALE_OFFSET = 512
ROPE_OFFSET = 528


def swizzled_chunk(row, chunk):
    return (chunk & ~7) | ((chunk ^ row) & 7)


def code_slot(lane, m):
    return 2 * lane + 16 * m


def slot_base(row, lane):  # Fp8SlotBase: row-relative offset of chunk 2l
    return row * ROW_BYTES + swizzled_chunk(row, code_slot(lane, 0)) * 16


def e4m3_to_float(code):
    exponent = (code >> 3) & 15
    mantissa = code & 7
    if exponent == 15 and mantissa == 7:
        v = float("nan")
    elif exponent == 0:
        v = mantissa * 2.0 ** -9
    else:
        v = (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return -v if code & 0x80 else v


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16_bits(x):
    """Round-to-nearest-even bf16 of the fp32 value x (finite)."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


class Fault(Exception):
    pass


def random_row(rng):
    codes = [rng.choice([c for c in range(256) if (c & 0x7F) != 0x7F]) for _ in range(512)]
    scales = [f32(rng.uniform(1e-4, 4.0)) for _ in range(4)]
    rope = [rng.getrandbits(16) & 0x7F7F for _ in range(64)]  # finite bf16 patterns
    raw = bytes(codes) + struct.pack("<4f", *scales) + struct.pack("<64H", *rope)
    assert len(raw) == FP8_ROW_BYTES
    return raw


def expected_tile(rows):
    tile = bytearray(STAGE_BYTES)
    for r, raw in enumerate(rows):
        scales = struct.unpack("<4f", raw[SCALE_OFFSET:SCALE_OFFSET + 16])
        values = []
        for d in range(512):
            values.append(bf16_bits(f32(f32(e4m3_to_float(raw[d])) * scales[d // 128])))
        values += list(struct.unpack("<64H", raw[ROPE_OFFSET:]))
        for c in range(72):
            off = r * ROW_BYTES + swizzled_chunk(r, c) * 16
            tile[off:off + 16] = struct.pack("<8H", *values[8 * c:8 * c + 8])
    return tile


def run(rng, plant):
    rows = [random_row(rng) for _ in range(ROWS)]
    stage = bytearray(b"\xAA" * STAGE_BYTES)
    writer = [None] * STAGE_BYTES     # (row, lane) whose cp.async wrote the byte
    overwritten = [False] * STAGE_BYTES

    # ---- issue_tile, fp8 branch: src = row start + 16 l (lane_base) ----
    for r in range(ROWS):
        for lane in range(LANES):
            src = 16 * lane
            slot = slot_base(r, lane)
            pieces = [(slot + 256 * m, src + 128 * m) for m in range(4)]
            if lane == 0:
                pieces.append(((slot ^ 16) + 768, SCALE_OFFSET))
            rope_chunk = lane if plant == "rope-unswizzled" else (lane ^ r) & 7
            pieces.append((r * ROW_BYTES + rope_chunk * 16 + 8 * 128, src + ROPE_OFFSET))
            for dst, s in pieces:
                for k in range(16):
                    if writer[dst + k] is not None:
                        raise Fault(f"row {r} lane {lane}: slot at {dst} already holds a piece")
                    writer[dst + k] = (r, lane)
                stage[dst:dst + 16] = rows[r][s:s + 16]

    def read(r, lane, addr, shared_ok):
        for k in range(16):
            if overwritten[addr + k]:
                raise Fault(f"row {r} lane {lane} reads byte {addr + k} after it was overwritten")
            if writer[addr + k] != (r, lane) and not shared_ok:
                raise Fault(f"row {r} lane {lane} reads byte {addr + k} written by {writer[addr + k]}")
        return bytes(stage[addr:addr + 16])

    def write(addr, data):
        stage[addr:addr + 16] = data
        for k in range(16):
            overwritten[addr + k] = True

    # ---- ConvertFp8Row: per warp (4 rows), lanes interleaved at random ----
    for warp in range(ROWS // 4):
        threads = [(r, lane) for r in range(4 * warp, 4 * warp + 4) for lane in range(LANES)]
        state = {}
        # Phase 1 (between the two __syncwarp): every lane reads its row's scales.
        order = threads[:]
        rng.shuffle(order)
        if plant == "scale-early":
            # Lane 0 converts (and overwrites its scale slot) before the others read.
            order.sort(key=lambda t: t[1] != 0)
        for r, lane in order:
            if plant == "scale-early" and lane == 0:
                scale_addr = (slot_base(r, 0) ^ 16) + 768
                write(scale_addr, bytes(16))
            scale_addr = (slot_base(r, 0) ^ 16) + 768
            state[(r, lane)] = struct.unpack("<4f", read(r, lane, scale_addr, shared_ok=True))
        # Phase 2: each lane's four steps in program order, the lanes
        # interleaved at random step by step.
        done = {t: 0 for t in threads}
        pending = [t for t in threads for _ in range(4)]
        while pending:
            r, lane = pending.pop(rng.randrange(len(pending)))
            m = done[(r, lane)]
            done[(r, lane)] += 1
            a = slot_base(r, lane)
            b = slot_base(r, lane) ^ 16
            codes = read(r, lane, a + 256 * m, shared_ok=False)
            scale = state[(r, lane)][m]
            out = []
            for c in codes:
                out.append(bf16_bits(f32(f32(e4m3_to_float(c)) * scale)))
            write(a + 256 * m, struct.pack("<8H", *out[:8]))
            write(b + 256 * m, struct.pack("<8H", *out[8:]))

    want = expected_tile(rows)
    if bytes(stage) != bytes(want):
        bad = next(k for k in range(STAGE_BYTES) if stage[k] != want[k])
        raise Fault(f"stage byte {bad} (row {bad // ROW_BYTES}, chunk slot "
                    f"{(bad % ROW_BYTES) // 16}) differs from the bf16 tile")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--plant", choices=["scale-early", "rope-unswizzled"])
    a = ap.parse_args()
    rng = random.Random(37)
    for i in range(a.runs):
        try:
            run(rng, a.plant)
        except Fault as f:
            if a.plant:
                print(f"planted fault found (run {i}): {f}")
                return 0
            print(f"FAULT (run {i}): {f}")
            return 1
    if a.plant:
        print(f"planted fault {a.plant} NOT found in {a.runs} runs")
        return 1
    print(f"ok: {a.runs} runs, 16 rows x 8 lanes each, random lane orders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
