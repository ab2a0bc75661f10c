// The verify attention kernel, warp-specialised: the work items, plan and
// combine of verify_kernel.cuh, with an inner loop in which the score/softmax
// of KV tile t+1 runs on the score warps while the PV warps accumulate
// P(t) V(t). See `pipelined::Shape` in verify_config.cuh for the roles and
// the shared-memory layout, and bench/NOTES.md for why.
//
// Hand-over per 16-token tile t (barriers indexed by t & 1):
//   score warps: [tiles 2..NUM_STAGES-1: wait P_EMPTY(t-2)] -> wait for tile
//     t (their own prologue loads for t < NUM_STAGES, else KV_FULL(t)) -> S
//     of the warp's 8 keys over all 576 dims -> the pair's agreement on the
//     rows' exponent references (ScoreTiles) -> softmax -> [from tile
//     NUM_STAGES on: wait P_EMPTY(t-2)] -> write P(t), alpha(t) -> arrive
//     P_FULL(t).
//   PV warps:    wait P_FULL(t) -> O = alpha O + P(t) V(t), during which
//     they wait for their load of tile t+2 and arrive KV_FULL(t+2) (where:
//     see "Where the PV warps arrive KV_FULL" below) -> arrive P_EMPTY(t) ->
//     load tile t+NUM_STAGES-1 into the stage of tile t-1.
// Every arrive has exactly one matching sync: P_EMPTY(t) is only signalled
// for t + 2 < num_tiles (the tiles whose successor-but-one waits for it), and
// KV_FULL(t+2) only for the PV-loaded tiles t+2 >= NUM_STAGES that exist.
// Stage (t-1) % NUM_STAGES is free when a PV warp passes P_FULL(t): the
// score warps finished S(t-1) before P_FULL(t-1), and every PV warp finished
// PV(t-1) before it could take part in P_FULL(t).
// Included by exactly one translation unit (verify_attention.cu), after
// verify_kernel.cuh.
#ifndef MLAVERIFY_KERNELS_VERIFY_PIPELINED_KERNEL_CUH_
#define MLAVERIFY_KERNELS_VERIFY_PIPELINED_KERNEL_CUH_

#include "kernels/verify_kernel.cuh"

