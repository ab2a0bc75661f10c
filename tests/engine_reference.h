// What the engine tests believe a sequence's KV is (a mirror of its rows)
// and the CPU reference of one layer's verify over it: shared by the
// engine's Verify tests and its device-driven step tests.
#ifndef MLAVERIFY_TESTS_ENGINE_REFERENCE_H_
#define MLAVERIFY_TESTS_ENGINE_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "common/bf16.h"
#include "common/draft_tree.h"
#include "common/geometry.h"
#include "common/kv_dtype.h"
#include "gtest/gtest.h"
#include "kernels/cpu_reference.h"

namespace mlaverify::engine {

// A sequence's KV as the test believes it is: per layer, rows of 576.
struct Mirror {
  std::vector<std::vector<Bf16>> layers;  // [layer][length * 576]
  int64_t length() const { return static_cast<int64_t>(layers[0].size()) / kLatentDim; }
};

// Rows stored as a pool of `dtype` stores them.
inline std::vector<Bf16> StoredRows(const std::vector<Bf16>& rows, KvDtype dtype) {
  const int64_t count = static_cast<int64_t>(rows.size()) / kLatentDim;
  std::vector<Bf16> stored(static_cast<size_t>(count) * KvRowBytes(dtype) / sizeof(Bf16));
  for (int64_t r = 0; r < count; ++r) {
    StoreLatentRow(dtype, rows.data() + r * kLatentDim,
                   reinterpret_cast<uint8_t*>(stored.data()) + r * KvRowBytes(dtype));
  }
  return stored;
}

// Reference outputs of one layer's verify: the mirror's prefix plus the
// drafts, in a page-size-1 pool with an identity page table.
inline void Reference(const Mirror& m, int layer, const std::vector<Bf16>& draft_kv,
                      const std::vector<int32_t>& parents, const std::vector<Bf16>& q, int heads,
                      float scale, std::vector<Bf16>* out, std::vector<float>* lse,
                      KvDtype dtype = KvDtype::kBf16) {
  const int n = static_cast<int>(parents.size());
  const int32_t prefix = static_cast<int32_t>(m.length());
  std::vector<Bf16> rows(m.layers[layer]);
  rows.insert(rows.end(), draft_kv.begin(), draft_kv.end());
  std::vector<Bf16> pool = StoredRows(rows, dtype);
  std::vector<int32_t> pages(prefix + n);
  for (int32_t k = 0; k < prefix + n; ++k) pages[k] = k;
  const auto vis = mlaverify::BuildVisibility(parents);
  const int32_t zero = 0;
  out->assign(static_cast<size_t>(n) * heads * kValueDim, Bf16{0});
  lse->assign(static_cast<size_t>(n) * heads, 0.0f);
  kernels::VerifyArguments a;
  a.batch = 1;
  a.num_heads = heads;
  a.max_draft_len = n;
  a.total_draft_capacity = n;
  a.q = q.data();
  a.q_token_stride = static_cast<int64_t>(heads) * kLatentDim;
  a.q_head_stride = kLatentDim;
  a.pool = kernels::KvPoolView{pool.data(), 1, prefix + n, 1, dtype};
  a.page_table = pages.data();
  a.page_table_stride = prefix + n;
  a.prefix_len = &prefix;
  a.draft_len = &n;
  a.layer = &zero;
  a.default_softmax_scale = scale;
  a.visibility = vis->data();
  a.out = out->data();
  a.out_token_stride = static_cast<int64_t>(heads) * kValueDim;
  a.out_head_stride = kValueDim;
  a.lse = lse->data();
  ASSERT_TRUE(kernels::VerifyAttentionCpu(a, 1).ok());
}

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_TESTS_ENGINE_REFERENCE_H_
