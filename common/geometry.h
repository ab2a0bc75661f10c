// The MLA latent geometry and the hard limits every layer shares (kernels,
// engine, transport, client). A row of the latent KV cache holds one token of
// one layer: 512 kv_lora_rank columns (also the value dimension) followed by
// 64 rope columns, bf16.
#ifndef MLAVERIFY_COMMON_GEOMETRY_H_
#define MLAVERIFY_COMMON_GEOMETRY_H_

namespace mlaverify {

inline constexpr int kLatentDim = 576;  // d_qk: kv_lora_rank (512) + rope (64)
inline constexpr int kValueDim = 512;   // d_v: the first 512 latent columns
inline constexpr int kRopeDim = kLatentDim - kValueDim;
inline constexpr int kLatentRowBytes = kLatentDim * 2;  // one bf16 row: 1,152 bytes

// Largest draft count one request may carry: a draft's visibility word
// (ancestor-or-self bit set) is 64 bits.
inline constexpr int kMaxDraftLen = 64;
inline constexpr int kMaxHeads = 128;
inline constexpr int kMaxPageSize = 256;
// Longest sequence (prefix + drafts) a request may have: the kernels index
// positions with int32 and split KV ranges in int32 arithmetic.
inline constexpr int kMaxSequenceLen = 1 << 30;
// Most requests one kernel launch takes.
inline constexpr int kMaxBatch = 1024;

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_GEOMETRY_H_