namespace mlaverify::kernels::verify {

// Per-half exponent references (v26c; the page-ring instances only, see
// kHalfRefs in AttendSegmentPipelined). The two score warps of a row group
// need not meet at a barrier each tile to agree on a row's reference. Each
// keeps its own, as a whole number in the log2 domain (the ceiling of a tile
// max). It publishes the reference in shared memory when it moves, and takes
// the partner's published one when that is larger (a relaxed read, one tile
// late at worst). Each tile it writes one "dirty" flag: it moved, or it
// differs from the partner's as read. The PV warps load the four flags with
// one 16-byte load. Only on a dirty tile do they read the references, scale
// each half of P by 2^(ref - R) (a power of two: exact in bf16) and O by
// 2^(R_old - R), R the largest.
// The page-ring instances (page < 16 tokens) have no phase offset; there
// this gained 1.2-2.8 % on the page-1 shapes. On the register page path the
// pair's barrier paces the tile: the same change there was 3.9-5.1 % slower
// compute-bound, the score warps then waiting for the PV warps
// (bench/NOTES.md, "Per-half exponent references").
namespace half_refs {
// Float indices into the exchange area: [4 warps][16 rows] published
// references, [2 row groups][16] key half 1's final references, then
// [2 tiles][BLOCK_M rows][2 key halves] the references each tile's P used.
constexpr int kPublishedAt = 0;
constexpr int kFinalRefsAt = 96;
constexpr int kTileRefsAt = 128;
// [2 tiles][4 score warps] int32: the warp's references for the tile may
// differ from O's (it moved them, or they differ from the partner's as last
// read). All four zero: the PV warps have nothing to do (v26c).
constexpr int kDirtyAt = 256;
}  // namespace half_refs

// Where the PV warps arrive KV_FULL(t+2) in their iteration t (see
// arrive_kv_full in the PV loop), per instance (bench/NOTES.md, "The hand-over"):
// - register page path: after three quarters of their V pairs (v23d).
//   Halfway took the compute-bound shape 6.9 % faster than after the MMAs
//   (v23b); three quarters is as fast there and 0.9 % faster at B=32.
// - page-ring instance (no phase offset): halfway (v23e: 2.8 % faster than
//   three quarters at page 1, compute-bound; before the MMAs cost 3-4 %).
// - fused page-ring instance: before the MMAs (rf1: 1.7-2.2 % faster on its
//   page-1 shapes, B <= 4).

// FP8 pools: converts this thread's share of row `row` of the tile in the
// stage at shared address `stage`, which its own issue_tile placed there
// (pipelined::Fp8CodeSlot, Fp8ScaleSlot), into the swizzled bf16 row a bf16
// pool's cp.async would have written; call after the thread's wait_group for
// the tile. Value d is E4m3ToFloat(code[d]) * scale[d / 128] in fp32, the
// CPU reference's value of the stored row (common/kv_dtype.h,
// DequantizeLatentRow), rounded to nearest-even bf16: the GPU attends to that
// value within bf16 rounding (relative 2^-9), as it attends to q and P. Each
// slot is read before the write that overwrites it; a thread writes only its
// own slots and reads only those and the row's scales (lane 0's slot), so two
// __syncwarp suffice until the tile's hand-over. The rope chunk arrived in its
// place. All 32 lanes of the warp call it (whole warps load: four rows each).
__device__ __forceinline__ uint32_t Fp8SlotBase(int row, int lane) {
  return static_cast<uint32_t>(row * ROW_BYTES +
                               SwizzledChunk(row, pipelined::Fp8CodeSlot(lane, 0)) * 16);
}
__device__ __forceinline__ void ConvertFp8Row(uint32_t stage, int row, int lane) {
  // pipelined::Fp8SlotsFollowTheBase: every slot at an immediate offset from a or b.
  // The XOR acts on the row-relative offset (row bases are multiples of 32
  // bytes), so it holds whatever the shared window's alignment.
  const uint32_t a = stage + Fp8SlotBase(row, lane);
  const uint32_t b = stage + (Fp8SlotBase(row, lane) ^ 16u);
  // The row's scales wait in lane 0's scale slot: the first __syncwarp shows
  // them (written by lane 0's cp.async, complete after its wait_group) to the
  // row's other lanes; the second keeps lane 0 from overwriting them (its
  // last store) before they have read them.
  __syncwarp();
  const uint4 scale_bits = ptx::LdShared128(stage + (Fp8SlotBase(row, 0) ^ 16u) + 768);
  __syncwarp();
  const float scales[4] = {__uint_as_float(scale_bits.x), __uint_as_float(scale_bits.y),
                           __uint_as_float(scale_bits.z), __uint_as_float(scale_bits.w)};
  // Every code chunk is read before the first store: the stores' "memory"
  // clobber would otherwise keep the next chunk's load, and its shared-memory
  // latency, behind them.
  uint4 codes[pipelined::FP8_CODE_CHUNKS_PER_LANE];
#pragma unroll
  for (int m = 0; m < pipelined::FP8_CODE_CHUNKS_PER_LANE; ++m)
    codes[m] = ptx::LdShared128(a + 256 * m);
#pragma unroll
  for (int m = 0; m < pipelined::FP8_CODE_CHUNKS_PER_LANE; ++m) {
    // 16 codes of group m: bf16 chunks 2l + 16m (at a + 256m) and the next (b + 256m).
    uint4 lo, hi;
    lo.x = ptx::E4m3x2ScaledToBf16x2(codes[m].x & 0xffffu, scales[m]);
    lo.y = ptx::E4m3x2ScaledToBf16x2(codes[m].x >> 16, scales[m]);
    lo.z = ptx::E4m3x2ScaledToBf16x2(codes[m].y & 0xffffu, scales[m]);
    lo.w = ptx::E4m3x2ScaledToBf16x2(codes[m].y >> 16, scales[m]);
    hi.x = ptx::E4m3x2ScaledToBf16x2(codes[m].z & 0xffffu, scales[m]);
    hi.y = ptx::E4m3x2ScaledToBf16x2(codes[m].z >> 16, scales[m]);
    hi.z = ptx::E4m3x2ScaledToBf16x2(codes[m].w & 0xffffu, scales[m]);
    hi.w = ptx::E4m3x2ScaledToBf16x2(codes[m].w >> 16, scales[m]);
    ptx::StShared128(a + 256 * m, lo);
    ptx::StShared128(b + 256 * m, hi);  // at m = 3 the scales' slot: read above
  }
}

// The score warps' wait for tile t. PV(t-2) is done with P buffer (t & 1):
// from tile NUM_STAGES on that is waited just before P(t) is written (in
// ScoreTiles; v15.3): KV_FULL(t) already orders this tile after PV(t-2)'s
// MMAs, and the MMAs of S(t) need only K. The prologue tiles keep it here:
// it is what keeps S(t) from arriving at BAR_SCORE_MMA_DONE twice in one
// phase (the protocol model's p-empty-late plant). Tiles of the prologue
// were loaded by the score warps themselves (groups Q, 0, 1, ...,
// NUM_STAGES-1); later ones by the PV warps, which arrive KV_FULL(t).
__device__ __forceinline__ void ScoreWaitForTile(int t) {
  using Shape = pipelined::Shape;
  constexpr int NUM_STAGES = Shape::NUM_STAGES;
  constexpr int NUM_THREADS = Shape::NUM_THREADS;
  if (t >= 2 && t < NUM_STAGES)
    ptx::NamedBarrierSync(pipelined::BAR_P_EMPTY + (t & 1), NUM_THREADS);
  if (t < NUM_STAGES) {
    switch (NUM_STAGES - 1 - t) {
      case 0:
        ptx::CpAsyncWait<0>();
        break;
      case 1:
        ptx::CpAsyncWait<1>();
        break;
      case 2:
        ptx::CpAsyncWait<2>();
        break;
      case 3:
        ptx::CpAsyncWait<3>();
        break;
      default:
        ptx::CpAsyncWait<4>();
        break;
    }
    ptx::NamedBarrierSync(pipelined::BAR_SCORE, Shape::SCORE_THREADS);
  } else {
    ptx::NamedBarrierSync(pipelined::BAR_KV_FULL + (t & 1), NUM_THREADS);
  }
  if (t == 0 && threadIdx.x == 0) PhaseStamp(kStampFirstTile);
}

// The score warps' tile loop (after the prologue of AttendSegmentPipelined):
// warp = row group x key half (v22: the pair splits a tile's keys, not Q's
// dimensions, so no partial scores are exchanged). The warp computes
// S[16 rows, keys 8 kh .. 8 kh + 7] over all 576 dimensions, 36 MMAs into one
// n tile (four accumulator chains); a lane's C fragment holds rows g and
// g + 8, keys 2 t4 and 2 t4 + 1. Both warps of a pair must use the same
// exponent reference for a row (the PV warps' k16 step spans both halves):
// one `barrier.cta.red.or` per tile tells them whether any row of either half
// exceeds its reference by more than REFERENCE_SLACK, and only then (rare once
// the running max settles) do they swap their tile maxima through shared
// memory and both take the larger. With kHalfRefs (the page-ring instances,
// see "Per-half exponent references") there is no such barrier: each warp keeps
// its own references and the PV warps reconcile them. Hand-over to the PV
// warps: see the header.
template <bool kPhaseOffset, bool kHalfRefs, int kQSteps>
__device__ __forceinline__ void ScoreTiles(const VerifyParams& p, const VerifyWorkItem& item,
                                           uint8_t* smem_raw, const uint32_t (&q_frag)[kQSteps][4],
                                           int row_group, int key_half, int num_tiles,
                                           float scale_log2, int prefix) {
  using Shape = pipelined::Shape;
  using pipelined::BAR_FINAL;
  using pipelined::BAR_P_EMPTY;
  using pipelined::BAR_P_FULL;
  using pipelined::BAR_PAIR;
  using pipelined::BAR_SCORE_MMA_DONE;
  using pipelined::BLOCK_N;
  using pipelined::P_BUFFER_BYTES;
  using pipelined::P_PITCH;
  using pipelined::REFERENCE_SLACK;
  using pipelined::STAGE_BYTES;
  constexpr int NUM_STAGES = Shape::NUM_STAGES;
  constexpr int NUM_THREADS = Shape::NUM_THREADS;
  static_assert(kQSteps == D_QK / 16 && kQSteps % 4 == 0, "whole Q; four chains");
  static_assert(Shape::EXCHANGE_BYTES >= (4 * 16 + 2 * 16) * 4,
                "tile maxima and the row sums fit the exchange");

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int b = item.request;
  const int heads = p.num_heads;
  const int rows = p.draft_len[b] * heads;
  const int kv_begin = item.kv_begin;
  const int kv_end = item.kv_end;
  const int row0 = row_group * 16 + g;            // this lane's rows: row0, row0 + 8
  const int r0 = item.row_tile * BLOCK_M + row0;  // request rows
  const uint64_t vis0 = r0 < rows ? p.visibility[item.q_row + r0 / heads] : 0;
  const uint64_t vis1 = r0 + 8 < rows ? p.visibility[item.q_row + (r0 + 8) / heads] : 0;
  const int unmasked_end = min(prefix, kv_end);
  const uint32_t kv_base = ptx::SmemAddress(smem_raw + Shape::SMEM_KV_OFFSET);
  // [4 warps][16 rows] tile maxima (the rare reference change), then
  // [2 row groups][16 rows] the key half 1 row sums (once, at the end).
  float* maxima = reinterpret_cast<float*>(smem_raw + Shape::SMEM_EXCHANGE_OFFSET);
  float* half_sums = maxima + 4 * 16;
  float* alpha_s = reinterpret_cast<float*>(smem_raw + Shape::SMEM_ALPHA_OFFSET);
  float* inv_l_s = reinterpret_cast<float*>(smem_raw + Shape::SMEM_INV_L_OFFSET);

  // ldmatrix.x4 number j reads keys 8 kh + (lane & 7), chunks 4 j + (lane >> 3):
  // the B fragments of k steps 2 j and 2 j + 1. Chunks 8 apart keep their
  // swizzle: pair j is k_off[j % 2] + 128 bytes x (j / 2).
  const uint32_t k_off[2] = {TileOffset(key_half * 8 + (lane & 7), lane >> 3),
                             TileOffset(key_half * 8 + (lane & 7), 4 + (lane >> 3))};
  float ref[2] = {-INFINITY,
                  -INFINITY};       // exponent references of rows row0, row0 + 8 (log2 domain)
  float row_sum[2] = {0.0f, 0.0f};  // this lane's share of their running sums
  // Per-half references (kHalfRefs): tiles still to receive them for the PV
  // warps (each P buffer has its own slot, so a move is written twice), and
  // the areas.
  [[maybe_unused]] int refs_to_write = 2;
  [[maybe_unused]] float* published = maxima + half_refs::kPublishedAt;
  [[maybe_unused]] float* tile_refs = maxima + half_refs::kTileRefsAt;
  [[maybe_unused]] float* final_refs = maxima + half_refs::kFinalRefsAt;
  [[maybe_unused]] int* dirty_flags = reinterpret_cast<int*>(maxima + half_refs::kDirtyAt);
  static_assert(half_refs::kDirtyAt >= half_refs::kTileRefsAt + 2 * 2 * BLOCK_M &&
                    Shape::EXCHANGE_BYTES >= (half_refs::kDirtyAt + 2 * 4) * 4 &&
                    half_refs::kDirtyAt % 4 == 0,
                "the dirty flags fit the exchange area, 16-byte aligned");
  static_assert(Shape::EXCHANGE_BYTES >= (half_refs::kTileRefsAt + 2 * 2 * BLOCK_M) * 4 &&
                    half_refs::kFinalRefsAt >= 4 * 16 + 2 * 16 &&
                    half_refs::kFinalRefsAt + 2 * 16 <= half_refs::kTileRefsAt,
                "the per-half references fit the exchange area beside the row sums");
  if constexpr (kHalfRefs) {
    // Before tile 0's BAR_SCORE: the partner reads this only after it. The
    // previous segment's readers are past the pair barrier at its end.
    if (t4 == 0) {
      ptx::StRelaxedShared(published + warp * 16 + g, -INFINITY);
      ptx::StRelaxedShared(published + warp * 16 + g + 8, -INFINITY);
    }
  }
  uint32_t stage = 0;
  for (int t = 0; t < num_tiles; ++t) {
    ScoreWaitForTile(t);
    // Per-half references: the partner's as last published (used after the MMAs).
    [[maybe_unused]] float partner[2];
    if constexpr (kHalfRefs) {
      partner[0] = ptx::LdRelaxedShared(published + (warp ^ 1) * 16 + g);
      partner[1] = ptx::LdRelaxedShared(published + (warp ^ 1) * 16 + g + 8);
    }

    const uint32_t k_base = kv_base + stage;
    stage = stage == (NUM_STAGES - 1) * STAGE_BYTES ? 0 : stage + STAGE_BYTES;
    float acc[4][4];
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[c][e] = 0.0f;
    uint32_t kf[2][4];
    ptx::LdMatrixX4(kf[0], k_base + k_off[0]);
#pragma unroll
    for (int j = 0; j < kQSteps / 2; ++j) {
      if (j + 1 < kQSteps / 2)
        ptx::LdMatrixX4(kf[(j + 1) & 1], k_base + k_off[(j + 1) & 1] + ((j + 1) >> 1) * 128);
      ptx::MmaBf16(acc[(2 * j) & 3], q_frag[2 * j], kf[j & 1][0], kf[j & 1][1]);
      ptx::MmaBf16(acc[(2 * j + 1) & 3], q_frag[2 * j + 1], kf[j & 1][2], kf[j & 1][3]);
    }
    if (kPhaseOffset && t >= 1) ptx::NamedBarrierArrive(BAR_SCORE_MMA_DONE, NUM_THREADS);
    float sc[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] = (acc[0][e] + acc[1][e]) + (acc[2][e] + acc[3][e]);

    const int tile_begin = kv_begin + t * BLOCK_N;
    if (tile_begin + BLOCK_N > unmasked_end) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = tile_begin + key_half * 8 + 2 * t4 + (e & 1);
        const uint64_t vis = e < 2 ? vis0 : vis1;
        const bool visible = j < kv_end && (j < prefix || ((vis >> ((j - prefix) & 63)) & 1u) != 0);
        sc[e] = visible ? sc[e] : -INFINITY;
      }
    }
    // Tile maxima, scaled after the max (scale > 0); -inf + slack is -inf.
    float m[2] = {fmaxf(sc[0], sc[1]) * scale_log2, fmaxf(sc[2], sc[3]) * scale_log2};
    const bool change_mine =
        !(m[0] <= ref[0] + REFERENCE_SLACK && m[1] <= ref[1] + REFERENCE_SLACK);
    float alpha[2] = {1.0f, 1.0f};
    [[maybe_unused]] bool dirty = false;
    if constexpr (kHalfRefs) {
      // Per-half references: this warp's own; the quad that shares a row agrees
      // by two shuffles, the partner only through what it published.
      // One vote also says whether they may differ from O's for the PV
      // warps ("dirty": a move, or a difference from the partner's as read).
      // Every score warp passes each tile's KV_FULL / BAR_SCORE before this
      // tile's read, so the partner's value read is its reference at t - 1
      // or t. Two clean warps at t then hold equal references, unchanged since
      // t - 1, which is what O's reference is after tile t - 1.
      const bool move = change_mine || partner[0] > ref[0] || partner[1] > ref[1];
      dirty = __any_sync(0xffffffffu, move || partner[0] != ref[0] || partner[1] != ref[1]);
      if (dirty) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 1));
          m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 2));
          float new_ref = fmaxf(ref[h], partner[h]);
          if (!(m[h] <= new_ref + REFERENCE_SLACK)) new_ref = ceilf(m[h]);
          alpha[h] = new_ref == -INFINITY ? 0.0f : ptx::Exp2Approx(ref[h] - new_ref);
          ref[h] = new_ref;
        }
        if (t4 == 0) {
          ptx::StRelaxedShared(published + warp * 16 + g, ref[0]);
          ptx::StRelaxedShared(published + warp * 16 + g + 8, ref[1]);
        }
        refs_to_write = 2;
      }
    } else if (ptx::NamedBarrierAny(BAR_PAIR + row_group, 64, change_mine)) {
      // Uniform over the pair: both warps compute the same new references.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 1));
        m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 2));
      }
      if (t4 == 0) {
        maxima[warp * 16 + g] = m[0];
        maxima[warp * 16 + g + 8] = m[1];
      }
      // The next write of these slots comes after the next tile's reduction,
      // which the partner reaches only after reading them here.
      ptx::NamedBarrierSync(BAR_PAIR + row_group, 64);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float new_ref = fmaxf(ref[h], fmaxf(m[h], maxima[(warp ^ 1) * 16 + g + 8 * h]));
        // exp2(-inf - -inf) would be NaN: a row with no visible key yet scales by 0.
        alpha[h] = new_ref == -INFINITY ? 0.0f : ptx::Exp2Approx(ref[h] - new_ref);
        ref[h] = new_ref;
      }
    }
    // A row that has seen no visible key keeps -inf: 0 as its reference makes
    // exp2(-inf - ref) 0 rather than NaN.
    const float neg_ref0 = ref[0] == -INFINITY ? 0.0f : -ref[0];
    const float neg_ref1 = ref[1] == -INFINITY ? 0.0f : -ref[1];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      sc[e] = ptx::Exp2Approx(fmaf(sc[e], scale_log2, e < 2 ? neg_ref0 : neg_ref1));
    row_sum[0] = row_sum[0] * alpha[0] + (sc[0] + sc[1]);
    row_sum[1] = row_sum[1] * alpha[1] + (sc[2] + sc[3]);

    if (t >= NUM_STAGES) ptx::NamedBarrierSync(BAR_P_EMPTY + (t & 1), NUM_THREADS);
    auto* probs =
        reinterpret_cast<uint32_t*>(smem_raw + Shape::SMEM_P_OFFSET + (t & 1) * P_BUFFER_BYTES);
    probs[(row0 * P_PITCH + key_half * 8 + 2 * t4) / 2] = ptx::PackBf16x2(sc[0], sc[1]);
    probs[((row0 + 8) * P_PITCH + key_half * 8 + 2 * t4) / 2] = ptx::PackBf16x2(sc[2], sc[3]);
    if constexpr (kHalfRefs) {
      if (refs_to_write > 0) {  // warp-uniform
        --refs_to_write;
        if (t4 == 0) {
          tile_refs[((t & 1) * BLOCK_M + row0) * 2 + key_half] = ref[0];
          tile_refs[((t & 1) * BLOCK_M + row0 + 8) * 2 + key_half] = ref[1];
        }
      }
      if (lane == 0) dirty_flags[(t & 1) * 4 + warp] = dirty ? 1 : 0;
    } else if (key_half == 0 && t4 == 0) {
      alpha_s[(t & 1) * BLOCK_M + row0] = alpha[0];
      alpha_s[(t & 1) * BLOCK_M + row0 + 8] = alpha[1];
    }
    ptx::NamedBarrierArrive(BAR_P_FULL + (t & 1), NUM_THREADS);
  }

  if (tid == 0) PhaseStamp(kStampScoreDone);
    // ---- 1 / l and lse: the quad's, then the pair's sums (key half 0 stores) ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
  }
  if (key_half == 1 && t4 == 0) {
    half_sums[row_group * 16 + g] = row_sum[0];
    half_sums[row_group * 16 + g + 8] = row_sum[1];
    if constexpr (kHalfRefs) {
      final_refs[row_group * 16 + g] = ref[0];
      final_refs[row_group * 16 + g + 8] = ref[1];
    }
  }
  ptx::NamedBarrierSync(BAR_PAIR + row_group, 64);
  if (key_half == 0 && t4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kHalfRefs) {
        const float other_sum = half_sums[row_group * 16 + g + 8 * h];
        // The PV warps' O is relative to the larger of the two references
        // (the running max of both): bring both sums to it.
        const float other_ref = final_refs[row_group * 16 + g + 8 * h];
        const float r = fmaxf(ref[h], other_ref);
        const float sum = r == -INFINITY ? 0.0f
                                         : row_sum[h] * ptx::Exp2Approx(ref[h] - r) +
                                               other_sum * ptx::Exp2Approx(other_ref - r);
        StoreRowStats(p, item.partial_slot, row0 + 8 * h, r0 + 8 * h, rows, item.q_row, heads, r,
                      sum, inv_l_s);
      } else {
        StoreRowStats(p, item.partial_slot, row0 + 8 * h, r0 + 8 * h, rows, item.q_row, heads,
                      ref[h], row_sum[h] + half_sums[row_group * 16 + g + 8 * h], inv_l_s);
      }
    }
  }
  ptx::NamedBarrierArrive(BAR_FINAL, NUM_THREADS);
}

