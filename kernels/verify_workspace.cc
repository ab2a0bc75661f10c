#include "kernels/verify_workspace.h"

#include <algorithm>
#include <cstdint>

#include "kernels/verify_params.h"

namespace mlaverify::kernels {
namespace {

constexpr int kBlockM = kVerifyRowsPerCta;
constexpr size_t kAlign = 256;

size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

}  // namespace

int VerifyTargetCtas(const VerifyLaunchConfig& c) { return c.num_sms * c.ctas_per_sm; }

int VerifyMaxWork(const VerifyArguments& a, const VerifyLaunchConfig& c) {
  const int max_row_tiles = (a.max_draft_len * a.num_heads + kBlockM - 1) / kBlockM;
  const int64_t unsplit = static_cast<int64_t>(a.batch) * max_row_tiles;
  return static_cast<int>(std::max<int64_t>(VerifyTargetCtas(c), unsplit));
}

VerifyWorkspaceLayout VerifyWorkspaceLayoutFor(const VerifyArguments& a,
                                               const VerifyLaunchConfig& c) {
  VerifyWorkspaceLayout l{};
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at = AlignUp(at + bytes);
    return here;
  };
  const size_t target_ctas = static_cast<size_t>(VerifyTargetCtas(c));
  // The fused combine's state first (see the header): the mark, then one
  // arrival and one done counter per split row tile (keys below target_ctas).
  l.fused_magic = take(sizeof(unsigned long long));
  l.split_arrivals = take(sizeof(unsigned int) * target_ctas);
  l.split_done = take(sizeof(unsigned int) * target_ctas);
  l.summary = take(sizeof(VerifyPlanSummary));
  l.request_q_row = take(sizeof(int32_t) * a.batch);
  l.request_stream_start = take(sizeof(int32_t) * a.batch);
  l.work = take(sizeof(VerifyWorkItem) * VerifyMaxWork(a, c));
  // Partial slots: the chunk plan splits only into at most target_ctas items
  // (slot = item); a stream-plan CTA has at most two split segments (the
  // first and the last of its range: slots 2x and 2x + 1).
  const size_t partial_slots = 2 * target_ctas;
  l.partial_lse = take(sizeof(float) * partial_slots * kBlockM);
  l.partial_out = take(sizeof(uint16_t) * partial_slots * kBlockM * kValueDim);  // bf16
  l.bytes = at;
  return l;
}

}  // namespace mlaverify::kernels
