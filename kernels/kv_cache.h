// KV pool maintenance shared by the CUDA kernels and the CPU backend: writing a
// verify step's draft rows into the pool, and compacting the accepted path at
// commit. Argument structs hold device pointers for CUDA, host pointers for
// the CPU versions (cpu_reference.h).
#ifndef MLAVERIFY_KERNELS_KV_CACHE_H_
#define MLAVERIFY_KERNELS_KV_CACHE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/verify_attention.h"

namespace mlaverify::kernels {

// Copies draft_kv rows of request b (packed like q: request b starts at row
// sum_{b'<b} draft_len[b']) to positions P_b..P_b+N_b-1 of layer layer[b].
struct DraftKvWriteArguments {
  int batch = 0;
  int total_draft_capacity = 0;          // rows available in draft_kv
  const Bf16* draft_kv = nullptr;        // [total_draft, 576]
  int64_t draft_kv_stride = kLatentDim;  // elements between rows
  KvPoolView pool;
  const int32_t* page_table = nullptr;  // [batch, page_table_stride]
  int64_t page_table_stride = 0;
  // [batch] or nullptr: request b's page ids start at page_table +
  // page_table_offset[b] (a device's table arena, as in VerifyArguments)
  // rather than at b * page_table_stride. The CUDA launcher only: the CPU
  // version refuses it.
  const int64_t* page_table_offset = nullptr;
  const int32_t* prefix_len = nullptr;  // [batch]
  const int32_t* draft_len = nullptr;   // [batch] 0..kMaxDraftLen
  const int32_t* layer = nullptr;       // [batch]
};

// For each request: the drafts accepted[b][0..k-1] (a root-to-node path, so
// strictly increasing indices) move from P+accepted[t] to P+t, in every layer
// of the pool. Rows beyond P+k are left as they are (the caller trims pages).
struct CompactArguments {
  int batch = 0;
  KvPoolView pool;
  const int32_t* page_table = nullptr;  // [batch, page_table_stride]
  int64_t page_table_stride = 0;
  const int32_t* prefix_len = nullptr;    // [batch]
  const int32_t* accepted_len = nullptr;  // [batch] k in 0..kMaxDraftLen
  const int32_t* accepted = nullptr;      // [batch, kMaxDraftLen]
};

// Pointer/size checks that need no per-request data (safe for device arrays).
absl::Status CanImplementWrite(const DraftKvWriteArguments& args, bool require_16b_alignment);
absl::Status CanImplementCompact(const CompactArguments& args, bool require_16b_alignment);

// Per-request checks for host-resident arrays.
absl::Status ValidateWriteRequests(const DraftKvWriteArguments& args);
absl::Status ValidateCompactRequests(const CompactArguments& args);

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_KV_CACHE_H_