// kPageRing: page ids reach the PV warps' loads through a shared ring (page
// sizes below 16 tokens) rather than a register read one step ahead; see the
// PV warps' prologue. The host picks the instance from page_size_log2.
// One segment (work item) in the warps of one role (kScoreRole: the score
// warps, else the PV warps): each role loops over the segments on its own
// (see the kernel below), so that what the compiler hoists out of the segment
// loop is one role's, not both roles' registers at once.
// kFused: the fused-combine instance (see PipelinedAttentionKernel).
// kFp8: the pool holds fp8 rows (pipelined::FP8_ROW_BYTES; see ConvertFp8Row).
template <bool kPageRing, bool kScoreRole, bool kFused, bool kFp8>
__device__ __forceinline__ void AttendSegmentPipelined(const VerifyParams& p,
                                                       const VerifyWorkItem& item,
                                                       uint8_t* smem_raw) {
  using Shape = pipelined::Shape;
  // The PV warps ask L2 for the segment's page-table lines first (register
  // path; see the PV prologue). Not in the fused-combine instance: its
  // segments are short (batch <= fused_combine_max_batch spread over the
  // whole grid, one page-table line or two), and with it B=1, L=64K measured
  // 5 % slower (code generation of that instance, not analysed;
  // bench/NOTES.md, "L2 prefetches"). Its PTX is then unchanged.
  constexpr bool kPageLinePrefetch = !kFused;
  // PV(t)'s MMAs wait for S(t+1)'s to be issued (bench/NOTES.md, "The
  // hand-over"); register page path only.
  constexpr bool kPhaseOffset = !kPageRing;
  // The page-ring instances' score warps keep per-half references (see
  // "Per-half exponent references").
  constexpr bool kHalfRefs = kPageRing;
  // Block-scope declarations: BLOCK_N hides the plan's 32-token tile (verify::BLOCK_N).
  using pipelined::BAR_FINAL;
  using pipelined::BAR_KV_FULL;
  using pipelined::BAR_P_EMPTY;
  using pipelined::BAR_P_FULL;
  using pipelined::BAR_SCORE;
  using pipelined::BAR_SCORE_MMA_DONE;
  using pipelined::BLOCK_N;
  using pipelined::LOADER_THREADS;
  using pipelined::P_BUFFER_BYTES;
  using pipelined::P_PITCH;
  using pipelined::STAGE_BYTES;
  constexpr int NUM_STAGES = Shape::NUM_STAGES;
  constexpr int NUM_THREADS = Shape::NUM_THREADS;
  constexpr int O_N_TILES = Shape::O_N_TILES;
  constexpr int Q_STAGE = Shape::Q_STAGE;
  constexpr int SCORE_THREADS = Shape::SCORE_THREADS;
  constexpr int SCORE_WARPS = Shape::SCORE_WARPS;
  constexpr int V_COLS_PER_WARP = Shape::V_COLS_PER_WARP;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // mma fragment row
  const int b = item.request;
  const int heads = p.num_heads;
  const int rows = p.draft_len[b] * heads;
  const int q_row = item.q_row;
  const int partial_slot = item.partial_slot;
  const int kv_begin = item.kv_begin;
  const int kv_end = item.kv_end;
  const int num_tiles = CeilDiv(kv_end - kv_begin, BLOCK_N);

  const uint32_t kv_base = ptx::SmemAddress(smem_raw + Shape::SMEM_KV_OFFSET);
  auto stage_addr = [&](int stage) { return kv_base + stage * STAGE_BYTES; };
  const uint32_t probs_addr = ptx::SmemAddress(smem_raw + Shape::SMEM_P_OFFSET);
  float* alpha_s = reinterpret_cast<float*>(smem_raw + Shape::SMEM_ALPHA_OFFSET);
  float* inv_l_s = reinterpret_cast<float*>(smem_raw + Shape::SMEM_INV_L_OFFSET);

  // ---- KV loader, run by 128 threads of one role: 8 threads per KV row,
  // thread `lane` taking 16-byte chunks lane + 8k. A chunk lands at a fixed
  // offset from the row's swizzled base (SwizzledChunk keeps bits 3.. of the
  // chunk index), so one base address per thread and immediate offsets do. ----
  // Both 64-bit bases below go through an opaque move: without it ptxas
  // rebuilt them from the kernel parameters inside the PV loop every tile
  // (two constant loads and five 64-bit multiply-adds for the page id's
  // address, a 64-bit add and two selects for the row's), and each
  // instruction on the PV warps' path costs ~2.6 cycles per tile
  // (bench/NOTES.md, "Per-tile instruction diet").
  const int32_t* pages =
      ptx::Opaque(p.page_table + (p.page_table_offset != nullptr ? p.page_table_offset[b]
                                                                 : b * p.page_table_stride));
  const int page_mask = (1 << p.page_size_log2) - 1;
  // A pool row in 2-byte units: 576 bf16 values, or the 656-byte fp8 row.
  constexpr int POOL_ROW_ELEMENTS = kFp8 ? pipelined::FP8_ROW_BYTES / 2 : D_QK;
  const uint16_t* layer_base = p.pool + static_cast<int64_t>(p.layer[b]) * p.num_pages *
                                            (int64_t{POOL_ROW_ELEMENTS} << p.page_size_log2);
  // This thread's chunk of token 0 of the layer (every caller passes its
  // ld_lane as `lane`, see below).
  const uint8_t* lane_base =
      ptx::Opaque(reinterpret_cast<const uint8_t*>(layer_base) + (tid & 7) * 16);
  auto page_of = [&](int tile, int row) -> int {
    const int j = kv_begin + tile * BLOCK_N + row;
    return j < kv_end ? pages[j >> p.page_size_log2] : 0;
  };
  // `stage` is the byte offset of the tile's stage. The row's address is
  // the lane's base + 32-bit token index x 1152 bytes (one wide multiply-add;
  // CanImplement keeps a layer below 2^31 tokens). An fp8 row (656 bytes)
  // lands raw in the slots of the bf16 row that ConvertFp8Row, run later by
  // the same thread, turns into that row.
  auto issue_tile = [&](int tile, uint32_t stage, int page, int row, int lane) {
    const int j = kv_begin + tile * BLOCK_N + row;
    const bool valid = j < kv_end;
    // An invalid row reads nothing (src-size 0, zero fill) from token 0 of the layer.
    const uint32_t token = valid ? (static_cast<uint32_t>(page) << p.page_size_log2) |
                                       static_cast<uint32_t>(j & page_mask)
                                 : 0u;
    if constexpr (kFp8) {
      // Lane l's pieces of the raw row (see pipelined::Fp8CodeSlot): code
      // chunks l + 8m, rope chunk l, and on lane 0 the scale chunk;
      // lane_base is 16 l in.
      const uint8_t* src = lane_base + static_cast<uint64_t>(token) * pipelined::FP8_ROW_BYTES;
      const uint32_t slot = Fp8SlotBase(row, lane);
      const uint32_t a = kv_base + stage + slot;
#pragma unroll
      for (int m = 0; m < pipelined::FP8_CODE_CHUNKS_PER_LANE; ++m)
        ptx::CpAsync16(a + 256 * m, src + m * 128, valid);
      // The scales, once per row: lane 0's scale slot (src is the row's start there).
      if (lane == 0)
        ptx::CpAsync16(kv_base + stage + (slot ^ 16u) + 768, src + kFp8ScaleOffset, valid);
      // Rope chunk l: bf16 chunk 64 + l, at its place (as for a bf16 pool).
      ptx::CpAsync16(kv_base + stage +
                         static_cast<uint32_t>(row * ROW_BYTES + ((lane ^ row) & 7) * 16 + 8 * 128),
                     src + kFp8RopeOffset, valid);
    } else {
      const uint16_t* src =
          reinterpret_cast<const uint16_t*>(lane_base + static_cast<uint64_t>(token) * ROW_BYTES);
      const uint32_t dst =
          kv_base + stage + static_cast<uint32_t>(row * ROW_BYTES + ((lane ^ row) & 7) * 16);
#pragma unroll
      for (int k = 0; k < ROW_CHUNKS / 8; ++k) ptx::CpAsync16(dst + k * 128, src + k * 64, valid);
    }
  };
  // This thread's KV row and lane when it loads: the first 128 threads of each
  // role (SCORE_THREADS is a multiple of 128).
  static_assert(LOADER_THREADS == 128 && pipelined::LOADER_THREADS_PER_ROW == 8 &&
                    SCORE_THREADS % LOADER_THREADS == 0,
                "the masks below");
  const int ld_row = (tid & 127) >> 3;
  const int ld_lane = tid & 7;
  static_assert(!kFp8 || (SCORE_THREADS == LOADER_THREADS && Shape::PV_THREADS == LOADER_THREADS),
                "fp8: every thread of both roles loads, and converts what it loaded");

  if constexpr (kScoreRole) {
    // =================== score warps: S and the online softmax ===================
    const int row_group = warp / Shape::KEY_HALVES;
    const int key_half = warp % Shape::KEY_HALVES;
    const bool tile_loader = tid < LOADER_THREADS;
    const int prefix = p.prefix_len[b];
    const float scale = p.softmax_scale != nullptr ? p.softmax_scale[b] : p.default_softmax_scale;
    const float scale_log2 = scale * LOG2E;

    // ---- prologue: Q (32 rows) into the last two stages, tiles 0..NUM_STAGES-3 ----
    // The page ids of every prologue tile are read first, all together: read
    // one by one before each tile's loads they were NUM_STAGES dependent L2
    // round trips (2.3-2.6 us after the plan at B=1, with L2 warm or cold;
    // phase stamps, bench/NOTES.md, "bf16 partials").
    int first_pages[NUM_STAGES];
#pragma unroll
    for (int t = 0; t < NUM_STAGES; ++t)
      first_pages[t] = tile_loader && t < num_tiles ? page_of(t, ld_row) : 0;
    {
      const uint32_t dst = stage_addr(Q_STAGE);
#pragma unroll
      for (int row = tid >> 3; row < BLOCK_M; row += SCORE_THREADS / 8) {
        StageQueryRow(p, dst, row, item.row_tile * BLOCK_M + row, ld_lane, rows, q_row, heads);
      }
      ptx::CpAsyncCommit();
    }
#pragma unroll
    for (int t = 0; t < Q_STAGE; ++t) {
      if (tile_loader && t < num_tiles)
        issue_tile(t, t * STAGE_BYTES, first_pages[t], ld_row, ld_lane);
      ptx::CpAsyncCommit();
    }
    if (tid == 0) PhaseStampAfter(kStampPageIds, first_pages[0]);

    // Each warp holds its row group's Q over all 576 dimensions.
    constexpr int Q_STEPS = D_QK / 16;
    uint32_t q_frag[Q_STEPS][4];
    ptx::CpAsyncWait<Q_STAGE>();  // Q has landed (the tiles may still be in flight)
    ptx::NamedBarrierSync(BAR_SCORE, SCORE_THREADS);
    {
      const int row = row_group * 16 + (lane & 15);
#pragma unroll
      for (int s = 0; s < Q_STEPS; ++s) {
        const int chunk = (s * 16) / 8 + (lane >> 4);
        ptx::LdMatrixX4(q_frag[s], stage_addr(Q_STAGE) + TileOffset(row, chunk));
      }
    }
    // Every score warp holds its Q: the Q stages receive tiles Q_STAGE.. now.
    ptx::NamedBarrierSync(BAR_SCORE, SCORE_THREADS);
    if (tid == 0) PhaseStamp(kStampQReady);
#pragma unroll
    for (int t = Q_STAGE; t < NUM_STAGES; ++t) {
      if (tile_loader && t < num_tiles)
        issue_tile(t, t * STAGE_BYTES, first_pages[t], ld_row, ld_lane);
      ptx::CpAsyncCommit();
    }
    if constexpr (kFp8) {
      // FP8: every prologue tile (tile t in stage t) is converted here, each
      // thread its own share, before the tile loop; ScoreWaitForTile's
      // BAR_SCORE then shows them to the other score warps. Inside the tile
      // loop the conversion's registers, beside Q's and the loop's, spilled
      // on sm_90; the cost is that S(0) waits for tile NUM_STAGES-1's rows.
      ptx::CpAsyncWait<0>();
#pragma unroll
      for (int t = 0; t < NUM_STAGES; ++t)
        if (t < num_tiles) ConvertFp8Row(stage_addr(t), ld_row, ld_lane);
    }

    ScoreTiles<kPhaseOffset, kHalfRefs>(p, item, smem_raw, q_frag, row_group, key_half, num_tiles,
                                        scale_log2, prefix);
    return;
  }

  // ============ PV warps: KV loads from tile NUM_STAGES on, O = alpha O + P V ============
  // (Only the PV instance reaches here: the score role returned above.)
  const int pv_warp = warp - SCORE_WARPS;
  // The first 128 PV threads load (all of them: PV_THREADS == LOADER_THREADS).
  const bool loader = tid - SCORE_THREADS < LOADER_THREADS;
  float o_acc[M_TILES][O_N_TILES][4];
#pragma unroll
  for (int m = 0; m < M_TILES; ++m)
#pragma unroll
    for (int n = 0; n < O_N_TILES; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[m][n][e] = 0.0f;

  // Page ids of the rows to load. Below 16 tokens per page every row of a
  // tile has its own page-table entry, cold in L2 after a flush: reading the
  // id into a register one step ahead stalled the loads behind it (page size
  // 1 ran 20 % behind page size 64; bench/NOTES.md, "Page ids: ring or register").
  // There the ids come
  // through a shared ring instead, fetched with cp.async by each row's first
  // loader thread PAGE_AHEAD tiles ahead, in the commit group of the step that
  // issues them: by the time their tile is loaded, the wait_group of an
  // earlier step has completed that group, and __syncwarp shows the id to the
  // row's other threads (same warp). From 16 tokens per page up a tile reads
  // one page-table entry, shared with the tiles around it: the register read
  // one step ahead costs the PV warps (the critical path) less than the
  // ring's per-step work (v4f). The host picks the instance (kPageRing).
  int32_t* page_ring = reinterpret_cast<int32_t*>(smem_raw + Shape::SMEM_PAGE_RING_OFFSET);
  auto fetch_page_id = [&](int tile) {
    if (!loader || ld_lane != 0) return;
    const int j = kv_begin + tile * BLOCK_N + ld_row;
    const bool valid = j < kv_end;  // else zero-filled: the row is not loaded anyway
    ptx::CpAsync4(ptx::SmemAddress(page_ring + (tile % pipelined::PAGE_RING) * BLOCK_N + ld_row),
                  valid ? pages + (j >> p.page_size_log2) : pages, valid);
  };
  int next_page = 0;  // register path: the page id of the next tile to load
  if constexpr (kPageRing) {
#pragma unroll
    for (int i = 0; i < pipelined::PAGE_AHEAD; ++i) fetch_page_id(NUM_STAGES + i);
    ptx::CpAsyncCommit();
    ptx::CpAsyncWait<0>();
  } else {
    if (loader) next_page = page_of(NUM_STAGES, ld_row);
    // The register path reads each tile's page id one tile ahead, and a
    // page-table line (32 ids) ends every 32 pages: read cold, that read is a
    // DRAM round trip on the PV warps' critical path, 8 times per CTA at
    // B=32, L=64K (bench/NOTES.md, "L2 prefetches"). Ask L2 for every line of the segment's
    // page ids now, one per loader thread (up to 128 lines: 4,096 pages).
    const int first_line = (kv_begin >> p.page_size_log2) >> 5;
    const int last_line = ((kv_end - 1) >> p.page_size_log2) >> 5;
    const int line = first_line + (tid - SCORE_THREADS);
    if (kPageLinePrefetch && loader && line <= last_line) ptx::PrefetchL2(pages + line * 32);
  }
  // V fragment addresses relative to a stage: n-tile pair np reads chunk
  // pv_warp * V_COLS_PER_WARP / 8 + 2 np (+1 for lanes 16-31); pairs 4 apart
  // are 8 chunks apart with the same swizzle: + 128 bytes.
  constexpr int V_OFFSETS = O_N_TILES / 2 < 4 ? O_N_TILES / 2 : 4;
  const int v_token = (lane & 7) + (((lane >> 3) & 1) << 3);
  uint32_t v_frag_offset[V_OFFSETS];
#pragma unroll
  for (int np = 0; np < V_OFFSETS; ++np) {
    v_frag_offset[np] = TileOffset(v_token, pv_warp * (V_COLS_PER_WARP / 8) + np * 2 + (lane >> 4));
  }
  // P fragment addresses of the two m tiles in P buffer 0.
  uint32_t p_frag_addr[M_TILES];
#pragma unroll
  for (int m = 0; m < M_TILES; ++m) {
    p_frag_addr[m] = probs_addr + ((m * 16 + (lane & 15)) * P_PITCH + ((lane >> 4) << 3)) * 2;
  }
  // Tile t+2 has landed: KV_FULL(t+2) lets S(t+2) start. Before this
  // iteration's load is committed: groups committed so far are tiles
  // NUM_STAGES..t+NUM_STAGES-2, so tile t+2 complete leaves the NUM_STAGES-4
  // newest pending. Where in the iteration: see "Where the PV warps arrive
  // KV_FULL" at the top. Arriving during PV(t)'s MMAs lets S(t+2)'s overlap
  // them instead of following them. Never before BAR_SCORE_MMA_DONE where
  // there is one (the register page path): S(t+2) would then arrive there a
  // second time in the phase PV(t) has yet to take.
  constexpr bool kKvFullBeforeMmas = kPageRing && kFused;
  // The V pair before which the other instances arrive: three quarters of
  // the way through the pairs on the register page path, halfway in the
  // page-ring instance (-1: not in the pair loop).
  constexpr int kKvFullPair = kKvFullBeforeMmas ? -1
                              : kPageRing       ? O_N_TILES / 4
                                                : 3 * O_N_TILES / 8;
  auto arrive_kv_full = [&](int t) {
    if (t + 2 < num_tiles && t + 2 >= NUM_STAGES) {
      static_assert(NUM_STAGES >= 4, "tile t+2's group is at most the second newest here");
      ptx::CpAsyncWait<NUM_STAGES - 4>();
      ptx::NamedBarrierArrive(BAR_KV_FULL + (t & 1), NUM_THREADS);
    }
  };
  uint32_t stage = 0;                                    // byte offset of tile t's stage
  uint32_t free_stage = (NUM_STAGES - 1) * STAGE_BYTES;  // tile t-1's: loaded next
  // Per-half references: O's per row of this lane (rows m * 16 + g + 8 h),
  // and the score warps' per-tile references.
  [[maybe_unused]] float o_ref[M_TILES][2];
#pragma unroll
  for (int m = 0; m < M_TILES; ++m) o_ref[m][0] = o_ref[m][1] = -INFINITY;
  [[maybe_unused]] const float* tile_refs =
      reinterpret_cast<const float*>(smem_raw + Shape::SMEM_EXCHANGE_OFFSET) +
      half_refs::kTileRefsAt;
  [[maybe_unused]] const int* dirty_flags =
      reinterpret_cast<const int*>(smem_raw + Shape::SMEM_EXCHANGE_OFFSET) + half_refs::kDirtyAt;
  for (int t = 0; t < num_tiles; ++t) {
    ptx::NamedBarrierSync(BAR_P_FULL + (t & 1), NUM_THREADS);
    if (t == 0 && tid == SCORE_THREADS) PhaseStamp(kStampPvFirstTile);
    if constexpr (!kHalfRefs) {
      const float* alpha = alpha_s + (t & 1) * BLOCK_M;
      float a[M_TILES][2];
#pragma unroll
      for (int m = 0; m < M_TILES; ++m) {
        a[m][0] = alpha[m * 16 + g];
        a[m][1] = alpha[m * 16 + g + 8];
      }
      // Once the running max settles alpha is 1 on every row: skip the rescale.
      bool unchanged = true;
#pragma unroll
      for (int m = 0; m < M_TILES; ++m) unchanged = unchanged && a[m][0] == 1.0f && a[m][1] == 1.0f;
      if (!__all_sync(0xffffffffu, unchanged)) {
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
#pragma unroll
          for (int n = 0; n < O_N_TILES; ++n) {
            o_acc[m][n][0] *= a[m][0];
            o_acc[m][n][1] *= a[m][0];
            o_acc[m][n][2] *= a[m][1];
            o_acc[m][n][3] *= a[m][1];
          }
      }
    }
    uint32_t p_frag[M_TILES][4];
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
      ptx::LdMatrixX4(p_frag[m], p_frag_addr[m] + (t & 1) * P_BUFFER_BYTES);
    if constexpr (kHalfRefs) {
      // Per-half references (see the top of the file): nothing to do while
      // both halves used O's reference; else R = the largest per row, each
      // half of P scaled by 2^(ref - R) and O by 2^(R_old - R). In the A
      // fragment, registers 0, 1 hold keys 0-7 (key half 0) of rows g, g + 8,
      // registers 2, 3 keys 8-15. The score warps' flags say whether any row
      // may differ; all lanes read the same four words: the branch is uniform.
      const int4 flags = *reinterpret_cast<const int4*>(dirty_flags + (t & 1) * 4);
      if ((flags.x | flags.y | flags.z | flags.w) != 0) {
        const float2* refs = reinterpret_cast<const float2*>(tile_refs) + (t & 1) * BLOCK_M;
        float2 r[M_TILES][2];
        bool same = true;
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            r[m][h] = refs[m * 16 + g + 8 * h];
            same = same && r[m][h].x == o_ref[m][h] && r[m][h].y == o_ref[m][h];
          }
        if (!__all_sync(0xffffffffu, same)) {
          // A row with no visible key in either half nor in O scales by 0.
          auto power = [](float x, float big) {
            return big == -INFINITY ? 0.0f : ptx::Exp2Approx(x - big);
          };
#pragma unroll
          for (int m = 0; m < M_TILES; ++m) {
            float a[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float big = fmaxf(o_ref[m][h], fmaxf(r[m][h].x, r[m][h].y));
              a[h] = power(o_ref[m][h], big);
              const float s0 = power(r[m][h].x, big);
              const float s1 = power(r[m][h].y, big);
              p_frag[m][h] = ptx::MulBf16x2(p_frag[m][h], ptx::PackBf16x2(s0, s0));
              p_frag[m][2 + h] = ptx::MulBf16x2(p_frag[m][2 + h], ptx::PackBf16x2(s1, s1));
              o_ref[m][h] = big;
            }
#pragma unroll
            for (int n = 0; n < O_N_TILES; ++n) {
              o_acc[m][n][0] *= a[0];
              o_acc[m][n][1] *= a[0];
              o_acc[m][n][2] *= a[1];
              o_acc[m][n][3] *= a[1];
            }
          }
        }
      }
    }
    // Wait until the score warps have issued S(t+1)'s MMAs (see the score
    // loop): one arrival per tile from t = 1 on, so this barrier's phases
    // alternate strictly (S(t+2) waits for PV(t) at P_EMPTY).
    if (kPhaseOffset && t + 1 < num_tiles) ptx::NamedBarrierSync(BAR_SCORE_MMA_DONE, NUM_THREADS);
    if (kKvFullBeforeMmas) arrive_kv_full(t);
    uint32_t v_addr[V_OFFSETS];
#pragma unroll
    for (int np = 0; np < V_OFFSETS; ++np) v_addr[np] = kv_base + stage + v_frag_offset[np];
    const uint32_t prev_stage = free_stage;  // tile t-1's, free since P_FULL(t)
    free_stage = stage;
    stage = stage == (NUM_STAGES - 1) * STAGE_BYTES ? 0 : stage + STAGE_BYTES;
#pragma unroll
    for (int np = 0; np < O_N_TILES / 2; ++np) {
      if (np == kKvFullPair) arrive_kv_full(t);
      uint32_t vf[4];
      ptx::LdMatrixX4Trans(vf, v_addr[np % V_OFFSETS] + (np / V_OFFSETS) * 128);
#pragma unroll
      for (int m = 0; m < M_TILES; ++m) {
        ptx::MmaBf16(o_acc[m][2 * np], p_frag[m], vf[0], vf[1]);
        ptx::MmaBf16(o_acc[m][2 * np + 1], p_frag[m], vf[2], vf[3]);
      }
    }
    if (t + 2 < num_tiles) ptx::NamedBarrierArrive(BAR_P_EMPTY + (t & 1), NUM_THREADS);
    // The loads go out after the MMAs: issued before them, their address
    // registers held the MMAs back until the MIO queue had taken all nine
    // cp.async (bench/NOTES.md, "Per-tile instruction diet"); tile t+NUM_STAGES-1 is needed
    // NUM_STAGES-2 tiles later.
    if (t >= 1) {
      // Stage (t-1) % NUM_STAGES is free (see the header): load tile t+NUM_STAGES-1 into it.
      const int load_tile = t + NUM_STAGES - 1;
      if (loader && load_tile < num_tiles) {
        if constexpr (kPageRing) {
          __syncwarp();  // page ids fetched by the row's first thread are visible
          const int page = page_ring[(load_tile % pipelined::PAGE_RING) * BLOCK_N + ld_row];
          issue_tile(load_tile, prev_stage, page, ld_row, ld_lane);
          fetch_page_id(load_tile + pipelined::PAGE_AHEAD);
        } else {
          issue_tile(load_tile, prev_stage, next_page, ld_row, ld_lane);
          next_page = page_of(load_tile + 1, ld_row);
        }
      }
      ptx::CpAsyncCommit();
      if constexpr (kFp8) {
        // FP8: this thread's share of tile t+3 (loaded at the end of
        // iteration t-1) becomes bf16 now, before arrive_kv_full(t+1) shows
        // the tile. Here, with P(t) done and only O live, the conversion
        // costs no spill (in the MMA loop it did on sm_90). Only tile t+4's
        // group, just committed, may still be pending.
        const int convert_tile = t + 3;
        if (convert_tile >= NUM_STAGES && convert_tile < num_tiles) {
          ptx::CpAsyncWait<NUM_STAGES - 4>();
          ConvertFp8Row(kv_base + (convert_tile % NUM_STAGES) * STAGE_BYTES, ld_row, ld_lane);
        }
      }
    }
  }

  // ---- epilogue: normalised O, bf16 to the output or fp32 to the partials ----
  // No cp.async may still write this CTA's shared memory when it exits (the
  // ring's last page-id fetches are never waited for in the loop).
  if (tid == SCORE_THREADS) {
    PhaseStamp(kStampPvDone);
    PhaseCountTiles(num_tiles);
  }
  ptx::CpAsyncWait<0>();
  // After BAR_FINAL every warp is past its last tile: the KV stages are free
  // for the store staging, a region per PV warp.
  ptx::NamedBarrierSync(BAR_FINAL, NUM_THREADS);
  constexpr int STAGING_BYTES = BLOCK_M * (V_COLS_PER_WARP * 2 + 16);
  static_assert(STAGING_BYTES * (NUM_THREADS - SCORE_THREADS) / 32 <= NUM_STAGES * STAGE_BYTES,
                "the store staging fits the KV stages");
  StoreOutputSliceStaged(p, o_acc, inv_l_s, item.row_tile, rows, q_row, heads, partial_slot,
                         pv_warp * V_COLS_PER_WARP,
                         smem_raw + Shape::SMEM_KV_OFFSET + pv_warp * STAGING_BYTES);
  if (tid == SCORE_THREADS) PhaseStamp(kStampStored);
}

// A CTA runs its segments one after the other (one under the chunk plan).
// kFused: the combine folded in (verify_kernel.cuh, "Fused combine"): the CTA
// announces its split segments, then merges its share of their row tiles.
// kFp8: over a pool of fp8 rows (see ConvertFp8Row).
template <bool kPageRing, bool kFused, bool kFp8>
__global__ void __launch_bounds__(pipelined::Shape::NUM_THREADS, 1)
    PipelinedAttentionKernel(const VerifyParams p) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  __shared__ SegmentSmem segments;
  static_assert(!kFused || pipelined::Shape::NUM_THREADS == COMBINE_THREADS,
                "the fused merge runs MergeSplitRows with the attention CTA's threads");
  static_assert(!kFused || sizeof(MergeSmem) <= pipelined::Shape::SMEM_BYTES,
                "the merge reuses the KV stages");
  auto after = [&](const VerifyWorkItem& item) {
    if constexpr (kFused) ArriveSplit(p, segments.summary, item);
    if (threadIdx.x == 0) PhaseStamp(kStampArrived);
  };
  // Both roles pass the same block-wide barriers of ForEachSegment from their
  // own call sites (bar.sync 0 counts threads, not sites), with one shared state.
  if (threadIdx.x < pipelined::Shape::SCORE_THREADS) {
    ForEachSegment<!kFused>(
        p, segments,
        [&](const VerifyWorkItem& item) {
          AttendSegmentPipelined<kPageRing, true, kFused, kFp8>(p, item, smem_raw);
        },
        after);
  } else {
    ForEachSegment<!kFused>(
        p, segments,
        [&](const VerifyWorkItem& item) {
          AttendSegmentPipelined<kPageRing, false, kFused, kFp8>(p, item, smem_raw);
        },
        after);
  }
  if constexpr (kFused) {
    const VerifyPlanSummary summary = segments.summary;  // unchanged since the plan
    if (blockIdx.x >= summary.total_work) return;        // these CTAs did no segment
    __syncthreads();  // both roles are past their last segment (the stream loop's list reads too)
    const int32_t* starts = p.plan_in_warp ? segments.stream_start : p.request_stream_start;
    const int32_t* q_rows = p.plan_in_warp ? segments.q_row : p.request_q_row;
    MergeCtaSplits<true>(p, summary, segments.list[0], starts, q_rows, segments,
                         *reinterpret_cast<MergeSmem*>(smem_raw));
  }
}

}  // namespace mlaverify::kernels::verify

#endif  // MLAVERIFY_KERNELS_VERIFY_PIPELINED_KERNEL_CUH_
